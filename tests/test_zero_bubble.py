"""Zero-bubble pipelines (``pp_schedule=zb-h1``, ``eager-zb-h1``): each backward split
into B (input gradients, TP collectives) and W (the linear layers' weight gradients,
deferred: oases/parallel/wgrad.py), W's moved into the bubble.

* Against the unsharded run (tests/support/parity.py's ``run_case``, its tolerances:
  losses rtol 1e-5, gradients rtol 1e-4 / atol 1e-6): pp=2 x tp=2 and pp=4, both
  engines, GPT and LLaMA, dropout 0.
* Against 1f1b at the same layout, dropout on, ZeRO-1 and ZeRO-3 at dp=2, 3 steps: the
  same RNG streams draw the same masks (W draws nothing) and the same matmuls run (dW
  summed per weight over sub-batches before it is accumulated, where 1f1b accumulates
  each: float rounding), so the losses agree within rtol 1e-6, the gradient norms
  within rtol 1e-5 and the parameters after three Adam steps within
  tests/test_zero.py's ``PARAM_ATOL``.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.parity import MBS, SEQ, WORLD, run_case, stage
from tests.support.zero_levels import PARAM_ATOL


def _cfg(arch: str, engine: tuple, kind: str, pp: int, tp: int, *extra: str):
    from oases.config import load_config

    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    return load_config(None, [
        f"model.name={name}", f"model.seq_len={SEQ}", "model.dropout=0.0",
        f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.schedule={engine[0]}",
        f"parallel.recompute={engine[1]}", f"parallel.pp_schedule={kind}",
        f"train.grad_accum={2 * pp}", f"train.micro_batch_size={MBS}",
        "train.warmup_steps=0", "train.lr=1e-3", "data.kind=synthetic",
        "wandb.mode=disabled", *extra]).validate(WORLD)


def _unsharded_body(rank: int, cases: list) -> None:
    from oases.parallel.layout import uniform_layout

    for arch, engine, kind, pp, tp in cases:
        cfg = _cfg(arch, engine, kind, pp, tp)
        run_case(rank, cfg, uniform_layout(WORLD, pp, tp, cfg.model.n_layer), 2,
                 f"{kind} {arch} {engine} pp{pp} tp{tp}")


def test_zb_h1_matches_unsharded():
    run_distributed(_unsharded_body, world=WORLD, tp=None, args=([
        ("gpt", ("megatron", "none"), "zb-h1", 2, 2),
        ("llama", ("oases", "fine"), "zb-h1", 2, 2),
    ],))


@pytest.mark.slow
def test_pp4_and_eager_zb_h1_match_unsharded():
    run_distributed(_unsharded_body, world=WORLD, tp=None, args=([
        ("llama", ("megatron", "full"), "zb-h1", 4, 1),
        ("gpt", ("oases", "full"), "zb-h1", 4, 1),
        ("gpt", ("oases", "fine"), "eager-zb-h1", 2, 2),
        ("llama", ("megatron", "selective"), "eager-zb-h1", 4, 1),
    ],))


def _steps(cfg, layout, steps: int = 3):
    """Losses and gradient norms of ``steps`` steps, and the parameters after them, whole
    (tp 1) with every ZeRO level's owned ranges gathered back."""
    from oases.runtime.step import train_step

    ctx, model, ts, batches = stage(cfg, layout)
    losses, norms = zip(*[train_step(ts, batches, cfg.train.lr) for _ in range(steps)])
    with ts.reducer.ownership.unsharded(ts.opt, model):
        return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _against_1f1b_body(rank: int, cases: list) -> None:
    from oases.parallel.layout import uniform_layout

    for arch, engine, pp, tp, zero in cases:
        extra = ("model.dropout=0.1", f"parallel.zero={zero}")
        ref_cfg = _cfg(arch, engine, "1f1b", pp, tp, *extra)
        layout = uniform_layout(WORLD, pp, tp, ref_cfg.model.n_layer)
        ref_losses, ref_norms, ref_params = _steps(ref_cfg, layout)
        losses, norms, params = _steps(_cfg(arch, engine, "zb-h1", pp, tp, *extra), layout)
        what = f"zb-h1 vs 1f1b {arch} {engine} pp{pp} tp{tp} zero{zero}"
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-6,
                                   atol=0, msg=lambda m: f"{what}: losses: {m}")
        # the gradient norm sees every gradient (Adam's update hides a gradient's scale)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{what}: gradient norms: {m}")
        for name, p in params.items():
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=PARAM_ATOL,
                                       msg=lambda m: f"{what}: {name}: {m}")


@pytest.mark.slow  # ~5 s; test_zb_h1_matches_unsharded is zb-h1's fast-tier check
def test_zb_h1_with_dropout_and_zero_is_1f1b():
    # pp=2 x dp=2 (tp 1): ZeRO-1 under megatron, ZeRO-3 under oases
    run_distributed(_against_1f1b_body, world=WORLD, tp=None, args=([
        ("gpt", ("megatron", "none"), 2, 1, 1),
        ("llama", ("oases", "fine"), 2, 1, 3),
    ],))


@pytest.mark.slow  # two whole runs each
@pytest.mark.parametrize("before,after", [("1f1b", "zb-h1"), ("eager-zb-h1", "eager-1f1b")])
def test_a_checkpoint_resumes_under_another_schedule(tmp_path, before, after):
    """Saved at step 2 under one schedule, resumed under another: steps 3 and 4 give the
    uninterrupted run's losses (within rtol 1e-6: dW is accumulated at W, in the same
    micro-batch order, so only float rounding could differ)."""
    from tests.support.loop import records, train_workers
    from tests.support.runs import resume_copy

    args = ["model.name=gpt-tiny", f"model.seq_len={SEQ}", "model.dropout=0.1",
            "parallel.pp=2", "parallel.tp=1", "parallel.schedule=megatron",
            "train.grad_accum=4", "train.micro_batch_size=2", "train.steps=4",
            "train.warmup_steps=0", "data.kind=synthetic", "data.val_path=",
            "checkpoint.interval=2", "wandb.mode=disabled", "resume=auto"]
    a = tmp_path / "a"
    train_workers(a, 2, [*args, f"parallel.pp_schedule={before}"])
    b = resume_copy(a, tmp_path / "b")
    train_workers(b, 2, [*args, f"parallel.pp_schedule={after}"])
    ra, rb = records(a), records(b)
    for step in (3, 4):
        assert abs(rb[step]["loss"] - ra[step]["loss"]) <= 1e-6 * abs(ra[step]["loss"]), \
            (step, ra[step]["loss"], rb[step]["loss"])
