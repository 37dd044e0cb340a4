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
checkpoint into an HF directory (the run trains in bf16 weights, so the checkpoint holds
fp32 masters); ``GPT2LMHeadModel.from_pretrained`` of it must give
the logits of the same checkpoint loaded into an oases model at tp=1.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402
from torch.testing import assert_close  # noqa: E402
from transformers import BertConfig, GPT2LMHeadModel  # noqa: E402

from oases.models import build_model  # noqa: E402
from oases.models.hf import load_hf_weights  # noqa: E402
from oases.config import load_config  # noqa: E402
from oases.config.hf import hf_model_fields  # noqa: E402
from oases.errors import CheckpointError, ConfigError  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402
from tests.support.hf_models import (ATOL, VOCAB, B, T, export_and_compare,  # noqa: E402
                                     make_hf_model, save_hf, train_from_hf)
from tests.support.hf_models import (NO_GROUP_WARNING as _SINGLE,  # noqa: E402
                                     edited_hf_dir as _edited, hf_import_body as _import_body,
                                     oases_from_checkpoint as _oases_from_checkpoint)


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

@pytest.fixture(scope="module")
def trained_gpt2(hf_dirs, tmp_path_factory, run_train):
    # in bf16 weights: the checkpoint holds the fp32 masters, which export must write
    return train_from_hf(run_train, hf_dirs["gpt2"][0], tmp_path_factory.mktemp("run") / "gpt2",
                         "train.precision=bf16")


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


@pytest.mark.filterwarnings(_SINGLE)
def test_export_in_bf16(trained_gpt2, tmp_path):
    """``--dtype bf16`` writes each tensor as the fp32 export's bf16 rounding (the
    checkpoint holds fp32 masters whatever the run's precision), and says so in
    config.json."""
    from oases.cli.export import main

    assert main([str(trained_gpt2), "--to-hf", str(tmp_path / "f32")]) == 0
    assert main([str(trained_gpt2), "--to-hf", str(tmp_path / "b16"), "--dtype", "bf16"]) == 0
    a = load_file(tmp_path / "f32" / "model.safetensors")
    b = load_file(tmp_path / "b16" / "model.safetensors")
    assert a.keys() == b.keys()
    for k, t in a.items():
        assert t.dtype == torch.float32 and b[k].dtype == torch.bfloat16, k
        assert torch.equal(b[k], t.to(torch.bfloat16)), k
    dtypes = [json.loads((tmp_path / d / "config.json").read_text())["torch_dtype"]
              for d in ("f32", "b16")]
    assert dtypes == ["float32", "bfloat16"]
