"""The pipeline's point-to-point order under NCCL's rules (pure: no processes).

The runtime's transfers run on one process group per boundary and direction
(:mod:`oases.pipeline.cross_mesh`); :func:`check_p2p` runs the action lists under
NCCL's in-order, tag-blind point-to-point and must find no deadlock for any
schedule. With one group for both directions of a stage pair (the transfers as
they were built before: plain isend/irecv on one group) the same lists hang:
gpipe and 1f1b at every pp and micro-batch count, every overlap_fb case, and
eager-1f1b below 2pp-1 micro-batches, zb-h1 and eager-zb-h1 always. Interleaved lists
add the wraparound boundary (rank pp-1 -> rank 0) and carry every chunk on each group.
The multi-process side (the same rules on gloo, :mod:`tests.support.nccl_semantics`)
runs every pipeline parity test.
"""

from __future__ import annotations

import itertools

import pytest

from oases.cli.schedule import main as schedule_main
from oases.pipeline.actions import Action, ScheduleError, pipeline_actions
from oases.pipeline.p2p import check_p2p, p2p_order

# interleaved-1f1b at one chunk per rank runs eager-1f1b's lists (Megatron's warm-up)
CASES = [(kind, fb, pp, m) for kind, fb in itertools.product(
         ("gpipe", "1f1b", "eager-1f1b", "zb-h1", "eager-zb-h1"), (False, True))
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


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_groups_never_deadlock(pp, v):
    for m in (pp, 2 * pp, 3 * pp):
        for fb in (False, True):
            check_p2p(pipeline_actions("interleaved-1f1b", pp, m, fb, v), fused=fb)
    # with one group per stage pair it hangs at pp micro-batches; from 2pp on it runs,
    # except at pp=2, where both boundaries (0 -> 1 and the wraparound 1 -> 0) would
    # share the one pair's group
    with pytest.raises(ScheduleError, match="NCCL point-to-point deadlock"):
        check_p2p(pipeline_actions("interleaved-1f1b", pp, pp, virtual=v), shared=True)
    longer = pipeline_actions("interleaved-1f1b", pp, 2 * pp, virtual=v)
    if pp == 2:
        with pytest.raises(ScheduleError, match="group 0<->1: stage 0 is at RECV_F0c1"):
            check_p2p(longer, shared=True)
    else:
        check_p2p(longer, shared=True)


def test_interleaved_wraparound_group():
    order = p2p_order(pipeline_actions("interleaved-1f1b", 3, 3, virtual=2))
    assert list(order) == [(0, "fwd"), (0, "bwd"), (1, "fwd"), (1, "bwd"),
                           (2, "fwd"), (2, "bwd")]
    # boundary 2 is rank 2 -> rank 0: chunk 0 of rank 2 feeds chunk 1 of rank 0
    assert order[(2, "fwd")] == {2: [Action("SEND_F", i) for i in range(3)],
                                 0: [Action("RECV_F", i, 1) for i in range(3)]}
    assert order[(2, "bwd")] == {0: [Action("SEND_B", i, 1) for i in range(3)],
                                 2: [Action("RECV_B", i) for i in range(3)]}
    assert order[(0, "fwd")][0] == [Action("SEND_F", i, c) for c in (0, 1) for i in range(3)]


def test_a_chunk_out_of_order_is_caught():
    # rank 1 receives chunk 1's activation before chunk 0's on the same group
    actions = pipeline_actions("interleaved-1f1b", 2, 2, virtual=2)
    row = actions[1]
    i, j = row.index(Action("RECV_F", 1)), row.index(Action("RECV_F", 0, 1))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError,
                       match="group 0->1: stage 0 is at SEND_F1 while stage 1 is at RECV_F0c1"):
        check_p2p(actions)


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
