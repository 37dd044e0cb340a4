"""The CPU suite's NCCL tier checks itself: the point-to-point emulation hangs (as a
clear error) where NCCL would, and the collective-order recorder catches ranks that
disagree. Every ``run_distributed`` body runs under both (tests/support/distributed.py)."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
import torch.distributed as dist

from tests.support.collective_order import compare
from tests.support.distributed import run_distributed


def _issue_example(rank: int, groups: int, batched: bool) -> None:
    """pp=2 1f1b's first ops: stage 0 sends F0, posts the receive of B0, sends F1;
    stage 1 posts the receives of F0 and F1, then sends B0."""
    fwd = dist.new_group([0, 1])
    bwd = dist.new_group([0, 1]) if groups == 2 else fwd
    one = torch.ones(3)
    got = [torch.zeros(3) for _ in range(2)]
    if rank == 0:
        ops = [("s", one, fwd), ("r", got[0], bwd), ("s", 2 * one, fwd)]
    else:
        ops = [("r", got[0], fwd), ("r", got[1], fwd), ("s", 3 * one, bwd)]
    if batched:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend if k == "s" else dist.irecv, t,
                                                   1 - rank, g) for k, t, g in ops])
    else:
        works = [(dist.isend if k == "s" else dist.irecv)(t, 1 - rank, g) for k, t, g in ops]
    for w in works:
        w.wait()
    want = [3 * one] if rank == 0 else [one, 2 * one]
    for g, w in zip(got, want):
        assert torch.equal(g, w), (rank, got)


def test_one_group_for_both_directions_deadlocks():
    with pytest.raises(AssertionError) as e:
        run_distributed(_issue_example, 2, tp=None, args=(1, False), nccl_timeout_s=3)
    msg = str(e.value)
    assert "NCCL semantics: deadlock at rank" in msg
    # each side names its own op and the peer's: both hold a receive
    assert "irecv #1 from rank 0" in msg or "irecv #0 from rank 1" in msg, msg


def test_a_group_per_direction_runs():
    run_distributed(_issue_example, 2, tp=None, args=(2, False))


def test_a_batch_progresses_together():
    run_distributed(_issue_example, 2, tp=None, args=(1, True))


def _tags_ignored(rank: int) -> None:
    # gloo would match by tag and deliver b to the first receive; NCCL delivers in order
    a, b = torch.full((2,), 1.0), torch.full((2,), 2.0)
    if rank == 0:
        for w in (dist.isend(a, 1, tag=5), dist.isend(b, 1, tag=6)):
            w.wait()
    else:
        x, y = torch.zeros(2), torch.zeros(2)
        for w in (dist.irecv(x, 0, tag=6), dist.irecv(y, 0, tag=5)):
            w.wait()
        assert torch.equal(x, a) and torch.equal(y, b), (x, y)


def test_tags_are_ignored():
    run_distributed(_tags_ignored, 2, tp=None)


def _order_body(rank: int) -> None:
    from tests.support import collective_order

    t = torch.ones(4)
    g = dist.new_group([0, 1])
    dist.all_reduce(t, group=g)
    th = threading.Thread(target=lambda: dist.all_reduce(t[:2], group=g))  # a hook's thread
    th.start()
    th.join()
    dist.broadcast(t, src=0, group=g)
    assert collective_order.LOG[g.group_name] == [
        ["all_reduce", [[4], "float32"]], ["all_reduce", [[2], "float32"]],
        ["broadcast", [[4], "float32"]]], collective_order.LOG
    assert collective_order.LOG["world"][-1] == ["new_group", [0, 1]]


def test_recorder_sees_every_thread():
    run_distributed(_order_body, 2, tp=None)


def _log(tmp_path, rank: int, calls: list) -> str:
    path = tmp_path / f"order{rank}.json"
    path.write_text(json.dumps({"rank": rank, "log": {"pg1": calls},
                                "members": {"world": [0, 1], "pg1": [0, 1]}}))
    return str(path)


def test_recorder_names_the_first_divergence(tmp_path):
    a, b = ["all_reduce", [[4], "float32"]], ["all_reduce", [[2], "float32"]]
    compare([_log(tmp_path, 0, [a, b]), _log(tmp_path, 1, [a, b])])
    with pytest.raises(AssertionError, match=re.escape(
            "collective order differs on group pg1 (ranks [0, 1]) at call 0: rank 0 issued "
            "['all_reduce', [[4], 'float32']], rank 1 issued ['all_reduce', [[2], 'float32']]")):
        compare([_log(tmp_path, 0, [a, b]), _log(tmp_path, 1, [b, a])])
    with pytest.raises(AssertionError, match="at call 2: rank 0 issued nothing, rank 1 issued"):
        compare([_log(tmp_path, 0, [a, b]), _log(tmp_path, 1, [a, b, a])])
