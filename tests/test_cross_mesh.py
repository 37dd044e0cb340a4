"""Cross-mesh resharding between pipeline stages (oases/pipeline/cross_mesh.py).

plan_tasks is pure: its tests check the tiling (every (row, col) a dst replica
needs arrives exactly once, from a src replica that holds it) and the balancer
(distinct senders where a broken "lowest rank" or round-robin balancer would
repeat one; host_of merging two ranks into one load).

The transfers run in one spawned gloo world of 6 for every layout and method:
each dst rank must hold exactly the rows of a known tensor (torch.equal: the
methods only move bytes, so the result is bit-identical), with two calls of a
transfer and a second transfer between the same ranks in flight at once; then a call
in bf16, whose bytes on each link the comm counter must count at 2 B an element.
"""

from __future__ import annotations

import pytest
import torch

from oases.parallel.comm import CommCounter
from oases.pipeline.cross_mesh import METHODS, CrossMeshTransfer, Mesh, Pending, plan_tasks
from tests.support.distributed import run_distributed

# --------------------------------------------------------------------------- plan_tasks

LAYOUTS = [  # (src, dst, batch, seq, split)
    (Mesh(0, 1, 1), Mesh(1, 1, 2), 4, 5, None),
    (Mesh(0, 1, 2), Mesh(2, 2, 1), 4, 5, None),
    (Mesh(0, 2, 1), Mesh(2, 1, 2), 4, 5, None),
    (Mesh(0, 1, 4), Mesh(4, 2, 2), 4, 8, 2),
    (Mesh(0, 2, 2), Mesh(4, 1, 2), 2, 7, 3),
    (Mesh(4, 2, 1), Mesh(0, 4, 1), 8, 3, 5),      # dst before src; split clamped to seq
    (Mesh(0, 3, 2), Mesh(6, 2, 3), 6, 4, None),   # replicas straddle: rows 0-2 | 2-4 | 4-6
]


@pytest.mark.parametrize("src,dst,batch,seq,split", LAYOUTS)
def test_plan_tiles_every_dst_replica_once(src, dst, batch, seq, split):
    tasks = plan_tasks(src, dst, batch, seq, split)
    for j in range(dst.dp):
        got = [(r, c) for t in tasks if t.dst_replica == j
               for r in range(*t.rows) for c in range(*t.cols)]
        r0, r1 = dst.rows(j, batch)
        want = [(r, c) for r in range(r0, r1) for c in range(seq)]
        assert sorted(got) == want                       # covered, and each exactly once
    for t in tasks:
        (a0, a1), (b0, b1) = src.rows(t.src_replica, batch), dst.rows(t.dst_replica, batch)
        assert max(a0, b0) <= t.rows[0] < t.rows[1] <= min(a1, b1)   # held by src, needed by dst
        assert t.sender in src.replica(t.src_replica)
        assert sorted(t.receivers) == dst.replica(t.dst_replica)
    n_slices = len({(t.src_replica, t.dst_replica) for t in tasks})
    assert len(tasks) == n_slices * min(split or src.tp, seq)
    # greedy guarantee: within a src replica, sender loads differ by at most one task
    for i in range(src.dp):
        load = {r: 0 for r in src.replica(i)}
        for t in tasks:
            if t.src_replica == i:
                load[t.sender] += t.numel
        biggest = max((t.numel for t in tasks if t.src_replica == i), default=0)
        assert max(load.values()) - min(load.values()) <= biggest


def test_plan_spreads_senders_and_leaders():
    # DESIGN.md section 9: tp4 x dp1 -> tp2 x dp2; 4 equal pieces: 4 distinct senders,
    # every dst rank leads one piece (a lowest-rank "balancer" would use sender 0 only).
    tasks = plan_tasks(Mesh(0, 1, 4), Mesh(4, 2, 2), batch=4, seq=8, split=2)
    assert [(t.rows, t.cols) for t in tasks] == [((0, 2), (0, 4)), ((0, 2), (4, 8)),
                                                ((2, 4), (0, 4)), ((2, 4), (4, 8))]
    assert [t.sender for t in tasks] == [0, 1, 2, 3]
    assert [t.receivers for t in tasks] == [(4, 5), (5, 4), (6, 7), (7, 6)]
    # default split = src.tp: 4 pieces of the one slice, 4 senders, leaders alternate
    tasks = plan_tasks(Mesh(0, 1, 4), Mesh(4, 1, 2), batch=2, seq=16)
    assert [t.cols for t in tasks] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert [t.sender for t in tasks] == [0, 1, 2, 3]
    assert [t.receivers[0] for t in tasks] == [4, 5, 4, 5]


