"""``parallel.sub_batches=auto``: the counts a run can take, the choice between measured
candidates, what needs no measuring, and a real measurement on two ranks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from oases.parallel.groups import ParallelContext
from oases.runtime import sub_batches as S
from tests.support.configs import tiny_config
from tests.support.distributed import run_distributed


def _cfg(*over, world=2):
    return tiny_config(*over, world=world, schedule="oases", recompute="fine")


def _ctx(tp: int) -> ParallelContext:
    return dataclasses.replace(ParallelContext.single(), tp=tp, world_size=tp)


@pytest.mark.parametrize("over,degrees,want", [
    (["train.micro_batch_size=4"], None, [1, 2]),
    (["train.micro_batch_size=3"], None, [1]),
    (["train.micro_batch_size=8", "parallel.sequence_parallel=true"], None, [1, 2, 4]),
    (["train.micro_batch_size=4", "parallel.sequence_parallel=true"], None, [1, 2, 4]),
    # a block at degree 1 of tp 2 splits each sub-batch in two: 4 rows -> 1 or 2 sub-batches
    (["train.micro_batch_size=4"], [2, 1] * 2, [1, 2]),
    (["train.micro_batch_size=2"], [2, 1] * 2, [1]),
])
def test_candidates(over, degrees, want):
    assert S.candidates(_cfg("parallel.tp=2", *over), _ctx(2), degrees) == want


def test_the_fastest_wins_only_by_a_margin():
    assert S.fastest_split({1: 1.00, 2: 0.99}) == 1   # within 3%: fewer sub-batches
    assert S.fastest_split({1: 1.00, 2: 0.90}) == 2
    assert S.fastest_split({1: 1.00, 2: 0.90, 4: 0.89}) == 2
    assert S.fastest_split({1: 1.00, 2: 0.90, 4: 0.80}) == 4
    assert S.fastest_split({1: 0.50, 2: 0.90, 4: 0.80}) == 1


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process
def test_what_needs_no_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "measure_splits", lambda *a, **k: pytest.fail("measured"))
    cfg, words = S.resolve(_cfg("parallel.schedule=megatron", "parallel.recompute=full"),
                           _ctx(2), None)
    assert words == "" and cfg.parallel.sub_batches == "auto"
    cfg, words = S.resolve(_cfg("parallel.tp=2", "parallel.sub_batches=2"), _ctx(2), None)
    assert words == "2 sub-batches" and cfg.sub_batches == 2
    cfg, words = S.resolve(_cfg("parallel.tp=1", world=1), _ctx(1), None)
    assert (cfg.sub_batches, words) == (1, "1 sub-batch (auto, no TP collective to hide)")
    cfg, words = S.resolve(_cfg("parallel.tp=2"), _ctx(2), [1] * 4)  # every block at degree 1
    assert cfg.sub_batches == 1
    cfg, words = S.resolve(_cfg("parallel.tp=2", "train.micro_batch_size=1"), _ctx(2), None)
    assert words == "1 sub-batch (auto, the only count the micro-batch takes)"
    # a resumed run takes its checkpoint's count
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "run"
    step = out / "checkpoints" / "step_000004"
    dcp.save({"x": torch.zeros(1)}, checkpoint_id=str(step), no_dist=True)  # a readable one
    (step / "meta.json").write_text(json.dumps({"step": 4, "sub_batches": 1}))
    (out / "checkpoints" / "latest").write_text("step_000004\n")
    cfg, words = S.resolve(_cfg("parallel.tp=2", f"out_dir={out}", "resume=auto"), _ctx(2),
                           None)
    assert (cfg.sub_batches, words) == (1, "1 sub-batch (auto, as the checkpoint ran)")


def test_a_measured_choice_is_said(monkeypatch):
    monkeypatch.setattr(S, "measure_splits", lambda *a, **k: {1: 0.020, 2: 0.015})
    cfg, words = S.resolve(_cfg("parallel.tp=2"), _ctx(2), None)
    assert cfg.sub_batches == 2 and cfg.parallel.sub_batches == 2
    assert words == "2 sub-batches (auto, measured: 1: 20.0 ms, 2: 15.0 ms per step)"


def _measure_body(ctx) -> None:
    cfg = _cfg("parallel.tp=2", "model.seq_len=32", "train.micro_batch_size=4")
    before = torch.get_rng_state()
    times = S.measure_splits(cfg, ctx, None, [1, 2], lambda *a, **k: None)
    assert torch.equal(before, torch.get_rng_state())  # the run's random state untouched
    assert set(times) == {1, 2} and all(t > 0 for t in times.values())
    got = torch.tensor([times[1], times[2]])
    torch.distributed.all_reduce(got)  # every rank has the slowest rank's figures
    assert torch.equal(got, 2 * torch.tensor([times[1], times[2]]))


def test_measuring_times_both_counts_on_every_rank():
    run_distributed(_measure_body, world=2, tp=2)
