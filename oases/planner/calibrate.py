"""The calibration timer of ``parallel.plan=auto``: real training steps, timed.

The cost model's host cost of communication is fitted to these steps
(:func:`oases.planner.fit.calibrate_host_cost`). The runtime hands in the step to
time (:func:`oases.runtime.build.throwaway_step`: the real ``train_step`` on a
throwaway model fed one random micro-batch), so nothing of the run itself is
touched and the planner needs nothing from the runtime.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def timed_call(step: Callable[[], None], device: torch.device) -> float:
    """Wall seconds of one ``step()``, the device synchronised before and after (on CUDA
    the call only queues its work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def time_steps(step: Callable[[], None], device: torch.device, steps: int,
               warmup: int = 2) -> float:
    """Median wall time of ``steps`` calls of ``step`` (after ``warmup``); the slowest
    rank's figure. Collective: every rank calls it (with the same counts)."""
    times = [timed_call(step, device) for _ in range(warmup + steps)][warmup:]
    res = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(res, op=dist.ReduceOp.MAX)
    return float(res)


def time_throwaway(step, device: torch.device, steps: int) -> float:
    """:func:`time_steps` of a throwaway ``step`` (one with ``close()``, as the runtime's),
    which is closed after: its model is freed and the groups its build made destroyed
    (every rank closes it here, at the same point), and on CUDA its cached blocks go back
    before the next one is built. Collective."""
    try:
        return time_steps(step, device, steps)
    finally:
        step.close()
        if device.type == "cuda":
            torch.cuda.empty_cache()
