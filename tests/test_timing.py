"""Device-timeline timing (oases.parallel.timing) and its users: the ZeRO store's
gather wait; the trace view of the profiler's events (oases.overlap.trace). On the CPU a
stamp is the host clock, which these tests replace with a fake one, so every figure is
exact; on CUDA a stamp is an event, and a timed interval holds the device's work, not the
host's launch of it."""

from __future__ import annotations

import time

import pytest
import torch

from oases.dp.store import ParamStore
from oases.overlap.trace import engine_view
from oases.parallel import timing
from oases.parallel.timing import IntervalTimer, between, stamp


class FakeClock:
    """time.perf_counter stand-in: each read returns the next of ``times``."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


@pytest.fixture
def clock(monkeypatch):
    def install(*times):
        fake = FakeClock(*times)
        monkeypatch.setattr(timing.time, "perf_counter", fake)
        return fake
    return install


def test_host_stamps_and_between(clock):
    clock(1.0, 3.5)
    a, b = stamp(), stamp("cpu")
    assert (a, b) == (1.0, 3.5) and between(a, b) == 2.5
    with pytest.raises(TypeError, match="different clocks"):
        between(1.0, object())


def test_intervals_add_up(clock):
    clock(0.0, 1.0, 5.0, 5.5, 10.0, 12.0)
    timer = IntervalTimer()
    for _ in range(2):
        t0 = timer.start()
        timer.stop(t0)
    with timer.measure():
        pass
    assert timer.seconds() == 3.5  # read without starting afresh
    assert timer.take_each() == [1.0, 0.5, 2.0]
    assert timer.take() == 0.0 and timer.take_each() == []


def test_intervals_may_interleave(clock):
    """Two threads (the main one and autograd's) each keep their own start."""
    clock(0.0, 1.0, 4.0, 7.0)
    timer = IntervalTimer()
    a = timer.start()
    b = timer.start()
    timer.stop(b)   # 1.0 -> 4.0
    timer.stop(a)   # 0.0 -> 7.0
    assert timer.take_each() == [3.0, 7.0]


def test_many_intervals_are_read_as_they_end(clock, monkeypatch):
    monkeypatch.setattr(timing, "_FOLD_AT", 3)
    n = 10
    clock(*[x for i in range(n) for x in (10.0 * i, 10.0 * i + i)])
    timer = IntervalTimer()
    for _ in range(n):
        timer.stop(timer.start())
        assert len(timer._spans) <= 3
    assert timer.take_each() == [float(i) for i in range(n)]  # in order, none merged


def _x(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 9, "tid": tid}


def test_trace_view_of_a_cpu_profile():
    """The engines' segments and the pipeline's actions from the labels, the collectives
    from gloo's own events on its threads; everything else is left out."""
    raw = [_x("sub-batch 0", "user_annotation", 100.0, 50.0),
           _x("Fa P3", "user_annotation", 105.0, 10.0),
           _x("launch all-reduce", "user_annotation", 115.0, 1.0),
           _x("gloo:all_reduce", "user_annotation", 116.0, 30.0, tid=2),
           _x("aten::mm", "cpu_op", 106.0, 8.0),
           _x("F 2", "user_annotation", 120.0, 4.0),
           _x("Ba 2 in", "user_annotation", 125.0, 2.0),
           _x("gloo:recv", "user_annotation", 126.0, 9.0, tid=3),
           _x("pp wait B1", "user_annotation", 130.0, 5.0),
           _x("wait", "user_annotation", 140.0, 5.0),
           {"ph": "i", "name": "marker", "ts": 1.0}]
    view = engine_view({"traceEvents": raw}, rank=3)["traceEvents"]
    got = [(e["tid"], e["name"], e["cat"], e["ts"], e["dur"], e["pid"]) for e in view]
    assert got == [("compute", "Fa P3", "compute", 0.0, 10.0, 3),
                   ("comm", "gloo:all_reduce", "comm", 11.0, 30.0, 3),
                   ("compute", "F 2", "compute", 15.0, 4.0, 3),
                   ("compute", "Ba 2 in", "compute", 20.0, 2.0, 3),
                   ("pipeline", "wait B1", "compute", 25.0, 5.0, 3)]


def test_trace_view_of_a_cuda_profile_is_on_the_device_clock():
    """With kernels in the trace, the labels' device ranges and the NCCL kernels make
    the lanes; the host's ranges of the same labels (launches) are left out, and a label
    with no device range (a backward launched from autograd's thread) keeps its host
    range, marked so."""
    raw = [_x("Fa P3", "user_annotation", 10.0, 2.0),
           _x("Ba 3", "user_annotation", 90.0, 5.0),
           _x("Fa P3", "gpu_user_annotation", 50.0, 20.0, tid=7),
           _x("ampere_sgemm_128x64_tn", "kernel", 50.0, 18.0, tid=7),
           _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "kernel", 60.0, 25.0, tid=8),
           _x("pp F0", "gpu_user_annotation", 45.0, 40.0, tid=7)]
    view = engine_view({"traceEvents": raw}, rank=0)["traceEvents"]
    got = [(e["tid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in view]
    assert got == [("pipeline", "F0", "compute", 0.0, 40.0),
                   ("compute", "Fa P3", "compute", 5.0, 20.0),
                   ("comm", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "comm", 15.0, 25.0),
                   ("compute", "Ba 3", "host", 45.0, 5.0)]


def test_store_gather_wait_is_taken_once(clock):
    store = ParamStore({}, 0, False)
    assert store.wait.device is None  # nothing sharded: the host clock
    clock(0.0, 0.25)
    store.wait.stop(store.wait.start())
    assert store.take_wait() == 0.25 and store.take_wait() == 0.0


@pytest.mark.cuda
def test_cuda_interval_holds_the_device_work():
    dev = torch.device("cuda")
    timer = IntervalTimer(dev)
    a = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    host = time.perf_counter()
    t0 = timer.start()
    for _ in range(20):
        a = a @ a / 64
    timer.stop(t0)
    launch_s = time.perf_counter() - host
    assert isinstance(t0, torch.cuda.Event)
    device_s = timer.take()  # waits for the matmuls
    total_s = time.perf_counter() - host
    assert launch_s < device_s <= total_s + 1e-3, (launch_s, device_s, total_s)
