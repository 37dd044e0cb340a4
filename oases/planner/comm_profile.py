"""Collectives measured on the live cluster (``parallel.plan=auto``; every rank calls
:func:`profile_comm`, it is collective).

* all-reduce over each degree's subgroups, all-gather over each resharding group
  and the gradient all-reduce over each degree's replicas, at a few message sizes:
  the slowest rank's time, fitted to alpha + beta * bytes. ``"on"`` records the run
  they were measured in (tp, dp; global ranks from 0), so that the cost model can
  price other groups on their own links (:meth:`oases.planner.cluster.CommModel.fitted`).
* ``cpu_per_byte``: compute time the host loses per byte all-reduced while it
  computes (CPU ranks: the cores that compute also move the bytes).
* ``call_s``: what one collective costs a step beyond its bytes, measured as a step
  meets it: every rank computes in chunks and overlaps each chunk with a tiny
  all-reduce of the previous one (the oases schedule's pattern), against the same
  chunks alone. On a host with more ranks than cores (or CPU quotas), a collective
  waits for the rank the scheduler left behind; on GPUs it is the launch and
  synchronisation overhead. A step of many small micro-batches issues many calls.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from oases.planner.profile import sync_device


def _fit(points: list[tuple[float, float]]) -> list[float]:
    """Least-squares alpha + beta * bytes (alpha, beta >= 0)."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    beta = max(sum((p[0] - mx) * (p[1] - my) for p in points) / var, 0.0) if var else 0.0
    return [max(my - beta * mx, 0.0), beta]


