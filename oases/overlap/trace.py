"""``parallel.trace``: a per-rank timeline of the profiled steps, from the profiler's events.

The engines label their work as ``record_function`` ranges
(:func:`oases.parallel.timing.label`) and the profiler records them with everything
else (:mod:`oases.runtime.profiling`). :func:`engine_view` keeps what shows the
overlap, in three lanes of a small Chrome trace (``trace_rank<k>.json``):

``compute``
    the engines' segments. ``oases``: ``Fa P3`` (sub-batch a's forward of block 3 up
    to its collective), ``Fa C3`` (its combine), ``Fa loss``, ``Rb 2`` (a recompute),
    ``Bb 2`` (a backward), ``Bb 2 in`` (after its input gradient's all-reduce);
    ``megatron``: ``forward``, ``backward`` and, inside them, ``F 3`` and ``B 3`` per
    block.
``comm``
    the collectives while they run: gloo's work (``gloo:all_reduce``, ...) on its own
    threads on the CPU, the NCCL kernels on their streams on CUDA. Point-to-point
    transfers (``gloo:send``, ``gloo:recv``) are the pipeline's: its lane shows the
    waits for them.
``pipeline``
    the pipeline runner's actions and transfer waits (labels ``pp F2``, ``pp wait B1``,
    shown without the ``pp`` prefix).

On CUDA a label's range is the device's (the profiler's ``gpu_user_annotation``: the
kernels launched inside it on the thread that opened it), so it is on the device's
clock. A label with no device range, such as a backward launched from autograd's
device thread or a wait that launches nothing, keeps its host range, with category
``host``. Times are microseconds from the first event kept. The runner's own labels
(``sub-batch 0``, ``launch all-reduce``, ``wait``) stay in the full profiler trace only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from oases.parallel.timing import PIPELINE_LABEL

# the engines' segment labels: "forward", "backward", or a phase letter with an optional
# sub-batch name (a letter, or a number from the ninth on), then the block ("Fa P3",
# "Bb loss", "Bb 2 in", "F8 C1", "F 3")
_SEGMENT = re.compile(r"^(forward|backward|[FRB]([a-z]|\d+)? \S+( in)?)$")
_P2P = ("gloo:send", "gloo:recv")


def _lane(event: dict, on_cuda: bool, on_device: set) -> str | None:
    name, cat = event.get("name", ""), event.get("cat", "")
    if on_cuda and cat == "kernel":
        return "comm" if "nccl" in name.lower() else None
    if name.startswith("gloo:"):
        return None if name.startswith(_P2P) else "comm"
    if cat == "user_annotation" and on_cuda and name in on_device:
        return None  # its device range stands for it
    if cat not in ("user_annotation", "gpu_user_annotation"):
        return None
    if name.startswith(PIPELINE_LABEL):
        return "pipeline"
    return "compute" if _SEGMENT.match(name) else None


def engine_view(trace: dict, rank: int) -> dict:
    """The compute, comm and pipeline lanes of a ``torch.profiler`` Chrome trace."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    on_cuda = any(e.get("cat") == "kernel" for e in events)
    on_device = {e["name"] for e in events if e.get("cat") == "gpu_user_annotation"}
    kept = [(lane, e) for e in events if (lane := _lane(e, on_cuda, on_device)) is not None]
    t0 = min((float(e["ts"]) for _, e in kept), default=0.0)
    out = []
    for lane, e in kept:
        name = e["name"][len(PIPELINE_LABEL):] if lane == "pipeline" else e["name"]
        cat = ("comm" if lane == "comm" else
               "host" if on_cuda and e.get("cat") == "user_annotation" else "compute")
        out.append({"name": name, "cat": cat, "ph": "X",
                    "pid": rank, "tid": lane, "ts": float(e["ts"]) - t0,
                    "dur": float(e["dur"])})
    out.sort(key=lambda e: e["ts"])
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_view(profile_json: Path, out: Path, rank: int) -> Path:
    """Write :func:`engine_view` of the profiler trace ``profile_json`` to ``out``."""
    view = engine_view(json.loads(Path(profile_json).read_text()), rank)
    Path(out).write_text(json.dumps(view))
    return Path(out)
