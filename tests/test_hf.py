"""Hugging Face interop: import GPT-2 / LLaMA checkpoints at tp = 1, 2, 4, export back.

Every HF model is tiny and built from a config object in code (no hub access), with
``vocab_size=250`` so the vocabulary is padded (to 256 at tp <= 4) and the padding
path is exercised. Import is checked by logits: oases's ``full_logits`` against HF's
``model(ids).logits`` (both fp32, eval mode, dropout 0) within 1e-4 absolute -- a
wrong transpose, a swapped q/k/v or gate/up part, a mis-sharded slice or a nonzero
padded row all change logits at the 1e-2 level and up. Each rank's shard is also
compared exactly with ``shard(full, spec, rank, tp)`` of the tp=1 import.

Export is checked end to end: ``train.py`` under torchrun (tp=2) starts from an HF
GPT-2, trains a few steps and checkpoints; ``python -m oases.export`` turns the
checkpoint into an HF directory; ``GPT2LMHeadModel.from_pretrained`` of it must give
the logits of the same checkpoint loaded into an oases model at tp=1.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from transformers import (AutoModelForCausalLM, BertConfig, GPT2Config,  # noqa: E402
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM)

from oases.models import build_model  # noqa: E402
from oases.models.hf import load_hf_weights  # noqa: E402
from oases.config import load_config  # noqa: E402
from oases.config.hf import hf_model_fields  # noqa: E402
from oases.errors import CheckpointError, ConfigError  # noqa: E402
from oases.parallel.loss import IGNORE_INDEX  # noqa: E402
from oases.parallel.sharding import shard  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

VOCAB = 250          # not a multiple of 64: padded to 256
ATOL = 1e-4
B, T = 2, 32


_LLAMA_SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                   max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
# kind -> (config class, model class, changes to the LLaMA shape); tests/test_hf_archs.py
# adds Llama 3 RoPE, Qwen2 and Mistral
HF_KINDS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
}


def make_hf_model(kind: str, seed: int = 0, kinds: dict = HF_KINDS):
    """A tiny, randomly initialised HF model: ``gpt2``, or one of ``kinds``
    (``llama``: GQA, tied; ``llama-untied``: GQA, separate lm_head)."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    else:
        config_cls, model_cls, changes = kinds[kind]
        model = model_cls(config_cls(**{**_LLAMA_SHAPE, **changes}))
        with torch.no_grad():  # norms are ones at init: make them count
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(1.0, 0.1)
    with torch.no_grad():  # biases are zeros at init: make them count too
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.05)
    return model.eval()


def save_hf(model, out: Path, fmt: str = "safetensors") -> Path:
    """``save_pretrained`` (safetensors; ``sharded``: several files + index), or a torch
    pickle ``pytorch_model.bin`` with old-style GPT-2 names (no ``transformer.`` prefix)."""
    if fmt == "safetensors":
        model.save_pretrained(out)
    elif fmt == "sharded":
        model.save_pretrained(out, max_shard_size="40KB")
        assert (out / "model.safetensors.index.json").is_file()
    else:
        model.config.save_pretrained(out)
        sd = {k.removeprefix("transformer."): v.clone() for k, v in model.state_dict().items()}
        torch.save(sd, out / "pytorch_model.bin")
    return out


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """kind -> (directory, ids, HF logits): the reference for every import test."""
    root = tmp_path_factory.mktemp("hf")
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    out = {}
    for kind, model_kind, fmt in (("gpt2", "gpt2", "safetensors"),
                                  ("gpt2-bin", "gpt2", "bin"),
                                  ("llama", "llama", "safetensors"),
                                  ("llama-untied", "llama-untied", "safetensors"),
                                  ("llama-sharded", "llama-untied", "sharded")):
        model = make_hf_model(model_kind)
        d = save_hf(model, root / kind, fmt)
        with torch.no_grad():
            out[kind] = (d, ids, model(ids).logits.float())
    return out


# ---------------------------------------------------------------------------
# config.json -> ModelConfig

