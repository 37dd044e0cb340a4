"""The architecture registry (oases/config/archs/): each architecture declares once its
module, named sizes, Hugging Face config.json mapping and weight layout, and every part
of oases reads them there.

* A new architecture is one spec and one ``register_arch``: the example of
  docs/custom-blocks.md, run as written, registers ``llama-gelu`` (a LLaMA with a
  tanh-GELU MLP and a size of its own with another norm eps), and config validation,
  the sizes lookup, the model build, a whole in-process training run at tp=1,
  ``model_stats`` and the planner's shape all see it; a spec may name a module of its
  own (a class in this test module).
* The planner prices what the model builds: parameters per block, weight matrices and
  norms, for every registered architecture (the planner once took only ``llama`` for a
  gated MLP, so Qwen2 and Mistral were priced with 2/3 of their MLP and no q/k/v biases).
* Every architecture with an HF mapping round-trips its ``config.json`` (oases fields ->
  config.json -> the same fields), transformers reads it as the same model, and its
  weight layout names every parameter the model has.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

from pathlib import Path

import numpy as np
import pytest
import torch

from oases.config import ModelConfig, load_config
from oases.config.arch import ArchSpec
from oases.config.archs import arch_names, get_arch, hf_archs, register_arch, unregister_arch
from oases.config.hf import hf_config_dict, hf_model_fields
from oases.config.sizes import find_size, model_sizes
from oases.errors import ConfigError, UserError
from oases.models import GPT, Llama, Mistral, Qwen2, arch_class, build_model, model_stats
from oases.models.blocks import GeluMLP, SwiGLUMLP
from oases.models.hf import hf_layout, model_fields
from oases.planner.shape import ModelShape
from oases.runtime import trainer
from tests.support.single_world import world_of_one
from tests.support.torchrun_procs import metrics

BUILTIN = {"gpt": GPT, "llama": Llama, "qwen2": Qwen2, "mistral": Mistral}
# a small shape every architecture accepts (GPT: as many kv heads as heads)
SMALL = dict(n_layer=2, d_model=64, n_head=4, ffn_hidden=96, vocab_size=256, seq_len=32)


DOC = Path(__file__).resolve().parent.parent / "docs" / "custom-blocks.md"


class GeluLlama(Llama):
    """A module of a test's own, for a spec to name."""


