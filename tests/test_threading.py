"""No process-global state in the collectives or the engine.

What is guaranteed (see ``oases.parallel.comm.CommScope``):
* counters, observers and no-op groups are per thread: one entered on a thread
  neither sees nor suppresses collectives another thread issues;
* a backward collective belongs to the scope its forward ran in, on whichever
  thread autograd runs it (on CUDA a device worker thread; here a thread of our
  own calling ``backward``, which is where autograd runs a CPU graph);
* a ``CutRecorder`` and a ``SavedTensorMeter`` are per thread;
* an ``OasesEngine`` keeps no per-call state: runs may interleave (a pipeline's
  forwards before its backwards) or run on two threads at once.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from oases.overlap.engines import OasesEngine
from oases.overlap.memory import SavedTensorMeter
from oases.parallel import ColumnParallelLinear, RowParallelLinear, init_parameters
from oases.parallel.block import TPBlock
from oases.parallel.comm import (CommCounter, CutRecorder, NoopCollectives,
                                 all_reduce, copy_to_tp)
from tests.support.distributed import run_distributed
from tests.support.threads import SeenCollectives, on_thread


class _MLP(TPBlock):
    def __init__(self, d, tp_group, gate=None):
        super().__init__(tp_group)
        self.up = ColumnParallelLinear(d, 4 * d, tp_group)
        self.down = RowParallelLinear(4 * d, d, tp_group, reduce_output=False)
        self.gate = gate  # a threading.Barrier the first partial waits at, or None

    def partial(self, x):
        if self.gate is not None:
            self.gate.wait(30)
            self.gate = None
        return self.down.partial(torch.tanh(self.up(x)))

    def combine(self, x, reduced):
        return x + self.down.add_bias(reduced)


class _Net(nn.Module):
    def __init__(self, d, tp_group, n=2, gate=None):
        super().__init__()
        self.stack = nn.ModuleList([_MLP(d, tp_group, gate if i == 0 else None)
                                    for i in range(n)])

    def blocks(self):
        return list(self.stack)

    def loss_from_hidden(self, x, target):
        return F.mse_loss(x.float(), target)


def _net(d, group, rank, tp, gate=None):
    net = _Net(d, group, gate=gate)
    init_parameters(net, 7, rank, tp)
    return net


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ---- collectives: scopes per thread, carried into backward ----

def _scope_body(ctx):
    g = ctx.tp_group
    entered, release = threading.Event(), threading.Event()
    other = {}

    def bystander():  # a counter, an observer and a no-op on another thread, left open
        with CommCounter() as c, SeenCollectives() as o, NoopCollectives(g):
            other.update(c=c, o=o)
            entered.set()
            release.wait(30)
            all_reduce(torch.ones(1), g)  # its own: counted there, skipped
    th = threading.Thread(target=bystander)
    th.start()
    assert entered.wait(30)
    x = torch.full((3,), float(ctx.tp_rank + 1))
    with CommCounter() as mine, SeenCollectives() as seen:
        all_reduce(x, g)
        assert CutRecorder.current() is None
    release.set()
    th.join(30)
    assert torch.equal(x, torch.full((3,), 3.0))  # really reduced: the other thread's no-op
    assert dict(mine.counts) == {"all_reduce": 1} and seen.names == ["all-reduce"]
    assert dict(other["c"].counts) == {"all_reduce": 1}  # its own collective only
    assert other["o"].names == []

    # a backward on another thread reports to its forward's scope, not the thread's
    gy = torch.full((2, 4), float(ctx.tp_rank + 1))
    x = torch.zeros(2, 4, requires_grad=True)
    with CommCounter() as fwd, SeenCollectives() as fwd_seen:
        y = copy_to_tp(x, g)
        col = ColumnParallelLinear(4, 4, g)
        xa = torch.randn(2, 4, requires_grad=True)
        ya = col(xa)  # the layer's own all-reduce, overlapped with the weight gradient

        def bwd():
            with CommCounter() as there:
                y.backward(gy)
                ya.sum().backward()
            assert sum(there.counts.values()) == 0
        on_thread(bwd)
    assert dict(fwd.counts) == {"all_reduce": 2} and fwd_seen.names == ["all-reduce"] * 2
    assert torch.equal(x.grad, torch.full((2, 4), 3.0))

    # a no-op entered around the forward holds for its backward elsewhere
    x = torch.zeros(2, 4, requires_grad=True)
    with NoopCollectives(g):
        y = copy_to_tp(x, g)
        on_thread(lambda: y.backward(gy))
    assert torch.equal(x.grad, gy)

    # a graph cut is recorded by the recorder of the forward's own thread only
    cut = {}
    with CutRecorder() as rec:
        on_thread(lambda: cut.update(y=copy_to_tp(torch.ones(2, requires_grad=True), g)))
        assert CutRecorder.current() is rec
    assert rec.cuts == [] and cut["y"].grad_fn is not None  # a plain _CopyToTP there


def test_comm_scopes_are_per_thread_and_follow_the_graph():
    run_distributed(_scope_body, world=2, tp=2)


def _two_engines_body(ctx):
    """Two engines on two threads of each rank, on two process groups over the same
    ranks, at once: each counter sees exactly its own engine's collectives."""
    groups = [dist.new_group([0, 1]) for _ in range(2)]
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    net = _net(8, groups[0], ctx.tp_rank, ctx.tp)
    with CommCounter() as c:
        loss = OasesEngine(groups[0], 2, "fine").forward_backward(net, x, t)
    alone = (loss, _grads(net), dict(c.counts))  # the same on either group
    assert alone[2]["all_reduce"] > 0
    both, start = {}, threading.Barrier(2)

    def run(k):
        net = _net(8, groups[k], ctx.tp_rank, ctx.tp)
        start.wait(30)
        with CommCounter() as c:
            loss = OasesEngine(groups[k], 2, "fine").forward_backward(net, x, t)
        both[k] = (loss, _grads(net), dict(c.counts))
    ths = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    for k in range(2):
        assert both[k][2] == alone[2], (both[k][2], alone[2])
        torch.testing.assert_close(both[k][0], alone[0], rtol=0, atol=0)
        for n in alone[1]:
            torch.testing.assert_close(both[k][1][n], alone[1][n], rtol=0, atol=0)


