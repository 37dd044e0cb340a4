"""Interleaved 1F1B (``pp_schedule=interleaved-1f1b``, ``parallel.pp_virtual=v``): each
rank runs v chunks of layers, Megatron's virtual pipeline (oases/pipeline/runner.py).

* Against the unsharded run (tests/support/parity.py's ``run_case``, its tolerances:
  losses and the first gradient norm rtol 1e-5, gradients rtol 1e-4 / atol 1e-6), dropout 0.
* Against 1f1b at pp x v stages, dropout on: a chunk draws from the random streams the
  stage of its layers has there (oases.parallel.random.ChunkRNG), in the same
  micro-batch order, and runs the same kernels on the same rows, so the losses and
  gradient norms are bit for bit those of 1f1b (compared with rtol 0), and so are the
  parameters after three Adam steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.parity import MBS, SEQ, WORLD, run_case, stage


def _cfg(arch: str, engine: tuple, kind: str, pp: int, tp: int, *extra: str, virtual: int = 2,
         layers: int = 4, world: int = WORLD, accum: int = 0):
    from oases.config import load_config

    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    return load_config(None, [
        f"model.name={name}", f"model.seq_len={SEQ}", "model.dropout=0.0",
        f"model.n_layer={layers}",
        f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.schedule={engine[0]}",
        f"parallel.recompute={engine[1]}", f"parallel.pp_schedule={kind}",
        f"parallel.pp_virtual={virtual if kind == 'interleaved-1f1b' else 1}",
        f"train.grad_accum={accum or 2 * pp}", f"train.micro_batch_size={MBS}",
        "train.warmup_steps=0", "train.lr=1e-3", "data.kind=synthetic",
        "wandb.mode=disabled", *extra]).validate(world)


def _unsharded_body(rank: int, cases: list) -> None:
    from oases.parallel.layout import uniform_layout

    for arch, engine, pp, tp, virtual, layers, extra, *accum in cases:
        cfg = _cfg(arch, engine, "interleaved-1f1b", pp, tp, *extra, virtual=virtual,
                   layers=layers, accum=accum[0] if accum else 0)
        run_case(rank, cfg, uniform_layout(WORLD, pp, tp, cfg.model.n_layer), 2,
                 f"interleaved v{virtual} {arch} {engine} pp{pp} tp{tp} {extra}")


def test_interleaved_matches_unsharded():
    # every case runs under the NCCL point-to-point emulation (run_distributed's default):
    # a receive posted out of the peer's order would hang and fail it; m = pp and 3 pp too
    run_distributed(_unsharded_body, world=WORLD, tp=None, args=([
        ("gpt", ("megatron", "none"), 2, 2, 2, 4, ()),
        ("llama", ("oases", "fine"), 2, 2, 2, 4, ()),
        ("gpt", ("oases", "none"), 2, 2, 2, 4, (), 2),
        ("llama", ("megatron", "selective"), 2, 2, 2, 4, (), 6),
    ],))


def test_chunks_are_the_even_split_and_a_plan_of_other_ranges_is_refused():
    from oases.errors import ConfigError
    from oases.parallel.layout import stages_layout, uniform_layout

    lay = uniform_layout(4, 2, 2, 8)
    assert [lay.chunks(s, 2) for s in (0, 1)] == [((0, 2), (4, 6)), ((2, 4), (6, 8))]
    assert lay.chunks(1, 4) == ((1, 2), (3, 4), (5, 6), (7, 8))
    uneven = stages_layout([{"layers": [0, 5], "dp": 1, "tp": 2},
                            {"layers": [5, 8], "dp": 1, "tp": 2}], 4, 8, "p.yaml", 4)
    with pytest.raises(ConfigError, match=r"^interleaved-1f1b runs each stage's layers as 2 "
                       r"equal chunks at the stage's TP degree; stage 0 has layers 0-4 "
                       r"\(the even split gives 0-3\)$"):
        uneven.chunks(0, 2)
    degrees = stages_layout([{"layers": [0, 4], "dp": 1, "tp": 2, "degrees": [2, 1] * 4},
                             {"layers": [4, 8], "dp": 1, "tp": 2}], 4, 8, "p.yaml", 4)
    with pytest.raises(ConfigError, match=r"stage 0 has layers 0-3 at degrees \[2, 1,"):
        degrees.chunks(1, 2)
    with pytest.raises(ConfigError, match=r"^6 layers do not divide into pp=2 x pp_virtual=2"):
        uniform_layout(4, 2, 2, 6).chunks(0, 2)


_RUN = ["model.name=gpt-tiny", f"model.seq_len={SEQ}", "model.n_layer=4", "parallel.pp=2",
        "parallel.tp=1", "parallel.schedule=megatron", "train.grad_accum=4",
        "train.micro_batch_size=2", "train.steps=4", "train.warmup_steps=0",
        "data.kind=synthetic", "data.val_path=", "checkpoint.interval=2",
        "wandb.mode=disabled", "resume=auto"]
_INTERLEAVED = ["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual=2"]


@pytest.mark.slow  # two whole runs
def test_an_interleaved_run_resumes_exactly(tmp_path):
    """Saved at step 2 and resumed: every chunk's random streams come back (dropout on),
    so steps 3 and 4 are the uninterrupted run's bit for bit."""
    from tests.support.loop import records, train_workers
    from tests.support.runs import resume_copy

    args = [*_RUN, *_INTERLEAVED, "model.dropout=0.1"]
    a = tmp_path / "a"
    train_workers(a, 2, args)
    b = resume_copy(a, tmp_path / "b")
    train_workers(b, 2, args)
    ra, rb = records(a), records(b)
    assert [rb[s]["loss"] for s in (3, 4)] == [ra[s]["loss"] for s in (3, 4)], (ra, rb)


