"""The config's pipeline-schedule checks: parallel.pp_schedule and parallel.pp_virtual."""

from __future__ import annotations

import pytest

from oases.config import ConfigError, load_config

BASE = ["model.n_layer=8", "model.n_head=4", "model.d_model=64", "parallel.pp=2"]


def validated(*overrides: str, world: int = 2):
    return load_config(None, [*BASE, *overrides]).validate(world_size=world)


@pytest.mark.parametrize("kind", ["zb-h1", "eager-zb-h1"])
def test_zero_bubble_schedules_are_accepted(kind):
    cfg = validated(f"parallel.pp_schedule={kind}", "train.grad_accum=4")
    assert cfg.parallel.pp_schedule == kind and cfg.parallel.pp_virtual == 1


def test_interleaved_is_accepted_with_virtual_stages():
    cfg = validated("parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual=2",
                    "train.grad_accum=4")
    assert cfg.parallel.pp_virtual == 2


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp_schedule=interleaved-1f1b", "train.grad_accum=4"],
     "interleaved-1f1b needs parallel.pp_virtual >= 2 stages per rank"),
    (["parallel.pp_virtual=2", "train.grad_accum=4"],
     "parallel.pp_virtual=2 needs parallel.pp_schedule=interleaved-1f1b, not 1f1b"),
    (["parallel.pp_virtual=0"], "parallel.pp_virtual=0 must be > 0"),
    (["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual=3", "train.grad_accum=4"],
     r"model.n_layer=8 layers do not divide into parallel.pp=2 x parallel.pp_virtual=3"),
    (["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual=2", "train.grad_accum=5"],
     "train.grad_accum=5 is not a multiple of 2"),
    (["parallel.pp_schedule=zb-h1", "train.grad_accum=1"],
     "zb-h1 needs at least pp micro-batches"),
    (["parallel.pp_schedule=zb-h1", "parallel.schedule=oases", "parallel.overlap_fb=true",
      "train.grad_accum=4"],
     "overlap_fb cannot run with parallel.pp_schedule=zb-h1: its stages run a W"),
    (["parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual=2",
      "parallel.schedule=oases", "parallel.overlap_fb=true", "train.grad_accum=4"],
     "pp_schedule=interleaved-1f1b: a B and the F after it run on different chunks"),
    (["parallel.pp_schedule=zb-h2"], "parallel.pp_schedule='zb-h2' is not one of"),
])
def test_refused_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        validated(*overrides)
    assert "\n" not in str(e.value)


def test_pp_virtual_needs_a_pipeline():
    with pytest.raises(ConfigError, match="parallel.pp_virtual=2 needs parallel.pp >= 2, got 1"):
        load_config(None, ["model.n_layer=8", "model.n_head=4", "model.d_model=64",
                           "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual=2"]
                    ).validate(world_size=1)