def test_fields_from_config_json(hf_dirs):
    plain = dict(rope_theta=10000.0, rope_type="default", rope_factor=1.0,
                 rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=64,
                 sliding_window=0)
    g = hf_model_fields(hf_dirs["gpt2"][0])
    assert g == dict(arch="gpt", n_layer=2, d_model=64, n_head=4, n_kv_heads=4, ffn_hidden=256,
                     vocab_size=VOCAB, seq_len=64, norm_eps=1e-5, tie_embeddings=True,
                     bias=True, **plain)
    lm = hf_model_fields(hf_dirs["llama-untied"][0])
    assert lm == dict(arch="llama", n_layer=2, d_model=64, n_head=4, n_kv_heads=2,
                      ffn_hidden=128, vocab_size=VOCAB, seq_len=64, norm_eps=1e-5,
                      tie_embeddings=False, bias=False, **plain)
    assert hf_model_fields(hf_dirs["llama"][0])["tie_embeddings"] is True


def test_init_from_overrides_the_named_size(hf_dirs):
    d = hf_dirs["llama"][0]
    m = load_config(None, ["model.name=gpt-125m", f"model.init_from=hf:{d}",
                           "model.seq_len=32"]).validate(1).model
    assert (m.arch, m.n_layer, m.d_model, m.n_kv_heads, m.vocab_size, m.seq_len) == \
        ("llama", 2, 64, 2, VOCAB, 32)  # seq_len may be set below the checkpoint's 64


@pytest.mark.parametrize("override, msg", [
    ("model.n_layer=3", "model.n_layer=3 disagrees with n_layer=2"),
    ("model.seq_len=128", "model.seq_len=128 disagrees with seq_len=64"),
    ("model.tie_embeddings=false", "model.tie_embeddings=False disagrees with tie_embeddings=True"),
])
def test_disagreeing_override_is_an_error(hf_dirs, override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [f"model.init_from=hf:{hf_dirs['gpt2'][0]}", override]).validate(1)


def _edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of HF dir ``src`` whose config.json has ``changes`` (None deletes a key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind, changes, msg", [
    ("gpt2", {"activation_function": "relu"}, "activation_function='relu' is not supported"),
    ("llama", {"attention_bias": True}, "attention_bias=true is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true is not supported"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling and rope_parameters disagree on rope_type \\('linear' vs 'default'\\)"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type='yarn' is not supported \\(supported: default, linear, dynamic, llama3\\)"),
    ("llama", {"architectures": ["FalconForCausalLM"], "model_type": None},
     "unsupported architecture FalconForCausalLM \\(supported: GPT2LMHeadModel, "
     "LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM\\)"),
    ("gpt2", {"architectures": None, "model_type": "t5"}, "unsupported architecture t5"),
])
def test_unsupported_config_is_an_error(hf_dirs, tmp_path, kind, changes, msg):
    d = _edited(hf_dirs[kind][0], tmp_path / "m", **changes)
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [f"model.init_from=hf:{d}"]).validate(1)


def test_missing_directory_or_config_json(tmp_path):
    with pytest.raises(ConfigError, match="directory does not exist"):
        load_config(None, [f"model.init_from=hf:{tmp_path / 'nope'}"]).validate(1)
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(None, [f"model.init_from=hf:{tmp_path}"]).validate(1)
    with pytest.raises(ConfigError, match="not of the form hf:<dir>"):
        load_config(None, [f"model.init_from={tmp_path}"]).validate(1)


def test_llama_with_two_kv_heads_at_tp4_and_tp8(hf_dirs):
    # tp=4 replicates the 2 kv heads (import and export at tp=4: tests/test_gqa.py);
    # tp=8 would split the 4 query heads
    load_config(None, [f"model.init_from=hf:{hf_dirs['llama'][0]}", "parallel.tp=4"]).validate(4)
    with pytest.raises(ConfigError, match="parallel.tp=8 does not divide model.n_head=4"):
        load_config(None, [f"model.init_from=hf:{hf_dirs['llama'][0]}",
                           "parallel.tp=8"]).validate(8)


# ---------------------------------------------------------------------------
# Import: logits at tp = 1, 2, 4

