"""How much of the communication a GPU trace shows hidden under computation.

Reads a Chrome trace written by ``torch.profiler`` (``prof.export_chrome_trace``): its
GPU kernels are the events of category ``kernel``, each with a start ``ts`` and a
duration ``dur`` in microseconds and the device in ``args.device``. NCCL's kernels
(names starting ``nccl``) are communication; every other kernel is computation. A
communication kernel's time is *hidden* where some computation kernel runs at the same
moment on the same device (another stream); the figure is hidden time / communication
time, per device and in total.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Iterable


def _merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(span: tuple[float, float], merged: list[tuple[float, float]],
            starts: list[float]) -> float:
    """Length of ``span`` covered by the disjoint sorted intervals ``merged``."""
    a, b = span
    i = max(0, bisect.bisect_right(starts, a) - 1)
    total = 0.0
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
        total += max(0.0, hi - lo)
        i += 1
    return total


def is_comm(name: str) -> bool:
    return name.lower().startswith("nccl")


def hidden_fraction(events: list[dict]) -> dict:
    """``{"comm_us", "hidden_us", "hidden", "per_device": {d: {...}}}`` of a trace's
    events (Chrome trace ``traceEvents``). ``hidden`` is None when the trace holds no
    communication kernel."""
    by_dev: dict = {}
    for e in events:
        if e.get("cat") != "kernel" or "dur" not in e:
            continue
        dev = (e.get("args") or {}).get("device", 0)
        comm, comp = by_dev.setdefault(dev, ([], []))
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        (comm if is_comm(e.get("name", "")) else comp).append(span)
    per = {}
    for dev, (comm, comp) in sorted(by_dev.items()):
        merged = _merge(comp)
        starts = [a for a, _ in merged]
        total = sum(b - a for a, b in comm)
        hid = sum(covered(c, merged, starts) for c in comm)
        per[dev] = {"comm_us": total, "hidden_us": hid,
                    "compute_us": sum(b - a for a, b in merged),
                    "hidden": hid / total if total else None}
    comm_us = sum(p["comm_us"] for p in per.values())
    hidden_us = sum(p["hidden_us"] for p in per.values())
    return {"comm_us": comm_us, "hidden_us": hidden_us,
            "hidden": hidden_us / comm_us if comm_us else None, "per_device": per}


def kernel_busy(events: list[dict]) -> dict:
    """``{"busy_us", "kernels"}``: how long some kernel ran (the union of every kernel's
    interval, on any device and stream) and how many kernels ran, in a trace's events."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
             if e.get("cat") == "kernel" and "dur" in e]
    return {"busy_us": sum(b - a for a, b in _merge(spans)), "kernels": len(spans)}


def read_trace(path: str | Path) -> list[dict]:
    """The events of the Chrome trace file at ``path``."""
    data = json.loads(Path(path).read_text())
    return data["traceEvents"] if isinstance(data, dict) else data


def trace_hidden_fraction(path: str | Path) -> dict:
    """:func:`hidden_fraction` of the Chrome trace file at ``path``."""
    return hidden_fraction(read_trace(path))