def test_plan_largest_first():
    # pieces of 3, 3 and 4 columns on 2 senders: LPT gives {4} and {3, 3} (max 6);
    # in position order or round-robin one sender would carry 3 + 4 = 7.
    tasks = plan_tasks(Mesh(0, 1, 2), Mesh(2, 1, 1), batch=1, seq=10, split=3)
    assert [t.cols for t in tasks] == [(6, 10), (0, 3), (3, 6)]
    load = {0: 0, 1: 0}
    for t in tasks:
        load[t.sender] += t.numel
    assert load == {0: 4, 1: 6}


def test_plan_host_of_counts_a_host_once():
    src, dst = Mesh(0, 1, 4), Mesh(4, 1, 4)
    plain = plan_tasks(src, dst, batch=1, seq=8, split=4)
    assert [t.sender for t in plain] == [0, 1, 2, 3]
    assert [t.receivers[0] for t in plain] == [4, 5, 6, 7]
    # ranks 0-2 share host 0, rank 3 is alone on host 1: host 1 must carry half the
    # bytes; dst hosts {4,5} and {6,7} take turns leading.
    hosts = {0: 0, 1: 0, 2: 0, 3: 1, 4: 2, 5: 2, 6: 3, 7: 3}
    tasks = plan_tasks(src, dst, batch=1, seq=8, split=4, host_of=hosts.__getitem__)
    assert [t.sender for t in tasks] == [0, 3, 1, 3]
    assert [t.receivers[0] for t in tasks] == [4, 6, 5, 7]
    two = plan_tasks(src, Mesh(4, 1, 1), batch=1, seq=8, split=2, host_of=hosts.__getitem__)
    assert [t.sender for t in two] == [0, 3]


def test_plan_deterministic():
    a = plan_tasks(Mesh(0, 3, 2), Mesh(6, 2, 3), 6, 4)
    b = plan_tasks(Mesh(0, 3, 2), Mesh(6, 2, 3), 6, 4)
    assert a == b


def test_bad_input():
    with pytest.raises(ValueError,
                       match="^batch 6 must be a positive multiple of src dp 2 and dst dp 4$"):
        plan_tasks(Mesh(0, 2, 1), Mesh(2, 4, 1), batch=6, seq=4)
    with pytest.raises(ValueError, match="batch 3"):
        CrossMeshTransfer(Mesh(0, 2, 1), Mesh(2, 1, 2), batch=3, seq=4)
    with pytest.raises(ValueError, match="share ranks \\[2, 3\\]"):
        CrossMeshTransfer(Mesh(0, 2, 2), Mesh(2, 1, 2), batch=4, seq=4)
    with pytest.raises(ValueError, match="method"):
        CrossMeshTransfer(Mesh(0, 1, 1), Mesh(1, 1, 1), batch=4, seq=4, method="scatter")
    with pytest.raises(ValueError, match="Mesh.tp=0"):
        Mesh(0, 1, 0)
    p = Pending(lambda: None, [])
    p.wait()
    with pytest.raises(RuntimeError, match="twice"):
        p.wait()


def test_mesh_helpers():
    m = Mesh(4, 2, 2)
    assert (m.size, m.ranks, m.replica(1)) == (4, [4, 5, 6, 7], [6, 7])
    assert [m.replica_of(r) for r in (3, 4, 5, 6, 7, 8)] == [None, 0, 0, 1, 1, None]
    assert m.rows(1, 8) == (4, 8)


# --------------------------------------------------------------------------- transfers