@pytest.mark.slow  # three whole runs
def test_a_checkpoint_resumes_across_interleaving(tmp_path):
    """1f1b -> interleaved-1f1b and back at pp=2 (dropout 0: the two hold different
    layers per rank, so their random streams differ): steps 3 and 4 give the
    uninterrupted run's losses within rtol 1e-6 (the same kernels per layer; only the
    gradient norm's sum runs in another order, which the clip coefficient carries)."""
    from tests.support.loop import records, train_workers
    from tests.support.runs import resume_copy

    a = tmp_path / "a"
    train_workers(a, 2, _RUN)
    b = resume_copy(a, tmp_path / "b")
    train_workers(b, 2, [*_RUN, *_INTERLEAVED])
    c = tmp_path / "c"
    train_workers(c, 2, [*_RUN, *_INTERLEAVED])
    d = resume_copy(c, tmp_path / "d")
    train_workers(d, 2, _RUN)
    ra, rb, rc, rd = records(a), records(b), records(c), records(d)
    for step in (3, 4):
        for want, got in ((ra, rb), (rc, rd)):
            assert abs(got[step]["loss"] - want[step]["loss"]) <= 1e-6 * want[step]["loss"], \
                (step, want[step]["loss"], got[step]["loss"])


def test_the_start_up_line_names_each_ranks_chunks():
    from oases.parallel.layout import uniform_layout

    assert uniform_layout(4, 2, 1, 8).describe(2) == (
        "stage 0: layers 0-1, 4-5 dp 2 x tp 1 | stage 1: layers 2-3, 6-7 dp 2 x tp 1")
    assert uniform_layout(4, 2, 1, 8).describe() == (
        "stage 0: layers 0-3 dp 2 x tp 1 | stage 1: layers 4-7 dp 2 x tp 1")


@pytest.mark.slow  # two whole runs
def test_a_plan_file_runs_interleaved(tmp_path):
    """A plan's even stages (what the layout search proposes for interleaved-1f1b) run
    as the run without a plan does, bit for bit."""
    from tests.support.loop import records, train_workers

    plan = tmp_path / "plan.yaml"
    plan.write_text("stages:\n  - {layers: [0, 2], dp: 1, tp: 1}\n"
                    "  - {layers: [2, 4], dp: 1, tp: 1}\n"
                    "pp_schedule: interleaved-1f1b\npp_virtual: 2\n")
    a, b = tmp_path / "a", tmp_path / "b"
    train_workers(a, 2, [*_RUN, *_INTERLEAVED, "model.dropout=0.1"])
    train_workers(b, 2, [*_RUN, *_INTERLEAVED, "model.dropout=0.1", f"parallel.plan={plan}"])
    ra, rb = records(a), records(b)
    assert [rb[s]["loss"] for s in range(1, 5)] == [ra[s]["loss"] for s in range(1, 5)]
