"""``eval.only=true``: the validation loss of the loaded weights, then exit.

The number written to ``metrics.jsonl`` is checked against an independent
computation: the Hugging Face model (the ``init_from`` source, or the exported
checkpoint) run window by window over the same val tokens -- the first
``eval.max_batches x micro_batch_size`` non-overlapping windows of ``seq_len + 1``
tokens from the file's start -- as the mean over windows of the token-mean
cross-entropy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import LlamaForCausalLM  # noqa: E402

from oases.config import load_config  # noqa: E402
from oases.errors import ConfigError  # noqa: E402
from tests.support.hf_models import VOCAB, make_hf_model, save_hf  # noqa: E402

T, MBS, MAX_BATCHES = 32, 2, 3
N_WINDOWS = MBS * MAX_BATCHES  # dp = 1


def _records(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


@torch.no_grad()
def hf_val_loss(model, val_bin: Path, windows: int = N_WINDOWS) -> float:
    tokens = torch.from_numpy(np.fromfile(val_bin, dtype=np.uint16).astype(np.int64))
    losses = []
    for w in range(windows):
        win = tokens[w * T: w * T + T + 1]
        logits = model(win[None, :-1]).logits[0].float()
        losses.append(F.cross_entropy(logits, win[1:]))
    return float(torch.stack(losses).mean())


@pytest.fixture(scope="module")
def setup(tmp_path_factory, run_train):
    """An untied GQA LLaMA in HF format, a val file, and a 3-step tp=2 run from it."""
    root = tmp_path_factory.mktemp("eval")
    hf = make_hf_model("llama-untied", seed=1)
    hf_dir = save_hf(hf, root / "llama")
    val = root / "val.bin"
    np.random.default_rng(0).integers(0, VOCAB, 40 * T).astype(np.uint16).tofile(val)
    common = [f"model.init_from=hf:{hf_dir}", f"model.seq_len={T}", f"data.val_path={val}",
              f"train.micro_batch_size={MBS}", f"eval.max_batches={MAX_BATCHES}",
              "wandb.mode=disabled"]
    run = root / "run"
    run_train([*common, "parallel.tp=2", f"out_dir={run}", "train.steps=3",
               "train.warmup_steps=0", "train.lr=1e-2", "data.kind=synthetic"])
    return dict(hf=hf, hf_dir=hf_dir, val=val, run=run, common=common)


def test_eval_only_from_init_from(setup, tmp_path, run_single):
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')  # not refused, kept
    proc = run_single([*setup["common"], "eval.only=true", f"out_dir={out}"], expect_rc=0)
    assert "eval.only: val_loss" in proc.stdout
    recs = _records(out)
    assert recs[0] == {"step": 7, "loss": 1.0} and len(recs) == 2
    assert recs[1]["step"] == 0 and set(recs[1]) == {"step", "val_loss"}
    assert recs[1]["val_loss"] == pytest.approx(hf_val_loss(setup["hf"], setup["val"]),
                                                rel=1e-5)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # nothing else written


def test_eval_only_resumes_the_latest_checkpoint(setup, tmp_path, run_single):
    run = setup["run"]
    before = _records(run)
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = run_single([*setup["common"], "eval.only=true", "resume=auto", f"out_dir={run}"],
                      expect_rc=0)
    assert "not loaded: resume=auto continues from" in proc.stdout
    recs = _records(run)
    assert recs[:-1] == before  # appended, nothing trimmed
    assert recs[-1]["step"] == 3 and set(recs[-1]) == {"step", "val_loss"}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ckpts
    # the training run's own final eval (tp=2) saw the same weights and windows
    final = [r for r in before if r.get("step") == 3 and "val_loss" in r]
    assert final and recs[-1]["val_loss"] == pytest.approx(final[-1]["val_loss"], rel=1e-5)
    # independent: HF LLaMA from the exported checkpoint, same windows
    from oases.cli.export import export_checkpoint

    export_checkpoint(run, tmp_path / "hf")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert recs[-1]["val_loss"] == pytest.approx(hf_val_loss(hf, setup["val"]), rel=1e-5)
    assert abs(recs[-1]["val_loss"] - hf_val_loss(setup["hf"], setup["val"])) > 1e-3  # trained


def test_eval_only_evaluates_a_partial_last_batch(setup, tmp_path, run_single):
    """A val file of 2.5 batches (5 windows, micro-batch 2, dp 1) is evaluated whole: the
    last batch holds one window and one padding row, which counts nothing."""
    val = tmp_path / "short.bin"
    np.random.default_rng(1).integers(0, VOCAB, 5 * T + 1 + T // 2).astype(np.uint16).tofile(val)
    out = tmp_path / "out"
    args = [a for a in setup["common"] if not a.startswith("data.val_path=")]
    proc = run_single([*args, f"data.val_path={val}", "eval.only=true", f"out_dir={out}"],
                      expect_rc=0)
    assert "eval.only: val_loss" in proc.stdout
    got = _records(out)[-1]["val_loss"]
    assert got == pytest.approx(hf_val_loss(setup["hf"], val, windows=5), rel=1e-5)
    # not the 2 whole batches alone (the old behaviour), nor the padded row counted
    assert abs(got - hf_val_loss(setup["hf"], val, windows=4)) > 1e-3


def test_eval_only_needs_a_val_file():
    with pytest.raises(ConfigError, match="eval.only=true needs data.val_path"):
        load_config(None, ["eval.only=true"]).validate(1)
