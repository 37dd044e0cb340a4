"""``build_run(cfg, ctx) -> Run`` and ``Run.step()``: a run driven step by step from outside
(a test, a benchmark, a notebook) is the run ``trainer.train`` drives, loss for loss, and
its components decide their own timing."""

from __future__ import annotations

import json
from pathlib import Path

from oases.config import load_config
from oases.runtime import trainer
from oases.runtime.run import Run, build_run
from tests.support.single_world import world_of_one

TINY = ["model.name=gpt-tiny", "model.seq_len=32", "data.kind=synthetic", "parallel.tp=1",
        "train.micro_batch_size=2", "train.steps=4", "train.log_interval=1",
        "eval.interval=0", "wandb.mode=disabled", "metrics.comm_clock=false"]


def _cfg(out: Path, *extra: str):
    cfg = load_config(None, [*TINY, f"out_dir={out}", *extra]).validate(1).freeze()
    trainer.check_out_dir(cfg)  # what trainer.run does before joining the world
    return cfg


def test_stepping_a_run_by_hand_is_the_trained_run(tmp_path):
    with world_of_one(tmp_path) as ctx:
        trainer.train(_cfg(tmp_path / "loop", "checkpoint.interval=0"), ctx)
        run = build_run(_cfg(tmp_path / "hand", "checkpoint.interval=2"), ctx)
        assert isinstance(run, Run) and run.start == 0 and not run.complete
        losses, saved = [], []
        with run:
            for step in range(run.start, 4):
                result = run.step(step)
                losses.append(result.loss)
                saved.append(run.checkpointer.maybe_save(step + 1, run.skipped))
    logged = [json.loads(x) for x in
              (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]
    assert losses == [r["loss"] for r in logged if "loss" in r]  # bit for bit
    # the checkpointer's own timing: checkpoint.interval=2 saves after steps 2 and 4 only
    assert [s is not None for s in saved] == [False, True, False, True]
    assert sorted(p.name for p in (tmp_path / "hand" / "checkpoints").glob("step_*")) == \
        ["step_000002", "step_000004"]