def profile_comm(ctx, sizes=(2**16, 2**20, 2**22), reps: int = 3,
                 log: Callable[[str], None] = print) -> dict:
    """Collective fits on the live cluster; every rank must call it (collective)."""
    dg = ctx.degree_groups()
    tp = ctx.tp
    out: dict = {"all_reduce": {}, "all_gather": {}, "grad_all_reduce": {}}

    def measure(kind: str, key: str, group, make) -> None:
        pts = []
        for nbytes in sizes:
            t = 0.0
            if group is not None and dist.get_world_size(group) > 1:
                buf = make(nbytes)
                op = (lambda: dist.all_reduce(buf, group=group)) if kind != "all_gather" else \
                    (lambda: dist.all_gather_into_tensor(
                        torch.empty(buf.numel() * dist.get_world_size(group), device=ctx.device),
                        buf, group=group))
                op()  # warm-up
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    op()
                    sync_device(ctx.device)
                    ts.append(time.perf_counter() - t0)
                t = statistics.median(ts)
            slow = torch.tensor([t], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)  # the slowest group sets the pace
            total = nbytes if kind != "all_gather" else nbytes * (
                dist.get_world_size(group) if group is not None else 1)
            pts.append((float(total), float(slow)))
        out[kind][key] = _fit(pts)
        if ctx.is_main:
            a, b = out[kind][key]
            log(f"profile {kind} {key}: alpha {1e3 * a:.3f} ms, {b and 1 / b / 1e6:.1f} MB/s")

    def f32(nbytes):
        return torch.ones(max(nbytes // 4, 1), device=ctx.device)

    for t in dg.degrees:
        if t > 1:
            measure("all_reduce", str(t), dg.sub[t], f32)
    for a in dg.degrees:
        for b in dg.degrees:
            if a < b:
                measure("all_gather", f"{a}-{b}", dg.reshard_group(a, b),
                        lambda nbytes, k=b // a: f32(nbytes // k))
    for t in dg.degrees:
        if t < tp or ctx.dp > 1:
            measure("grad_all_reduce", str(t), dg.grad[t], f32)
    out["cpu_per_byte"] = {}
    for t in dg.degrees:
        if t > 1:
            out["cpu_per_byte"][str(t)] = _cpu_per_byte(ctx, dg.sub[t], out["all_reduce"][str(t)])
            if ctx.is_main:
                log(f"profile compute slowdown under degree-{t} all-reduces: "
                    f"{1e3 * 2**20 * out['cpu_per_byte'][str(t)]:.2f} ms per MiB all-reduced")
    out["on"] = {"tp": tp, "dp": ctx.dp}
    out["call_s"] = _call_cost(ctx, dg.sub[tp] if tp > 1 else dist.group.WORLD)
    if ctx.is_main:
        log(f"profile cost of a collective call in a step: {1e3 * out['call_s']:.2f} ms")
    return out


def _cpu_per_byte(ctx, group, fit: list[float]) -> float:
    """Compute time lost per byte all-reduced over ``group`` while compute runs: from the
    host's CPU accounting on CPU ranks (Linux), else from a compute loop's slowdown."""
    if ctx.device.type == "cpu" and _host_busy_s() is not None:
        return _host_cpu_per_byte(ctx, group, fit)
    return _slowdown_per_byte(ctx, group, fit)


def _host_busy_s() -> Optional[float]:
    """CPU-seconds this host's cores have spent working since boot (user, nice, system,
    irq, softirq: not idle, iowait or time a hypervisor stole), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        v = [int(x) for x in fields[1:8]]
    except (OSError, ValueError):
        return None
    if len(v) < 7:
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _host_cpu_per_byte(ctx, group, fit: list[float], nbytes: int = 2**20,
                       window_s: float = 0.4, reps: int = 3) -> float:
    """Host CPU time the collectives take, as compute time lost per byte all-reduced.

    On CPU ranks the communication runs on the cores that compute: gloo's threads and
    the kernel's network stack (on the emulated cluster also the veth, bridge and tc
    work of every link). All ranks all-reduce back to back over ``group`` for about
    ``window_s`` with nothing else to do, and the host's busy CPU-seconds in that
    window (less those of an idle window as long: other load on the machine) are the
    collectives' cost. In a step the host's cores are busy computing, so that cost
    comes out of compute, spread over the cores: every rank on the host loses
    busy / cores seconds, per byte it all-reduced. (Every rank on a host reads the same
    counters, the emulated cluster's namespaces included: nothing is summed over ranks.)
    A direct measurement: timing a compute loop with and without collectives is lost
    in scheduler noise as soon as a host runs more ranks than it has cores."""
    dev = ctx.device
    per_ar = max(fit[0] + fit[1] * nbytes, 1e-4)
    k = max(4, min(64, int(window_s / per_ar) + 1))
    bufs = [torch.ones(nbytes // 4, device=dev) for _ in range(k)]
    cores = os.cpu_count() or 1
    busy = idle = 0.0  # summed over the repeats: one noisy window does not zero the figure
    for _ in range(reps):
        dist.barrier()
        b0, t0 = _host_busy_s(), time.perf_counter()
        for w in [dist.all_reduce(x, group=group, async_op=True) for x in bufs]:
            w.wait()
        dist.barrier()
        b1, dt = _host_busy_s(), time.perf_counter() - t0
        time.sleep(dt)  # the same window with nothing running: the machine's own load
        dist.barrier()
        b2 = _host_busy_s()
        busy, idle = busy + (b1 - b0), idle + (b2 - b1)
    cost = max(0.0, busy - idle) / cores / (reps * k * nbytes)
    res = torch.tensor([cost], dtype=torch.float64, device=dev)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)  # the busiest host sets the pace
    return float(res)


def _slowdown_per_byte(ctx, group, fit: list[float], nbytes: int = 2**20, reps: int = 3) -> float:
    """Compute time lost per byte all-reduced over ``group`` while compute runs.

    On a host whose cores also drive the network (CPU ranks: gloo threads, the
    kernel's TCP stack) communication is not free even when overlapped: it takes
    cycles from the compute it hides behind. This times a fixed matmul loop alone
    and while back-to-back all-reduces run (all ranks at once, as in a step), and
    divides the extra time by the bytes all-reduced meanwhile. ~0 where a NIC or a
    GPU's copy engines move the data."""
    dev = ctx.device
    a = torch.randn(256, 512, device=dev)
    b = torch.randn(512, 512, device=dev)

    def work(n: int) -> float:
        sync_device(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        sync_device(dev)
        return time.perf_counter() - t0

    work(3)
    one = max(work(10) / 10, 1e-7)
    per_ar = max(fit[0] + fit[1] * nbytes, 1e-4)
    # long enough to all-reduce >= 4 MiB meanwhile (slow links), within 0.15..1 s
    n = max(1, int(min(1.0, max(0.15, 4 * per_ar)) / one))
    lost, moved = [], []
    for _ in range(reps):
        dist.barrier()
        own = work(n)
        alone = torch.tensor([own], dtype=torch.float64, device=dev)
        dist.all_reduce(alone, op=dist.ReduceOp.MAX)  # same count of collectives on every rank
        k = min(64, int(1.5 * float(alone) / per_ar) + 2)  # enough to outlast the loop
        bufs = [torch.ones(nbytes // 4, device=dev) for _ in range(k)]
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(x, group=group, async_op=True) for x in bufs]
        loaded = work(n)
        for w in works:
            w.wait()
        sync_device(dev)
        comm = time.perf_counter() - t0
        lost.append(max(loaded - own, 0.0))
        moved.append(k * nbytes * min(1.0, loaded / max(comm, 1e-9)))  # bytes during the loop
    res = torch.tensor([statistics.median(lost) / max(statistics.median(moved), 1.0)],
                       dtype=torch.float64, device=dev)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(res)


def _call_cost(ctx, group, chunk_s: float = 2e-3, calls: int = 48, reps: int = 3) -> float:
    """Seconds one collective call adds to a step beyond its bytes (module docstring).

    Every rank runs ``calls`` chunks of matmuls (about ``chunk_s`` each, a block's
    compute on a small model) twice: alone, and with a 4-byte all-reduce over
    ``group`` launched after each chunk and waited for after the next one (overlapped,
    as the oases schedule does). Both passes are the slowest rank's (each waits for
    the slowest at its end); the difference over the calls is the cost. Median of
    ``reps``; 0 when the calls cost nothing measurable."""
    dev = ctx.device
    a = torch.randn(128, 256, device=dev)
    b = torch.randn(256, 256, device=dev)

    def chunk(n: int) -> None:
        for _ in range(n):
            a @ b

    sync_device(dev)
    t0 = time.perf_counter()
    chunk(20)
    sync_device(dev)
    n = max(1, int(chunk_s / max((time.perf_counter() - t0) / 20, 1e-7)))
    n_t = torch.tensor([n], device=dev)
    dist.all_reduce(n_t, op=dist.ReduceOp.MIN)  # the same work on every rank
    n = int(n_t)
    tiny = torch.zeros(1, device=dev)

    def run(with_calls: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        work = None
        for _ in range(calls):
            chunk(n)
            if work is not None:
                work.wait()
            work = dist.all_reduce(tiny, group=group, async_op=True) if with_calls else None
        if work is not None:
            work.wait()
        sync_device(dev)
        dist.barrier()  # the pass ends when the slowest rank's does
        return time.perf_counter() - t0

    run(True)  # warm-up
    diffs = []
    for _ in range(reps):
        alone = run(False)
        diffs.append(run(True) - alone)
    res = torch.tensor([max(0.0, statistics.median(diffs)) / calls], dtype=torch.float64,
                       device=dev)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)
    return float(res)

