"""Checkpoints load at another (dp, tp) layout, and consolidate to one unsharded file.

Run A trains gpt-tiny at tp=2 (world 2) for 4 steps with a checkpoint every 2
steps and a metrics record every step. Each resharded run resumes A's step-2
checkpoint at another layout and trains steps 3 and 4. The step-3 loss is the
forward of the *same weights* on the *same global batch* (the data position is a
global sample counter; at dp=2 the micro-batch is halved so the global batch is
the same 4 sequences), so it must equal A's step-3 loss up to fp32 rounding.

Tolerance: the layouts differ only in the order of fp32 reductions (row-parallel
partial sums all-reduced over 1, 2 or 4 ranks, the vocab-parallel logsumexp
over 1..4 shards, the DP mean of two half-batch means), a relative error of a
few ulp (6e-8) per op. Measured on CPU: the step-3 loss came out bit-identical at
every layout, the step-3 grad norm within 7e-8 and the step-4 loss within 9e-8
(relative). rtol=1e-5 for the loss (1e-4 for the grad norm and for step 4, which
follows a resharded Adam update) leaves >100x margin for other BLAS kernels,
while a misplaced shard, a wrong vocab row, garbage in a padding row or a lost
Adam moment moves these numbers by > 1e-3.

vocab_size=300 makes the padded vocabulary differ with tp (vocab_pad_to=64:
320 rows at tp=1, 384 at tp=2, 512 at tp=4), so the embedding and its Adam
moments change shape between layouts.

Everything runs in forked gloo workers (tests/support/distributed.py), so no process
re-imports torch: the whole module takes ~15 s on 2 cores.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.configs import CKPT_RUN, CKPT_STEPS
from tests.support.loop import records, train_workers
from tests.support.runs import REPO, resume_copy, subprocess_env

# A training run imports torch._inductor (~2 s of CPU): imported here once, every forked
# worker inherits it.
import torch._inductor.config  # noqa: E402,F401  isort: skip

STEPS = CKPT_STEPS
BASE = CKPT_RUN


def train(out: Path, world: int, tp: int, *extra: str) -> None:
    """The trainer's own loop on ``world`` gloo workers at ``tp``."""
    train_workers(out, world, [*BASE, f"parallel.tp={tp}", *extra])


