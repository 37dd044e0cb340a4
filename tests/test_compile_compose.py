"""``parallel.compile`` with the other parallel paths: compiled against eager losses.

Each layout trains gpt-tiny (2 layers) for 2 steps with dropout 0.1 through the trainer's
own loop on two gloo workers, eager and then compiled, and compares the losses:
pipelines (pp = 2, 1F1B), ZeRO-3 (dp = 2), ``overlap_fb``, bf16 autocast, per-block TP
degrees (a plan file) and sequence parallelism under both engines. Dropout draws eager's
masks in compiled code, so the losses agree to float rounding (fused float32 kernels:
~1e-7 relative; bf16: ~1e-5); a mask drawn anew moves a loss by far more (~1e-2).
All layouts share one pair of workers, so a graph compiled for one layout is reused by
the next.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.distributed import run_distributed
from tests.support.loop import records, train_worker

pytestmark = pytest.mark.slow

BASE = ["model.name=gpt-tiny", "model.n_layer=2", "model.seq_len=32", "model.dropout=0.1",
        "data.kind=synthetic", "data.val_path=", "train.steps=2", "train.log_interval=1",
        "train.micro_batch_size=4", "eval.interval=0", "checkpoint.save_final=false",
        "wandb.mode=disabled", "parallel.sub_batches=1"]
OASES = ["parallel.tp=2", "parallel.schedule=oases"]
# name: (overrides, relative tolerance)
LAYOUTS = {
    "pp=2, 1F1B, 4 micro-batches": (["parallel.tp=1", "parallel.pp=2", "train.grad_accum=4"],
                                    1e-6),
    "dp=2, ZeRO-3": (["parallel.tp=1", "parallel.zero=3"], 1e-6),
    "tp=2, oases+fine, overlap_fb": ([*OASES, "parallel.recompute=fine",
                                      "parallel.overlap_fb=true", "train.grad_accum=2"], 1e-6),
    "tp=2, oases+full, bf16": ([*OASES, "parallel.recompute=full", "train.precision=bf16"],
                               1e-4),
    "tp=2, oases+fine, plan [2,1,2,1]": ([*OASES, "parallel.recompute=fine",
                                         "parallel.plan={plan}"], 1e-6),
    "tp=2, oases+fine, sequence parallel": ([*OASES, "parallel.recompute=fine",
                                             "parallel.sequence_parallel=true"], 1e-6),
    "tp=2, megatron+full, sequence parallel": (["parallel.tp=2", "parallel.recompute=full",
                                                "parallel.sequence_parallel=true"], 1e-6),
}


def _body(rank: int, root: str) -> None:
    plan = f"{root}/plan.yaml"
    for i, (name, (extra, rtol)) in enumerate(LAYOUTS.items()):
        losses = {}
        for compiled in ("false", "true"):
            out = f"{root}/{i}-{compiled}"
            train_worker(rank, [*BASE, *(e.format(plan=plan) for e in extra),
                                f"parallel.compile={compiled}", f"out_dir={out}"])
            losses[compiled] = [r["loss"] for r in records(Path(out)).values()]
        eager, comp = losses["false"], losses["true"]
        assert len(eager) == len(comp) == 2, (name, eager, comp)
        for a, b in zip(eager, comp):
            assert abs(a - b) <= rtol * abs(a), f"{name}: eager {eager} vs compiled {comp}"


def test_compiled_losses_equal_eager_on_every_parallel_path(tmp_path):
    (tmp_path / "plan.yaml").write_text("degrees: [2, 1, 2, 1]\n")
    # a stage compiling its blocks keeps its peer waiting far beyond a schedule's usual wait
    run_distributed(_body, world=2, tp=None, args=(str(tmp_path),), nccl_timeout_s=300)