WORLD = 6
CASES = [  # (src, dst, batch, seq, tail)
    (Mesh(0, 1, 1), Mesh(1, 1, 2), 4, 5, (3,)),    # (dp1,tp1) -> (dp1,tp2)
    (Mesh(0, 1, 2), Mesh(2, 2, 1), 4, 5, (3,)),    # (dp1,tp2) -> (dp2,tp1)
    (Mesh(0, 2, 1), Mesh(2, 1, 2), 4, 5, (3,)),    # (dp2,tp1) -> (dp1,tp2)
    (Mesh(0, 1, 2), Mesh(2, 1, 2), 2, 5, (2, 3)),  # (dp1,tp2) -> (dp1,tp2)
    (Mesh(0, 2, 2), Mesh(4, 1, 2), 2, 5, (3,)),    # (dp2,tp2) -> (dp1,tp2); allgather pads
    (Mesh(4, 1, 2), Mesh(0, 2, 2), 2, 5, (3,)),    # the way back (dst ranks before src)
]


def _known(batch, seq, tail, salt):
    n = batch * seq * int(torch.tensor(tail).prod())
    return (torch.arange(n, dtype=torch.float32) + 1000 * salt).reshape(batch, seq, *tail)


def _transfers_body(ctx):
    rank = ctx.rank
    for c, (src, dst, batch, seq, tail) in enumerate(CASES):
        for m, method in enumerate(METHODS):
            # every rank builds both transfers (collective); the second one moves other
            # data between the same ranks at the same time, on its own process group
            t1 = CrossMeshTransfer(src, dst, batch, seq, method=method)
            t2 = CrossMeshTransfer(src, dst, batch, seq, method=METHODS[(m + 1) % 3])
            assert (t1.is_src, t1.is_dst) == (rank in src.ranks, rank in dst.ranks)
            # slow-link traffic: broadcast and allgather move the batch once, send dst.tp times
            tail_n = int(torch.tensor(tail).prod())
            moved = sum(n for _, _, n in t1.message_sizes(tail_n))
            assert moved == batch * seq * tail_n * (dst.tp if method == "send" else 1)
            fulls = [_known(batch, seq, tail, salt) for salt in range(3)]
            if t1.is_src:
                r0, r1 = src.rows(src.replica_of(rank), batch)
                # three calls in flight before any wait: two on t1, one on t2
                ps = [t1.send(fulls[0][r0:r1]), t2.send(fulls[2][r0:r1]),
                      t1.send(fulls[1][r0:r1])]
                assert [p.wait() for p in ps] == [None, None, None]
            if t1.is_dst:
                r0, r1 = dst.rows(dst.replica_of(rank), batch)
                ps = [t1.recv(tail, torch.float32, "cpu"), t2.recv(tail, torch.float32, "cpu"),
                      t1.recv(tail, torch.float32, "cpu")]
                outs = [p.wait() for p in ps]
                for out, salt in zip(outs, (0, 2, 1)):
                    assert out.is_contiguous() and out.shape == (r1 - r0, seq, *tail)
                    assert torch.equal(out, fulls[salt][r0:r1]), (c, method, rank, salt)
            _counted_bf16(t1, fulls[1], tail, (c, method, rank))