@pytest.fixture
def llama_gelu():
    """The new-arch example of docs/custom-blocks.md, run as written: its spec."""
    m = re.search(r"<!-- example:new-arch -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert m, "docs/custom-blocks.md lost its new-arch example"
    before = arch_names()
    exec(compile(m.group(1), "docs/custom-blocks.md:new-arch", "exec"), {})
    (name,) = set(arch_names()) - set(before)
    try:
        yield get_arch(name)
    finally:
        unregister_arch(name)


def _small(arch: str, **changes) -> ModelConfig:
    """SMALL for ``arch``, its other fields from its first size (or LLaMA's)."""
    spec = get_arch(arch)
    n_kv = 2 if spec.gqa else SMALL["n_head"]
    name = next(iter(spec.sizes), "llama-tiny")
    mc = ModelConfig(name=name, arch=arch, n_kv_heads=n_kv, **SMALL, **changes)
    mc.resolve()
    mc.validate()
    return mc


def test_the_builtin_architectures_and_their_modules():
    assert arch_names()[:4] == tuple(BUILTIN)
    for name, cls in BUILTIN.items():
        assert arch_class(name) is cls
    assert [s.name for s in hf_archs()][:4] == list(BUILTIN)
    assert find_size("qwen2-0.5b")["arch"] == "qwen2" and find_size("gpt-tiny")["arch"] == "gpt"
    with pytest.raises(ConfigError, match="model.arch='lama' is not one of gpt, llama, qwen2, "
                                          "mistral \\(did you mean 'llama'\\?\\)"):
        get_arch("lama")


@pytest.mark.parametrize("arch, changes", [
    ("gpt", {}), ("gpt", dict(bias=False, tie_embeddings=False)),
    ("llama", {}), ("llama", dict(bias=True)), ("qwen2", {}), ("mistral", {}),
    ("qwen2", dict(tie_embeddings=True)),
])
def test_the_planner_prices_what_the_model_builds(arch, changes):
    mc = _small(arch, **changes)
    with torch.device("meta"):
        model = build_model(mc, mc.vocab_size, seed=None, device="meta")
    shape = ModelShape.from_config(mc)
    layer = model.layers[0]
    for kind, blk in (("attn", layer.attn), ("mlp", layer.mlp)):
        params = dict(blk.named_parameters())
        assert shape.block_params(kind) == sum(p.numel() for p in params.values()), kind
        assert shape.matrix_params(kind) == sum(p.numel() for n, p in params.items()
                                                if p.dim() == 2), kind
        assert shape.norm_params(kind) == sum(p.numel() for n, p in params.items()
                                              if n.startswith("norm.")), kind
    kv = layer.attn.qkv  # the k and v rows of the fused q|k|v, with their biases
    kv_rows = 2 * mc.n_kv_heads * mc.head_dim
    assert shape.kv_params() == kv_rows * (mc.d_model + (kv.bias is not None))
    n_params, _ = model_stats(mc, mc.vocab_size)
    assert sum(shape.block_params(k) for k in shape.kinds()) + shape.other_params() == n_params


def _hf_cases():
    """(arch, ModelConfig overrides) for every registered architecture with an HF
    mapping: each of its sizes, and a small shape with what it alone accepts."""
    out = []
    for spec in hf_archs():
        out += [(spec.name, dict(name=s)) for s in spec.sizes]
        extra = dict(sliding_window=8) if spec.sliding_window else {}
        out.append((spec.name, dict(extra, tie_embeddings=False)))
    return out


@pytest.mark.parametrize("arch, overrides", _hf_cases())
def test_every_arch_round_trips_its_hf_config(arch, overrides, tmp_path):
    if "name" in overrides:
        mc = ModelConfig(**overrides)
        mc.resolve()
        mc.validate()
    else:
        mc = _small(arch, **overrides)
    assert mc.arch == arch
    cfg_json = hf_config_dict(mc)
    assert cfg_json["architectures"] == [get_arch(arch).hf.architecture]
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    back = hf_model_fields(tmp_path)
    mine = model_fields(mc)
    unused = get_arch(arch).unused_fields()
    assert {k: v for k, v in back.items() if k not in unused} == \
        {k: v for k, v in mine.items() if k not in unused}
    # the same model once more, through an ModelConfig that init_from fills
    again = ModelConfig(name=mc.name, init_from=f"hf:{tmp_path}")
    again.resolve()
    assert model_fields(again) == back
    # the weight layout names every parameter the model has, and nothing else
    small = dataclasses.replace(mc, n_layer=1)
    with torch.device("meta"):
        model = build_model(small, small.vocab_size, seed=None, device="meta")
    layout, _ = hf_layout(model_fields(small))
    assert set(layout) == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("arch", [s.name for s in hf_archs()])
def test_transformers_reads_each_exported_config(arch, tmp_path):
    """The config.json oases writes, read by transformers and saved again as it saves
    configs, maps back to the same oases fields."""
    transformers = pytest.importorskip("transformers")
    extra = dict(sliding_window=8) if get_arch(arch).sliding_window else {}
    mc = _small(arch, tie_embeddings=False, **extra)
    d = hf_config_dict(mc)
    hf = transformers.AutoConfig.for_model(d["model_type"], **{
        k: v for k, v in d.items() if k not in ("model_type", "dtype")})
    hf.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == \
        d["architectures"]
    assert hf_model_fields(tmp_path) == model_fields(mc)


def test_a_new_architecture_is_one_registration(llama_gelu):
    assert "llama-gelu" in arch_names()
    assert model_sizes()["llama-gelu-tiny"]["arch"] == "llama-gelu"
    cfg = load_config(None, ["model.name=llama-gelu-tiny"]).validate(1)
    m = cfg.model
    assert (m.arch, m.norm_eps, m.n_kv_heads, m.rope_type) == ("llama-gelu", 1e-3, 2, "default")
    # the spec's rules are the config's: no window, no learned positions to refuse RoPE
    with pytest.raises(ConfigError, match="model.sliding_window=8 needs arch=mistral "
                                          "\\(arch=llama-gelu attends"):
        load_config(None, ["model.name=llama-gelu-tiny", "model.sliding_window=8"]).validate(1)
    with pytest.raises(ConfigError, match="did you mean 'llama-gelu-tiny'"):
        load_config(None, ["model.name=llama-gelu-tinny"]).validate(1)
    model = build_model(m, cfg.padded_vocab_size, seed=0)
    assert type(model) is Llama and not model.learned_positions
    blk = model.layers[0]
    assert isinstance(blk.mlp, GeluMLP) and not isinstance(blk.mlp, SwiGLUMLP)
    assert tuple(blk.mlp.fc.weight.shape) == (96, 64)  # one up projection, not gate | up
    assert blk.attn.norm.eps == 1e-3 and blk.attn.qkv.bias is None
    # forward + backward reach every parameter
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    loss.backward()
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near uniform at init
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    # model_stats and the planner count the same model
    n_params, flops = model_stats(m, cfg.padded_vocab_size)
    assert n_params == model.num_params()
    shape = ModelShape.from_config(m)
    assert sum(shape.block_params(k) for k in shape.kinds()) + shape.other_params() == n_params
    assert shape.matrix_params("mlp") == 2 * 96 * 64
    assert flops == 6.0 * (model.num_params(exclude_embeddings=True) + 256 * 64) + \
        12.0 * 2 * 64 * 32
    with pytest.raises(UserError, match="model.arch='llama-gelu' has no Hugging Face export"):
        hf_config_dict(m)


def test_a_new_architecture_trains_in_process(llama_gelu, tmp_path):
    """A whole run (the trainer's build, engine, optimizer and metrics) at tp=1, on a
    corpus of period 16 that a working model learns within a few steps."""
    tokens = tmp_path / "train.bin"
    np.tile(np.arange(16, dtype=np.uint16), 512).tofile(tokens)
    out = tmp_path / "run"
    cfg = load_config(None, [
        "model.name=llama-gelu-tiny", "data.kind=tokens", f"data.train_path={tokens}",
        "data.dtype=uint16", "train.steps=8", "train.micro_batch_size=4",
        "train.log_interval=1", "train.warmup_steps=0", "train.lr=1e-2", "eval.interval=0",
        "wandb.mode=disabled", f"out_dir={out}"]).validate(1).freeze()
    with world_of_one(tmp_path) as ctx:
        trainer.check_out_dir(cfg)
        trainer.train(cfg, ctx)
    losses = [r["loss"] for r in metrics(out) if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.5 and losses[-1] < losses[0] - 1.0, losses


def test_registration_refuses_clashes(llama_gelu):
    with pytest.raises(ValueError, match="'llama-gelu' is already registered"):
        register_arch(llama_gelu)
    with pytest.raises(ValueError, match="size 'llama-tiny' is already arch 'llama'"):
        register_arch(dataclasses.replace(llama_gelu, name="other",
                                          sizes={"llama-tiny": llama_gelu.sizes[
                                              "llama-gelu-tiny"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM \\(llama\\) is already arch 'llama'"):
        register_arch(dataclasses.replace(get_arch("llama"), name="other", sizes={}))
    with pytest.raises(ValueError, match="module='GeluLlama' is not 'package.module:Class'"):
        ArchSpec(name="x", module="GeluLlama")
    unregister_arch("llama-gelu")
    with pytest.raises(ConfigError, match="model.arch='llama-gelu' is not one of"):
        load_config(None, ["model.name=llama-tiny", "model.arch=llama-gelu"]).validate(1)


def test_a_spec_names_a_module_of_its_own(llama_gelu):
    spec = register_arch(dataclasses.replace(llama_gelu, name="gelu-own",
                                             module=f"{__name__}:GeluLlama", sizes={}))
    try:
        cfg = load_config(None, ["model.name=llama-gelu-tiny", "model.arch=gelu-own"]).validate(1)
        model = build_model(cfg.model, cfg.padded_vocab_size, seed=0)
        assert type(model) is GeluLlama and isinstance(model.layers[0].mlp, GeluMLP)
        register_arch(dataclasses.replace(spec, name="not-a-model", module="oases.config:Config"))
        with pytest.raises(TypeError, match="module='oases.config:Config' is not a CausalLM"):
            arch_class("not-a-model")
    finally:
        unregister_arch("gelu-own")
        unregister_arch("not-a-model")
