"""The pipeline's point-to-point order under NCCL's rules (pure: no processes).

The runtime's transfers run on one process group per boundary and direction
(:mod:`oases.pipeline.cross_mesh`); :func:`check_p2p` runs the action lists under
NCCL's in-order, tag-blind point-to-point and must find no deadlock for any
schedule. With one group for both directions of a stage pair (the transfers as
they were built before: plain isend/irecv on one group) the same lists hang:
gpipe and 1f1b at every pp and micro-batch count, every overlap_fb case, and
eager-1f1b below 2pp-1 micro-batches. The multi-process side (the same rules on
gloo, :mod:`tests.support.nccl_semantics`) runs every pipeline parity test.
"""

from __future__ import annotations

import itertools

import pytest

from oases.cli.schedule import main as schedule_main
from oases.pipeline.actions import KINDS, Action, ScheduleError, pipeline_actions
from oases.pipeline.p2p import check_p2p, p2p_order

CASES = [(kind, fb, pp, m) for kind, fb in itertools.product(KINDS, (False, True))
         for pp in (2, 3, 4) for m in (1, 2, 3, 5, 8)]


@pytest.mark.parametrize("kind,fb,pp,m", CASES)
def test_per_direction_groups_never_deadlock(kind, fb, pp, m):
    actions = pipeline_actions(kind, pp, m, fb)
    check_p2p(actions, fused=fb)
    hangs_shared = fb or kind != "eager-1f1b" or m < 2 * pp - 1
    if hangs_shared:
        with pytest.raises(ScheduleError, match="NCCL point-to-point deadlock"):
            check_p2p(actions, fused=fb, shared=True)
    else:
        check_p2p(actions, fused=fb, shared=True)


def test_each_group_is_one_direction_in_microbatch_order():
    order = p2p_order(pipeline_actions("1f1b", 3, 4))
    assert list(order) == [(0, "fwd"), (0, "bwd"), (1, "fwd"), (1, "bwd")]
    for (b, d), sides in order.items():
        sender, receiver = (b, b + 1) if d == "fwd" else (b + 1, b)
        k = "F" if d == "fwd" else "B"
        assert sides[sender] == [Action(f"SEND_{k}", i) for i in range(4)]
        assert sides[receiver] == [Action(f"RECV_{k}", i) for i in range(4)]


def test_the_issue_example_names_the_stuck_ops():
    # pp=2 1f1b on one shared group: stage 0 meets RECV_B0 while stage 1 is at RECV_F1
    with pytest.raises(ScheduleError) as e:
        check_p2p(pipeline_actions("1f1b", 2, 2), shared=True)
    assert "stage 0 is at RECV_B0 while stage 1 is at RECV_F1" in str(e.value)


def test_a_hand_written_list_out_of_order_is_caught():
    # stage 1 receives F1 before F0: the tag-blind FIFO delivers F0's data to it
    actions = pipeline_actions("gpipe", 2, 2)
    row = actions[1]
    i, j = row.index(Action("RECV_F", 0)), row.index(Action("RECV_F", 1))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError, match="stage 0 is at SEND_F0 while stage 1 is at RECV_F1"):
        check_p2p(actions)


def test_schedule_cli_prints_the_order(capsys):
    assert schedule_main(["--pp", "2", "--microbatches", "2", "--p2p"]) == 0
    out = capsys.readouterr().out
    assert "group 0->1 (activations)\n    stage 0: SEND_F0 SEND_F1\n    stage 1: RECV_F0 RECV_F1" \
        in out
    assert "group 1->0 (gradients)\n    stage 0: RECV_B0 RECV_B1\n    stage 1: SEND_B0 SEND_B1" \
        in out
    assert "no deadlock" in out and "would hang" in out
