"""Pipeline checkpoints: exact resume on the same layout, resharding across pp and stage
layouts.

Run A trains gpt-tiny (tied embeddings) at pp=2 (world 2) for 4 steps with a
checkpoint every 2 steps. Each other run resumes A's step-2 checkpoint:

* at the same layout: steps 3 and 4 are bit-identical to A's (CPU kernels are
  deterministic, the data position and every RNG state are restored);
* at pp=1, pp=4, pp=2 x tp=2 and stages tp 1 x dp 2 | tp 2 (the tied embedding
  sharded differently on its two stages, saved once): every rank reads only its
  stage's parameters,
  and the step-3 loss is the forward of the same weights on the same global
  batch (4 micro-batches of one sequence at every layout), equal up to fp32
  rounding (rtol 1e-5, as tests/test_reshard.py argues); step 4 follows a
  resharded Adam update (rtol 1e-4).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.configs import MIXED_STAGES
from tests.support.loop import records, train_workers
from tests.support.runs import resume_copy

STEPS = 4
BASE = ["model.name=gpt-tiny", "model.seq_len=32", "data.kind=synthetic", f"train.steps={STEPS}",
        "train.lr=3e-3", "train.warmup_steps=2", "train.log_interval=1", "train.grad_accum=4",
        "train.micro_batch_size=1", "checkpoint.interval=2", "checkpoint.keep=2",
        "eval.interval=0", "wandb.mode=disabled", "seed=11"]


def train(out: Path, world: int, *extra: str) -> None:
    train_workers(out, world, [*BASE, *extra])


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pp_ckpt") / "a"
    train(out, 2, "parallel.pp=2")
    meta = json.loads((out / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["pp"] == 2 and [s["layers"] for s in meta["stages"]] == [[0, 2], [2, 4]]
    assert 0.0 <= records(out)[4]["pipeline_bubble"] < 1.0
    return out


def test_resume_same_layout_is_exact(run_a, tmp_path):
    b = resume_copy(run_a, tmp_path / "b")
    train(b, 2, "parallel.pp=2", "resume=auto")
    a, r = records(run_a), records(b)
    for s in (3, 4):
        assert r[s]["loss"] == a[s]["loss"] and r[s]["grad_norm"] == a[s]["grad_norm"], s


LAYOUTS = {  # name: (world, overrides)
    "pp1": (1, ["parallel.pp=1"]),
    "pp4": (4, ["parallel.pp=4"]),
    "pp2xtp2": (4, ["parallel.pp=2", "parallel.tp=2"]),
    # the tied embedding on stages of different tp: each stage holds the table sharded
    # its own way; the checkpoint holds it once
    "tp1xdp2|tp2": (4, ["parallel.pp=2", "train.grad_accum=2"]),  # 2 x 2 sequences
}
STAGES = {"tp1xdp2|tp2": MIXED_STAGES}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_at_another_pipeline_layout(layout, run_a, tmp_path):
    import yaml

    world, extra = LAYOUTS[layout]
    if layout in STAGES:
        plan = tmp_path / "plan.yaml"
        plan.write_text(yaml.safe_dump({"stages": STAGES[layout]}))
        extra = [*extra, f"parallel.plan={plan}"]
    b = resume_copy(run_a, tmp_path / "b")
    train(b, world, *extra, "resume=auto")
    a, r = records(run_a), records(b)
    assert r[3]["loss"] == pytest.approx(a[3]["loss"], rel=1e-5, abs=0), layout
    assert r[3]["grad_norm"] == pytest.approx(a[3]["grad_norm"], rel=1e-4), layout
    assert r[4]["loss"] == pytest.approx(a[4]["loss"], rel=1e-4), layout
    meta = json.loads((b / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert meta["data"]["consumed"] == STEPS * 4
