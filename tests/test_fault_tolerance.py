"""Fault tolerance: a killed rank, a hung peer, a non-finite step.

* A rank killed with SIGKILL mid-run under ``torchrun --max-restarts 2``: torchrun
  restarts the group, which resumes (``resume=auto``) from the latest complete
  checkpoint and finishes; every checkpoint left on disk is complete and loads.
* A hung peer (SIGSTOP) makes the other rank's collective time out after
  ``parallel.timeout_s`` with a one-line error naming it (exit status 4), instead
  of hanging.
* A non-finite loss or gradient: ``train.on_nonfinite=stop`` stops with exit
  status 3 before the update and keeps the last good checkpoint; ``skip`` leaves
  the step out (no update, zeroed gradients, counted in ``skipped_steps``), with
  every rank agreeing even when only one rank's gradient shard is NaN.

The worker processes are found through /proc (:mod:`tests.support.torchrun_procs`).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal

import pytest
import torch

from tests.support.configs import TINY_RUN
from tests.support.distributed import run_distributed
from tests.support.torchrun_procs import (metrics, run_with_hung_rank, start_torchrun, wait_for,
                                          worker_pid)

pytestmark = pytest.mark.slow

TINY = TINY_RUN


# ---------------------------------------------------------------------------
# a killed rank


def test_killed_rank_restarts_and_resumes(tmp_path):
    from oases.runtime.checkpoint import full_model_state, is_complete, read_meta

    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    steps = 24
    args = [*TINY, f"out_dir={out}", "parallel.tp=2", f"train.steps={steps}",
            "checkpoint.interval=4", "checkpoint.keep=2", "resume=auto"]
    proc = start_torchrun(args, log, "--max-restarts=2", "--monitor-interval=0.1")
    try:
        latest = out / "checkpoints" / "latest"
        wait_for(latest.exists, proc, log, 180, "the first checkpoint")
        victim = wait_for(lambda: worker_pid(proc.pid, 1), proc, log, 10, "rank 1's pid")
        done_before = max((r["step"] for r in metrics(out) if "loss" in r), default=0)
        os.kill(victim, signal.SIGKILL)
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0, text[-4000:]
    assert done_before < steps, "the run finished before the kill: nothing was tested"
    assert "resumed from" in text, text[-4000:]  # the restarted group resumed

    recs = [r for r in metrics(out) if "loss" in r]
    # trimmed to the checkpoint and continued: steps 1..N once each, in order
    assert [r["step"] for r in recs] == list(range(1, steps + 1))
    assert all(math.isfinite(r["loss"]) for r in recs)

    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == f"step_{steps:06d}"
    listed = sorted(p for p in root.iterdir() if p.is_dir())
    assert [p.name for p in listed] == [f"step_{steps - 4:06d}", f"step_{steps:06d}"], listed
    for ck in listed:
        assert is_complete(ck), ck
        assert read_meta(ck)["step"] == int(ck.name.split("_")[1])
        state = full_model_state(ck)  # reads every model tensor of every shard
        assert state["embed.wte.weight"].shape == (256, 128)
        assert all(torch.isfinite(t).all() for t in state.values())


# ---------------------------------------------------------------------------
# a hung peer: the collective timeout


def test_hung_peer_times_out_with_a_clear_error(tmp_path):
    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    timeout_s = 5
    args = [*TINY, f"out_dir={out}", "parallel.tp=2", "train.steps=100000",
            f"parallel.timeout_s={timeout_s}", "resume=none"]
    rc, text, elapsed = run_with_hung_rank(args, out, log, 180, timeout_s + 25)
    assert rc != 0
    assert elapsed < timeout_s + 20, elapsed
    errs = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    rank0 = [ln for ln in errs if ln.startswith("error: [rank 0] ")]
    assert len(rank0) == 1, text[-4000:]
    assert f"parallel.timeout_s={timeout_s}" in rank0[0] and "peer rank died or hangs" in rank0[0]
    assert "Timed out" in rank0[0] or "timed out" in rank0[0], rank0  # gloo's own words
    # once resumed, rank 1 may see rank 0 gone before torchrun's SIGTERM: one line too
    assert all(ln.startswith("error: [rank 1] ") for ln in errs if ln not in rank0), errs
    assert re.search(r"exitcode\s*:\s*4\b", text), text[-3000:]  # CollectiveError's status


# ---------------------------------------------------------------------------
# non-finite loss or gradients


def _error_line(proc) -> str:
    out = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, out
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    return lines[0]


def test_nonfinite_stop_keeps_the_last_good_checkpoint(tmp_path, run_single):
    """lr=1e30 without warmup: step 1 is finite but makes the weights ~1e30, so step 2's
    LayerNorm variance overflows and its loss is NaN -- a real divergence, deterministic."""
    out = tmp_path / "run"
    args = [*TINY, f"out_dir={out}", "parallel.tp=1", "train.steps=4", "checkpoint.interval=1",
            "train.lr=1e30", "train.warmup_steps=0", "train.on_nonfinite=stop"]
    proc = run_single(args)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    line = _error_line(proc)
    assert "step 2:" in line and "non-finite" in line and "train.on_nonfinite=stop" in line
    assert str(out / "checkpoints" / "step_000001") in line
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert [r["step"] for r in metrics(out)] == [1]


def test_nonfinite_skip_counts_and_continues(tmp_path, run_single):
    out = tmp_path / "run"
    args = [*TINY, f"out_dir={out}", "parallel.tp=1", "train.steps=3", "train.lr=1e30",
            "train.warmup_steps=0", "train.on_nonfinite=skip"]
    proc = run_single(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recs = metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert [r["skipped_steps"] for r in recs] == [0, 1, 2]
    assert math.isfinite(recs[0]["loss"]) and not math.isfinite(recs[1]["loss"])
    assert "step 2: non-finite" in proc.stdout and "step skipped" in proc.stdout
    meta = json.loads((out / "checkpoints" / "step_000003" / "meta.json").read_text())
    assert meta["skipped_steps"] == 2


def _skip_body(ctx, nan_rank: int):
    """train_step with a NaN injected into one rank's gradient shard at step 2."""
    from oases.models import build_model
    from oases.config import load_config
    from oases.dp.reducer import GradReducer
    from oases.runtime.data import TrainBatches
    from oases.runtime.optim import build_optimizer
    from oases.runtime.step import TrainState, train_step

    cfg = load_config(None, [*TINY, f"parallel.tp={ctx.tp}", "train.steps=3",
                             "train.on_nonfinite=skip"]).validate(ctx.world_size)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=cfg.seed)
    opt = build_optimizer(model, cfg.train, ctx.device)
    reducer = GradReducer(model, ctx.dp_group, cfg.parallel.dp_bucket_mb)
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp, cfg.seed)
    inject = {"on": False}
    target = model.layers[1].mlp.fc.weight  # sharded over TP
    target.register_hook(lambda g: g * float("nan") if inject["on"] and ctx.rank == nan_rank
                         else g)

    loss1, norm1 = train_step(TrainState(cfg, ctx, model, opt, reducer), batches, 1e-3)
    assert math.isfinite(loss1) and math.isfinite(norm1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()}
             for n, p in model.named_parameters()}

    inject["on"] = True
    loss2, norm2 = train_step(TrainState(cfg, ctx, model, opt, reducer), batches, 1e-3)
    inject["on"] = False
    # every rank sees the non-finite norm (TP all-reduce / DP reduction), not only nan_rank
    assert not math.isfinite(norm2), (ctx.rank, norm2)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n  # no update
        assert torch.count_nonzero(p.grad) == 0, n  # gradients zeroed
        for k, v in opt.state[p].items():
            assert torch.equal(v, state[n][k]), (n, k)  # Adam state and step untouched

    loss3, norm3 = train_step(TrainState(cfg, ctx, model, opt, reducer), batches, 1e-3)
    assert math.isfinite(loss3) and math.isfinite(norm3)
    assert any(not torch.equal(p, params[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("world,tp", [(2, 2), (2, 1)], ids=["tp2", "dp2"])
def test_nonfinite_gradient_on_one_rank_skips_on_all(world, tp):
    run_distributed(_skip_body, world=world, tp=tp, args=(1,))