def test_two_engines_on_two_threads():
    run_distributed(_two_engines_body, world=2, tp=2)


# ---- the engine keeps no per-call state ----

def _interleaved_body(ctx):
    """As a pipeline stage does: two forwards, then their backwards, in an order other
    than the forwards', one run in bf16 and one in fp32; the gradients equal those of
    the runs one after the other."""
    g = ctx.tp_group
    xs = [torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    ts = [torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    amps = [bf16, contextlib.nullcontext]
    sched = OasesEngine(g, 2, "fine")
    config = dict(vars(sched))

    seq = [_net(8, g, ctx.tp_rank, ctx.tp) for _ in range(2)]
    for k in range(2):
        run = sched.forward(seq[k], xs[k], ts[k], amps[k])
        sched.backward(run, None, 1.0, amps[k])
    nets = [_net(8, g, ctx.tp_rank, ctx.tp) for _ in range(2)]
    runs = [sched.forward(nets[k], xs[k], ts[k], amps[k]) for k in range(2)]
    for k in (1, 0):
        sched.backward(runs[k], None, 1.0, amps[k])
    sched.forward_backward(_net(8, g, ctx.tp_rank, ctx.tp), xs[0], ts[0], amp=amps[0])
    for k in range(2):
        ref, got = _grads(seq[k]), _grads(nets[k])
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=0, atol=0, msg=f"run {k} {n}")
    # the engine object is configuration only: nothing was added or changed by the runs
    assert vars(sched).keys() == config.keys()
    assert all(vars(sched)[k] is v for k, v in config.items())


def test_interleaved_runs_of_one_engine():
    run_distributed(_interleaved_body, world=2, tp=2)


def test_one_engine_on_two_threads_at_once():
    """Both threads are inside a run of the same engine at once (a barrier in the
    first block), one under bf16 autocast, one in fp32: each gets the result it gets
    alone. Per-call state on the engine would hand one run the other's autocast."""
    torch.manual_seed(0)
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    bf16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    amps = [bf16, contextlib.nullcontext]
    sched = OasesEngine(None, 2, "fine")
    alone = []
    for amp in amps:
        net = _net(8, None, 0, 1)
        alone.append((sched.forward_backward(net, x, t, amp=amp), _grads(net)))
    # bf16 and fp32 differ visibly (0.4% of the largest gradient here)
    g16, g32 = alone[0][1], alone[1][1]
    assert max((g16[n] - g32[n]).abs().max() / g32[n].abs().max() for n in g32) > 1e-3
    gate, out = threading.Barrier(2), {}

    def run(k):
        net = _net(8, None, 0, 1, gate=gate)
        out[k] = (sched.forward_backward(net, x, t, amp=amps[k]), _grads(net))
    ths = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    for k in range(2):
        torch.testing.assert_close(out[k][0], alone[k][0], rtol=0, atol=0)
        for n in alone[k][1]:
            torch.testing.assert_close(out[k][1][n], alone[k][1][n], rtol=0, atol=0)


def test_saved_tensor_meter_is_per_thread():
    w = torch.randn(64, 64, requires_grad=True)
    with SavedTensorMeter() as m:
        def elsewhere():
            (w @ w).sum()                              # saves w: not for this meter
            SavedTensorMeter.track(torch.ones(1000))   # a stash there: not ours
            SavedTensorMeter.end_of_forward()
        on_thread(elsewhere)
        assert m.current == 0 and m.peak_bytes == 0 and m.forward_bytes == 0
        y = (w @ w).sum()
        SavedTensorMeter.end_of_forward()
    assert m.forward_bytes == w.numel() * 4
    del y
