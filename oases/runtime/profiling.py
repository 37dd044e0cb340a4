"""``profile.steps=[a, b]``: ``torch.profiler`` over optimizer steps a..b on every rank.

Each rank writes ``<out_dir>/profile/rank<k>.json``, a Chrome trace (open it in
Perfetto, https://ui.perfetto.dev, or chrome://tracing) of CPU activity and, on
CUDA, of the kernels and NCCL collectives on their streams. The engines label their
work as ``record_function`` ranges (:func:`oases.parallel.timing.label`): under
``oases`` each turn of a sub-batch (``sub-batch 0``), its segments (``Fa P3``: sub-batch
a's forward of block 3 up to its collective; ``Bb 2``: b's backward of block 2), each
``launch all-reduce`` and each ``wait``; under ``megatron`` ``forward`` and
``backward`` and, inside them, ``F 3`` and ``B 3`` per block; a pipeline stage's
actions ``pp F2``, ``pp wait B1``.
On CUDA, ``profile.memory_snapshot=true`` records the allocator's history over the
same steps and dumps ``<out_dir>/profile/memory_rank<k>.pickle`` (drag it into
https://pytorch.org/memory_viz).

``parallel.trace=true`` adds ``<out_dir>/trace_rank<k>.json``, a view of the same
events with the engine's segments, the collectives and the pipeline's actions in three
lanes (:mod:`oases.overlap.trace`), of the profiled steps or, without ``profile.steps``,
of one step after warm-up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from oases.overlap.trace import write_view


class StepProfiler:
    """Call :meth:`before` ahead of each step and :meth:`after` once it is done."""

    def __init__(self, window: Optional[tuple[int, int]], out_dir: str, rank: int,
                 device: torch.device, memory_snapshot: bool = False,
                 view: bool = False) -> None:
        self.window = window
        self.out_dir = Path(out_dir)
        self.view = view  # also write the trace view (parallel.trace)
        self.dir = self.out_dir / "profile"
        self.rank = rank
        self.device = device
        self.memory = memory_snapshot and device.type == "cuda"
        self.prof = None

    def before(self, step: int) -> None:
        """Step ``step`` (1-based) is about to run: start at the window's first step (or
        the first step of a resumed run inside the window)."""
        if self.window is None or self.prof is not None:
            return
        a, b = self.window
        if not a <= step <= b:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()

    def after(self, step: int) -> Optional[Path]:
        """Step ``step`` is done: at the window's last step, stop and write the trace
        (returned)."""
        if self.prof is None or step != self.window[1]:
            return None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the window's kernels end inside the trace
        self.prof.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}.json"
        self.prof.export_chrome_trace(str(path))
        self.prof = None
        if self.view:
            write_view(path, self.out_dir / f"trace_rank{self.rank}.json", self.rank)
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.dir / f"memory_rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        return path

    def close(self) -> None:
        """Stop a profile the run left early (an error, a preemption) without writing."""
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None
            if self.memory:
                torch.cuda.memory._record_memory_history(enabled=None)
