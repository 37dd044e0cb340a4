"""Llama 3.x RoPE scaling, Qwen2 and Mistral from and to Hugging Face.

Tiny random HF models built in code (as tests/test_hf.py, whose helpers run the
checks): a Llama with Llama 3 RoPE scaling (GQA, tied), Qwen2 with q/k/v biases (tied
with one kv head, so at tp=2 the kv head and its biases are replicated; and untied),
Mistral with a sliding window of 8 over 32 tokens. Imported at tp=2 they give HF's
logits and loss within 1e-4 (fp32; each shard is also exactly the shard of the tp=1
import); imported, trained 3 steps and exported, HF loads them with the architecture
and RoPE of the source and gives oases's own logits and loss. Unsupported fields are
refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from torch.testing import assert_close  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2ForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

from oases.models import build_model  # noqa: E402
from oases.models.hf import export_hf, load_hf_weights  # noqa: E402
from oases.models.rope import Rotary, rope_inv_freq  # noqa: E402
from oases.config import ModelConfig, load_config  # noqa: E402
from oases.config.hf import hf_model_fields  # noqa: E402
from oases.errors import ConfigError  # noqa: E402
from oases.parallel.loss import IGNORE_INDEX  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402
from tests.support.hf_models import (ARCH_KINDS, ATOL, LLAMA3, VOCAB, B, T,  # noqa: E402
                                     export_and_compare, make_hf_model, save_hf, train_from_hf)
from tests.support.hf_models import (NO_GROUP_WARNING as _SINGLE,  # noqa: E402
                                     edited_hf_dir as _edited, hf_import_body as _import_body)


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    """kind -> (directory, ids, HF logits)."""
    root = tmp_path_factory.mktemp("hf-archs")
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    out = {}
    for kind in ARCH_KINDS:
        model = make_hf_model(kind, kinds=ARCH_KINDS)
        d = save_hf(model, root / kind)
        with torch.no_grad():
            out[kind] = (d, ids, model(ids).logits.float())
    return out


def test_fields_of_each_arch(arch_dirs, tmp_path):
    f = hf_model_fields(arch_dirs["llama3"][0])
    assert (f["arch"], f["rope_type"], f["rope_factor"], f["rope_low_freq_factor"],
            f["rope_high_freq_factor"], f["rope_original_max_len"]) == \
        ("llama", "llama3", 8.0, 1.0, 4.0, 16)
    # the published Llama 3.x spelling: rope_scaling + rope_theta, no rope_parameters
    d = _edited(arch_dirs["llama3"][0], tmp_path / "old", rope_parameters=None,
                rope_scaling={"rope_type": "llama3", **{k: v for k, v in LLAMA3.items()
                                                        if k != "rope_type"}},
                rope_theta=10000.0)
    assert hf_model_fields(d) == f
    q = hf_model_fields(arch_dirs["qwen2"][0])
    assert (q["arch"], q["n_kv_heads"], q["rope_theta"], q["bias"]) == ("qwen2", 1, 1e6, False)
    assert hf_model_fields(arch_dirs["mistral"][0])["sliding_window"] == 8


@pytest.mark.parametrize("kind", list(ARCH_KINDS))
def test_import_matches_hf_at_tp2(arch_dirs, kind):
    d, ids, ref = arch_dirs[kind]
    run_distributed(_import_body, world=2, tp=2, args=(str(d), ids, ref))


@pytest.mark.parametrize("kind", list(ARCH_KINDS))
def test_train_export_roundtrip(arch_dirs, kind, tmp_path):
    """Import, 3 AdamW steps, export the full state (the path every checkpoint layout
    takes, tests/test_hf.py test_export_roundtrip): HF gives oases's own logits and loss."""
    d, ids, before = arch_dirs[kind]
    cfg = load_config(None, [f"model.init_from=hf:{d}", "model.seq_len=32"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=None)
    load_hf_weights(model, d, 0, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    for _ in range(3):
        opt.zero_grad()
        model(ids, targets).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        ours, our_loss = model.full_logits(ids), model(ids, targets)
    out = export_hf(model.state_dict(), cfg.model, tmp_path / "hf")
    theirs = json.loads((d / "config.json").read_text())
    mine = json.loads((out / "config.json").read_text())
    for k in ("architectures", "model_type", "tie_word_embeddings", "sliding_window",
              "rope_parameters"):
        assert mine.get(k) == theirs.get(k), k
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == theirs["architectures"][0]
    with torch.no_grad():
        got = hf(ids, labels=ids)
    assert_close(got.logits, ours, rtol=0, atol=ATOL)
    assert_close(got.loss, our_loss, rtol=0, atol=ATOL)
    assert (ours - before).abs().max() > 1e-2  # training moved the weights


@pytest.mark.filterwarnings(_SINGLE)
def test_qwen2_trained_at_tp2_exports_through_its_checkpoint(arch_dirs, tmp_path, run_train):
    """Its q/k/v biases sharded with their columns, its one kv head (and bias) replicated
    on both ranks, saved in a checkpoint and exported by ``python -m oases.export``."""
    d, ids, before = arch_dirs["qwen2"]
    run = train_from_hf(run_train, d, tmp_path / "run")
    hf = export_and_compare(run, tmp_path / "hf", ids, before)
    assert isinstance(hf, Qwen2ForCausalLM)


@pytest.mark.parametrize("kind, changes, msg", [
    ("qwen2", {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": 8},
     "use_sliding_window=true is not supported"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]},
     "layer_types='sliding_attention' is not supported"),
    ("llama3", {"rope_parameters": None, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_type='yarn' is not supported"),
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     "rope_type='llama3' needs low_freq_factor"),
    ("llama3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ("mistral", {"head_dim": 32}, "head_dim=32 x num_attention_heads=4 != hidden_size=64"),
    ("llama3", {"sliding_window": 8}, "sliding_window=8 is not supported for LlamaForCausalLM"),
])
def test_unsupported_fields_are_refused_by_name(arch_dirs, tmp_path, kind, changes, msg):
    d = _edited(arch_dirs[kind][0], tmp_path / "m", **changes)
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [f"model.init_from=hf:{d}"]).validate(1)


_L3 = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
           original_max_position_embeddings=8192)


@pytest.mark.parametrize("size, overrides, head_dim, rope", [
    ("llama3-8b", {}, 128, dict(_L3, factor=8.0)),                  # Llama-3.1-8B
    ("llama3-1b", {}, 64, dict(_L3, factor=32.0)),                  # Llama-3.2-1B
    ("llama3-8b", dict(rope_type="linear", rope_factor=4.0), 128,
     dict(rope_type="linear", factor=4.0)),
    ("llama-1b", {}, 64, dict(rope_type="default")),
])
def test_rope_tables_are_transformers(size, overrides, head_dim, rope):
    """The inverse frequencies and the cos/sin tables of positions 0..16383 are exactly
    transformers' for the published parameters (theta 500000)."""
    n = 16384
    mc = ModelConfig(name=size, seq_len=n, **overrides)
    mc.resolve()
    hf_cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072,
                         rope_parameters=dict(rope, rope_theta=500000.0))
    init = ROPE_INIT_FUNCTIONS.get(rope["rope_type"],
                                   LlamaRotaryEmbedding.compute_default_rope_parameters)
    assert torch.equal(rope_inv_freq(mc), init(hf_cfg)[0])
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), torch.arange(n)[None])
    ours = Rotary.from_config(mc)
    assert_close(ours.cos, cos[0], rtol=0, atol=1e-6)
    assert_close(ours.sin, sin[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("overrides, msg", [
    (["model.name=llama-tiny", "model.rope_type=yarn"], "model.rope_type='yarn' is not one of"),
    (["model.name=llama-tiny", "model.sliding_window=8"], "model.sliding_window=8 needs arch"),
    (["model.name=llama-tiny", "model.rope_type=dynamic", "model.rope_factor=2",
      "model.rope_original_max_len=64"], "model.seq_len=128 exceeds model.rope_original_max_len"),
    (["model.name=gpt-tiny", "model.rope_type=linear"], "arch=gpt has learned positions"),
    (["model.name=qwen2-0.5b", "model.bias=true"], "model.bias=true is not supported"),
    (["model.name=llama-tiny", "model.arch=mistral", "model.bias=true"],
     "model.bias=true is not supported for arch=mistral"),
])
def test_bad_model_fields(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, overrides).validate(1)
