"""tests/support/distributed.py tries a run once more only when gloo's connection set-up
between the local processes failed; any other failure, and a second set-up failure, fail
the test."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from tests.support.distributed import SETUP_FLAKE, run_distributed


def _flaky_body(rank: int, marks: str, times: int) -> None:
    mark = os.path.join(marks, f"r{rank}")
    n = int(open(mark).read()) if os.path.exists(mark) else 0
    open(mark, "w").write(str(n + 1))
    # both ranks past the group's set-up and their marks written before rank 1 fails: else,
    # under load, rank 1's exit can close rank 0's half-made mesh (a set-up failure of its own)
    dist.barrier()
    if rank == 1 and n < times:
        raise RuntimeError(f"{SETUP_FLAKE} with [x/pair.cc:553] Connection closed by peer")


def _broken_body(rank: int) -> None:
    if rank == 1:
        raise RuntimeError("a real failure")


def test_a_setup_failure_is_tried_once_more(tmp_path):
    run_distributed(_flaky_body, world=2, tp=None, args=(str(tmp_path), 1))
    assert open(tmp_path / "r0").read() == "2"


def test_a_second_setup_failure_or_another_error_fails(tmp_path):
    with pytest.raises(AssertionError, match="Connection closed by peer"):
        run_distributed(_flaky_body, world=2, tp=None, args=(str(tmp_path), 2))
    with pytest.raises(AssertionError, match="a real failure"):
        run_distributed(_broken_body, world=2, tp=None)