@pytest.fixture(scope="module")
def run_a(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reshard") / "a"
    train(out, 2, 2, "train.micro_batch_size=4")
    root = out / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert json.loads((root / "step_000002" / "meta.json").read_text())["padded_vocab_size"] == 384
    assert sorted(records(out)) == [1, 2, 3, 4]
    return out


LAYOUTS = {  # name: (world, tp, micro-batch size): every layout has a global batch of 4
    "tp1": (1, 1, 4),
    "tp4": (4, 4, 4),
    "dp2xtp1": (2, 1, 2),
    "dp2xtp2": (4, 2, 2),
    # the same layout with sequence parallelism (which changes no parameter) under oases
    "tp2+sp": (2, 2, 4, "parallel.sequence_parallel=true", "parallel.schedule=oases",
               "parallel.recompute=fine"),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_at_another_layout(layout, run_a, tmp_path):
    world, tp, mbs, *extra = LAYOUTS[layout]
    b = resume_copy(run_a, tmp_path / "b")
    train(b, world, tp, f"train.micro_batch_size={mbs}", "resume=auto", *extra)

    a_recs, b_recs = records(run_a), records(b)
    assert sorted(b_recs) == [1, 2, 3, 4]
    for s in (1, 2):  # A's records up to the checkpoint are kept as they were
        assert b_recs[s] == a_recs[s]
    # step 3: same weights, same batch, another layout -> the same loss up to fp32 rounding
    assert b_recs[3]["loss"] == pytest.approx(a_recs[3]["loss"], rel=1e-5, abs=0), layout
    assert b_recs[3]["grad_norm"] == pytest.approx(a_recs[3]["grad_norm"], rel=1e-4), layout
    assert b_recs[3]["lr"] == a_recs[3]["lr"]
    # step 4 follows an optimizer step whose Adam moments were resharded too: a moment
    # lost on the way (zeros) would change the update and this loss by ~1e-3
    assert math.isfinite(b_recs[4]["loss"])
    assert b_recs[4]["loss"] == pytest.approx(a_recs[4]["loss"], rel=1e-4), layout

    meta = json.loads((b / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert (meta["tp"], meta["dp"], meta["world_size"]) == (tp, world // tp, world)
    assert meta["padded_vocab_size"] == {1: 320, 2: 384, 4: 512}[tp]
    assert meta["data"]["consumed"] == STEPS * 4  # 4 global samples per step, any dp


def _batch(consumed: int, mbs: int = 4):
    from oases.config import DataConfig
    from oases.runtime.data import TrainBatches

    batches = TrainBatches(DataConfig(), 64, 300, mbs, 0, 1, seed=7)
    batches.load_state_dict({"consumed": consumed})
    return batches.next_batch()


def _unsharded_model(vocab_rows: int):
    from oases.models import build_model
    from oases.config import load_config

    cfg = load_config(None, BASE).validate(1)
    return build_model(cfg.model, vocab_rows, seed=None)


@pytest.mark.slow  # a consolidate subprocess
def test_consolidate_matches_the_sharded_run(run_a, tmp_path):
    """`python -m oases.consolidate` (no process group) writes full tensors that give an
    unsharded model (no vocab padding at all) the loss the tp=2 run computed."""
    ck = run_a / "checkpoints" / "step_000002"
    out = tmp_path / "model.pt"
    proc = subprocess.run([sys.executable, "-m", "oases.consolidate", str(ck), "--out", str(out)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"wrote {out}" in proc.stdout and "Traceback" not in proc.stderr
    state = torch.load(out, weights_only=True)
    assert state["embed.wte.weight"].shape == (300, 128)  # padding removed
    assert state["layers.0.attn.qkv.weight"].shape == (3 * 128, 128)  # parts reassembled
    assert not any(".part" in k for k in state)

    model = _unsharded_model(300)
    model.load_state_dict(state)  # strict: exactly our parameter names and shapes
    meta = json.loads((ck / "meta.json").read_text())
    x, y = _batch(meta["data"]["consumed"])
    with torch.no_grad():
        loss = float(model(x, y))
    assert loss == pytest.approx(records(run_a)[3]["loss"], rel=1e-5, abs=0)

    # the QKV parts sit where an unsharded model expects them: q rows, then k, then v
    from oases.runtime.checkpoint import full_model_state

    again = full_model_state(ck)
    assert again.keys() == state.keys()
    assert all(torch.equal(again[k], state[k]) for k in state)


def test_consolidate_run_dir_and_errors(run_a, tmp_path):
    from oases.cli.consolidate import main

    out = tmp_path / "m.pt"
    assert main([str(run_a), "--out", str(out)]) == 0  # a run dir: its latest checkpoint
    state = torch.load(out, weights_only=True)
    model = _unsharded_model(300)
    model.load_state_dict(state)
    x, y = _batch(4 * 4)
    with torch.no_grad():
        assert math.isfinite(float(model(x, y)))

    assert main([str(tmp_path / "nope"), "--out", str(out)]) == 2
    partial = tmp_path / "partial"
    shutil.copytree(run_a / "checkpoints" / "step_000004", partial)
    (partial / ".metadata").unlink()
    assert main([str(partial), "--out", str(out)]) == 2


def test_async_save_writes_the_same_checkpoints(run_a, tmp_path):
    """``checkpoint.async_save=true`` (DCP async_save, written in the background and
    published after the write) gives the same run: the same losses, ``latest`` naming the
    final step, and checkpoints that hold the same tensors as the synchronous run's."""
    from oases.runtime.checkpoint import full_model_state

    b = tmp_path / "b"
    train(b, 2, 2, "train.micro_batch_size=4", "checkpoint.async_save=true")
    ra, rb = records(run_a), records(b)
    assert [rb[s]["loss"] for s in (1, 2, 3, 4)] == [ra[s]["loss"] for s in (1, 2, 3, 4)]
    root = b / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000004"]
    assert (root / "latest").read_text().strip() == "step_000004"
    for step in ("step_000002", "step_000004"):
        for prefix in ("model", "optim.exp_avg"):
            want = full_model_state(run_a / "checkpoints" / step, prefix)
            got = full_model_state(root / step, prefix)
            assert want.keys() == got.keys()
            assert all(torch.equal(want[k], got[k]) for k in want), (step, prefix)