def _import_body(ctx, hf_dir, ids, ref):
    cfg = load_config(None, [f"model.init_from=hf:{hf_dir}", f"parallel.tp={ctx.tp}",
                             "model.dropout=0"]).validate(ctx.world_size)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=None)
    load_hf_weights(model, hf_dir, ctx.tp_rank, ctx.tp)
    model.eval()
    assert_close(model.full_logits(ids), ref, rtol=0, atol=ATOL)
    # the loss HF computes with labels=ids (next-token, shifted)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    hf_loss = F.cross_entropy(ref[:, :-1].reshape(-1, ref.shape[-1]), ids[:, 1:].reshape(-1))
    with torch.no_grad():
        assert_close(model(ids, targets), hf_loss, rtol=0, atol=ATOL)
        if ctx.tp > 1 and ids.shape[1] % ctx.tp == 0:  # the same import under SP
            model.set_sequence_parallel(True)
            assert_close(model(ids, targets), hf_loss, rtol=0, atol=ATOL)
            model.set_sequence_parallel(False)
    # every shard is exactly shard(full) of the unsharded import
    full = build_model(cfg.model, cfg.padded_vocab_size, None, seed=None)
    load_hf_weights(full, hf_dir, 0, 1)
    fp = dict(full.named_parameters())
    for name, p in model.named_parameters():
        want = shard(fp[name].detach(), p.tp_spec, ctx.tp_rank, ctx.tp)
        assert torch.equal(p.detach(), want), name
    # the padded vocabulary rows are zero
    wte = fp["embed.wte.weight"]
    assert wte.shape[0] == cfg.padded_vocab_size > VOCAB and not wte[VOCAB:].any()


@pytest.mark.parametrize("kind, tp", [("gpt2", 1), ("gpt2", 2), ("gpt2", 4), ("gpt2-bin", 2),
                                      ("llama", 1), ("llama", 2), ("llama-untied", 2),
                                      ("llama-sharded", 2)])
def test_import_matches_hf_logits(hf_dirs, kind, tp):
    d, ids, ref = hf_dirs[kind]
    run_distributed(_import_body, world=tp, tp=tp, args=(str(d), ids, ref))


