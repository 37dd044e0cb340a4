"""Device-timeline timing (oases.parallel.timing) and its users: the tracer, the ZeRO
store's gather wait. On the CPU a stamp is the host clock, which these tests replace
with a fake one, so every figure is exact; on CUDA a stamp is an event, and a timed
interval holds the device's work, not the host's launch of it."""

from __future__ import annotations

import json
import time

import pytest
import torch

from oases.dp.store import ParamStore
from oases.overlap.trace import Tracer
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


def test_tracer_records_on_its_clock(clock, tmp_path):
    # t0 | span start, end | collective launch (given), end (future done) | restart t0
    clock(100.0, 101.0, 103.0, 104.5, 200.0, 201.0, 202.0, 202.5)
    tr = Tracer(rank=3)
    with tr.span("F0", "compute"):
        pass
    fut = torch.futures.Future()
    work = type("Work", (), {"get_future": lambda self: fut})()
    tr.collective("all-reduce", "comm", work, start=104.0)
    assert len(tr.events) == 1  # not done yet
    fut.set_result(None)
    tr.save(tmp_path / "t.json")
    ev = {e["name"]: e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"]}
    assert (ev["F0"]["ts"], ev["F0"]["dur"]) == (1e6, 2e6)
    assert (ev["all-reduce"]["ts"], ev["all-reduce"]["dur"]) == (4e6, 0.5e6)
    assert ev["all-reduce"]["cat"] == "comm" and ev["F0"]["pid"] == 3
    tr.restart()  # 200.0: a later step traced alone
    tr.collective("noop", "comm", object())  # no future: done at once (201.0, 202.0)
    tr.save(tmp_path / "t.json")
    (only,) = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert (only["name"], only["ts"], only["dur"]) == ("noop", 1e6, 1e6)


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