def _counted_bf16(t, full, tail, what):
    """One more call of ``t`` in bf16 (the pipeline's wire dtype under autocast): the
    same values arrive, and the bytes each end counts are the messages' at 2 B each,
    plus on dst ranks the fan-out: the broadcast pieces, or this rank's all-gather
    chunks (padded)."""
    rank, src, dst, batch = t.rank, t.src, t.dst, t.batch
    full = full.bfloat16()
    tail_n = int(torch.tensor(tail).prod())
    sizes = t.message_sizes(tail_n)
    with CommCounter() as counter:
        if t.is_src:
            r0, r1 = src.rows(src.replica_of(rank), batch)
            assert t.send(full[r0:r1]).wait() is None
        if t.is_dst:
            r0, r1 = dst.rows(dst.replica_of(rank), batch)
            assert torch.equal(t.recv(tail, torch.bfloat16, "cpu").wait(), full[r0:r1]), what
    fan = 0
    if t.is_dst and t.group is not None and t.method == "broadcast":
        j = dst.replica_of(rank)
        fan = sum(k.numel * tail_n for k in t.tasks if k.dst_replica == j)
    elif t.is_dst and t.group is not None:  # allgather: one equal chunk per slice
        fan = sum(-(-(m.rows[1] - m.rows[0]) * (m.cols[1] - m.cols[0]) * tail_n // dst.tp)
                  for m in t.msgs if m.dst == rank)
    assert dict(counter.bytes) == {k: v for k, v in {
        "send": 2 * sum(n for q, _, n in sizes if q == rank),
        "recv": 2 * sum(n for _, r, n in sizes if r == rank), "fan_out": 2 * fan}.items()
        if v}, (what, dict(counter.bytes))


def test_transfers_all_layouts_and_methods():
    run_distributed(_transfers_body, world=WORLD)


def _early_receives_body(ctx):
    """pp=2 1f1b's first ops through the two directions' transfers: stage 0 sends F0,
    posts the receive of B0, sends F1; stage 1 posts both receives, then sends B0. On
    one group for both directions NCCL (and tests/support/nccl_semantics.py) would hang."""
    a, b = Mesh(0, 1, 1), Mesh(1, 1, 1)
    fwd, bwd = CrossMeshTransfer(a, b, 2, 3), CrossMeshTransfer(b, a, 2, 3)
    dev = ctx.device
    x = [torch.full((2, 3, 4), float(i + 1), device=dev) for i in range(3)]
    if ctx.rank == 0:
        sent = [fwd.send(x[0])]
        grad = bwd.recv((4,), torch.float32, dev)
        sent.append(fwd.send(x[1]))
        assert torch.equal(grad.wait(), x[2])
    else:
        got = [fwd.recv((4,), torch.float32, dev) for _ in range(2)]
        sent = [bwd.send(x[2])]
        assert [float(g.wait()[0, 0, 0]) for g in got] == [1.0, 2.0]
    for s in sent:
        s.wait()


def test_early_receives_run_under_nccl_rules():
    run_distributed(_early_receives_body, world=2)


@pytest.mark.cuda(gpus=2)
def test_early_receives_run_on_nccl():
    run_distributed(_early_receives_body, world=2, device="cuda")


SHARDED = [  # (src, dst, batch, seq): each TP rank holds 1/tp of the positions
    (Mesh(0, 1, 2), Mesh(2, 2, 1), 4, 4),   # tp2 -> dp2 x tp1
    (Mesh(0, 1, 2), Mesh(2, 1, 4), 2, 8),   # tp2 -> tp4: each dst chunk half a src chunk
    (Mesh(2, 1, 4), Mesh(0, 1, 2), 2, 8),   # tp4 -> tp2 (dst ranks before src)
    (Mesh(0, 2, 2), Mesh(4, 1, 2), 2, 4),   # dp2 x tp2 -> dp1 x tp2
]


def _sharded_body(ctx):
    rank, tail = ctx.rank, (3,)
    for c, (src, dst, batch, seq) in enumerate(SHARDED):
        t = CrossMeshTransfer(src, dst, batch, seq, sharded=True)
        assert t.group is None and t.tasks == []  # no fan-out: nothing but messages
        # every byte crosses once, from the rank that holds it to the one that wants it
        assert sum(n for _, _, n in t.message_sizes(3)) == batch * seq * 3
        for m in t.msgs:
            for mesh, r in ((src, m.src), (dst, m.dst)):
                n = seq // mesh.tp
                k = (r - mesh.first) % mesh.tp
                assert k * n <= m.cols[0] < m.cols[1] <= (k + 1) * n, (c, m)
        fulls = [_known(batch, seq, tail, salt) for salt in range(2)]
        for mesh, side in ((src, "src"), (dst, "dst")):
            if rank not in mesh.ranks:
                continue
            r0, r1 = mesh.rows(mesh.replica_of(rank), batch)
            n = seq // mesh.tp
            k = (rank - mesh.first) % mesh.tp
            if side == "src":  # two calls in flight
                ps = [t.send(f[r0:r1, k * n:(k + 1) * n]) for f in fulls]
                assert [p.wait() for p in ps] == [None, None]
            else:
                outs = [p.wait() for p in [t.recv(tail, torch.float32, "cpu") for _ in fulls]]
                for out, f in zip(outs, fulls):
                    assert out.is_contiguous() and out.shape == (r1 - r0, n, *tail)
                    assert torch.equal(out, f[r0:r1, k * n:(k + 1) * n]), (c, rank)


def test_sharded_transfers_move_each_chunk_once():
    run_distributed(_sharded_body, world=WORLD)


def test_sharded_needs_positions_that_split():
    with pytest.raises(ValueError, match="seq 6 must divide by src tp 4"):
        CrossMeshTransfer(Mesh(0, 1, 4), Mesh(4, 1, 2), 2, 6, sharded=True)