def test_shape_disagreement_and_missing_tensor(hf_dirs, tmp_path):
    src = hf_dirs["gpt2"][0]
    d = _edited(src, tmp_path / "vocab", vocab_size=200)  # config.json says 200, weights 250
    cfg = load_config(None, [f"model.init_from=hf:{d}"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=None)
    with pytest.raises(CheckpointError, match=r"tensor transformer\.wte\.weight has shape "
                                              r"\(250, 64\) in the weights but config\.json "
                                              r"implies \(200, 64\)"):
        load_hf_weights(model, d, 0, 1)
    d = shutil.copytree(src, tmp_path / "missing")
    sd = load_file(d / "model.safetensors")
    del sd["transformer.ln_f.bias"]
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    cfg = load_config(None, [f"model.init_from=hf:{d}"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=None)
    with pytest.raises(CheckpointError, match=r"tensor transformer\.ln_f\.bias is missing"):
        load_hf_weights(model, d, 0, 1)


@pytest.mark.parametrize("how", ["parent", "absolute", "not a mapping"])
def test_index_that_names_files_outside_its_directory(hf_dirs, tmp_path, how):
    """A sharded checkpoint's index is data: a weight_map entry outside the directory
    (``../``, absolute) would have the loader read any file; refused before any is
    opened, like a weight_map that is not names to file names."""
    d = shutil.copytree(hf_dirs["llama-sharded"][0], tmp_path / "hf")
    index = d / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name, file = next(iter(data["weight_map"].items()))
    (d / file).rename(tmp_path / file)  # the shard now lies beside the directory
    data["weight_map"][name] = {"parent": f"../{file}", "absolute": str(tmp_path / file),
                                "not a mapping": [file]}[how]
    if how == "not a mapping":
        data["weight_map"] = list(data["weight_map"].items())
    index.write_text(json.dumps(data))
    cfg = load_config(None, [f"model.init_from=hf:{d}"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=None)
    msg = ("weight_map is not a mapping of tensor names to file names" if how == "not a mapping"
           else f"puts {re.escape(name)} in '.*{re.escape(file)}', which is outside")
    with pytest.raises(CheckpointError, match=msg):
        load_hf_weights(model, d, 0, 1)


# ---------------------------------------------------------------------------
# Bad input through train.py: one line, exit status 2

def test_bad_hf_input_is_one_line_exit_2(hf_dirs, tmp_path, run_single):
    bert = tmp_path / "bert"
    BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(bert)
    shapes = _edited(hf_dirs["gpt2"][0], tmp_path / "shapes", n_inner=128)
    cases = [
        (tmp_path / "nope", "init_from hf:.*nope: directory does not exist"),
        (bert, "unsupported architecture bert \\(supported: GPT2LMHeadModel, LlamaForCausalLM, "
               "Qwen2ForCausalLM, MistralForCausalLM\\)"),
        (shapes, r"c_fc\.(bias|weight) has shape \((64, )?256\) in the weights but config\.json "
                 r"implies \((64, )?128\)"),
    ]

    def one(i_case):
        i, (d, _) = i_case
        return run_single([f"model.init_from=hf:{d}", f"out_dir={tmp_path / f'run{i}'}",
                           "train.steps=1", "wandb.mode=disabled"], timeout=120)

    with ThreadPoolExecutor(len(cases)) as ex:  # three processes at once: wall time of one
        procs = list(ex.map(one, enumerate(cases)))
    for proc, (_, msg) in zip(procs, cases):
        assert proc.returncode == 2, proc.stderr
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr
        assert re.search(msg, lines[0]), lines[0]


# ---------------------------------------------------------------------------
# Export: train from HF under TP, export the checkpoint, load it with HF

def train_from_hf(run_train, hf_dir: Path, out: Path, *extra: str) -> Path:
    """3 steps from ``hf_dir`` under torchrun at tp=2 (and ``extra``); checkpoints at
    steps 2 and 3."""
    run_train([f"model.init_from=hf:{hf_dir}", "parallel.tp=2", f"out_dir={out}",
               "model.seq_len=32", "train.steps=3", "train.micro_batch_size=2",
               "train.warmup_steps=0", "train.lr=1e-2", "checkpoint.interval=2",
               "wandb.mode=disabled", "data.kind=synthetic", *extra])
    return out


@pytest.fixture(scope="module")
def trained_gpt2(hf_dirs, tmp_path_factory, run_train):
    return train_from_hf(run_train, hf_dirs["gpt2"][0], tmp_path_factory.mktemp("run") / "gpt2")


def _oases_from_checkpoint(run_dir: Path, ck: Path):
    """The checkpoint loaded into an oases model at tp=1 (the trainer's own loader)."""
    from oases.parallel.groups import ParallelContext
    from oases.runtime import checkpoint as ckpt
    from oases.runtime.optim import build_optimizer
    from oases.runtime.trainer import model_shape

    cfg = load_config(str(run_dir / "config.yaml"), ["parallel.tp=1"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=None)
    ctx = ParallelContext.single()
    meta, _ = ckpt.load(ck, model, build_optimizer(model, cfg.train, ctx.device), ctx,
                        model_shape(cfg))
    return model.eval(), meta


_SINGLE = "ignore:torch.distributed is disabled:UserWarning"  # ckpt.load without a group


def export_and_compare(run_dir: Path, out: Path, ids: torch.Tensor, before: torch.Tensor):
    """``python -m oases.export`` of ``run_dir``'s latest (step 3) checkpoint: HF loads it
    with the logits of the checkpoint loaded into oases, moved by training."""
    proc = subprocess.run([sys.executable, "-m", "oases.export", str(run_dir), "--to-hf",
                           str(out)], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step_000003" in proc.stdout  # a run dir exports its latest checkpoint
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ours, meta = _oases_from_checkpoint(run_dir, run_dir / "checkpoints" / "step_000003")
    assert meta["step"] == 3
    with torch.no_grad():
        theirs = hf(ids).logits
    assert_close(theirs, ours.full_logits(ids), rtol=0, atol=ATOL)
    assert (theirs - before).abs().max() > 1e-2  # training moved the weights
    return hf


@pytest.mark.filterwarnings(_SINGLE)
def test_export_roundtrip(trained_gpt2, hf_dirs, tmp_path):
    out = tmp_path / "hf"
    _, ids, before = hf_dirs["gpt2"]
    assert isinstance(export_and_compare(trained_gpt2, out, ids, before), GPT2LMHeadModel)
    assert len(load_file(out / "model.safetensors")) == len(
        load_file(hf_dirs["gpt2"][0] / "model.safetensors"))  # tied: no lm_head written


@pytest.mark.filterwarnings(_SINGLE)
def test_export_of_a_step_dir_and_refusals(trained_gpt2, hf_dirs, tmp_path, capsys):
    from oases.cli.export import main

    step2 = trained_gpt2 / "checkpoints" / "step_000002"
    out = tmp_path / "hf2"
    assert main([str(step2), "--to-hf", str(out)]) == 0
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    ours, _ = _oases_from_checkpoint(trained_gpt2, step2)
    _, ids, _ = hf_dirs["gpt2"]
    with torch.no_grad():
        assert_close(hf(ids).logits, ours.full_logits(ids), rtol=0, atol=ATOL)
    capsys.readouterr()
    assert main([str(step2), "--to-hf", str(out)]) == 2  # non-empty: refused
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main([str(tmp_path / "nope"), "--to-hf", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
