"""``parallel.compile``: each block's ``partial`` and ``combine`` compiled by ``torch.compile``.

The engines cut every block at its collective (:mod:`oases.parallel.block`): the compute
up to it (``partial``) and after it (``combine``) are the regions compiled, so inductor
fuses the norms, activations, dropout, residual adds and RoPE around the matmuls, while
the collectives and the sub-batch turns stay in the engines, where the overlap is made.
Both engines call the same two methods, so both run compiled code; a user's block built
from the parallel layers compiles with no code of its own.

* **One compile per distinct graph.** Parameters are inputs of the compiled graphs
  (dynamo inlines ``nn.Module`` s), so the layers of a model share their graphs; a new
  input shape (the sub-batch, the last validation batch) compiles once more, then its
  sizes are dynamic. :func:`graphs_compiled` counts the graphs, which
  the run reports after its first step and whenever it grows (a recompile).
* **Exact dropout.** ``torch._inductor.config.fallback_random`` is set: compiled code
  draws its random numbers with eager's own kernels, from the same generator states, so
  a compiled run draws eager's masks and every recompute (``full``, ``selective``,
  ``fine``) replays the forward's masks as it does in eager
  (:mod:`oases.parallel.recompute`; the selective core and its replay run eagerly).
* **Fallback.** A segment that fails to compile (a dynamo or backend error) runs eagerly
  from then on, with one warning line that names the block; ``parallel.compile=strict``
  raises instead.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn as nn
from oases.errors import UserError, first_line
from oases.parallel.recompute import outside_compiled_graphs


class CompileError(UserError):
    """``parallel.compile=strict``: a segment did not compile."""


class CompiledSegment:
    """``fn`` (a block's bound ``partial`` or ``combine``) through ``torch.compile``;
    eager from its first failure on (strict: the failure is raised)."""

    def __init__(self, fn: Callable, name: str, strict: bool) -> None:
        self.eager = fn
        self.name = name
        self.strict = strict
        self.compiled = torch.compile(fn)
        self.failed = False

    def __call__(self, *args):
        # deferred: torch._dynamo is ~1.5 s of start-up, paid by compiling runs only
        from torch._dynamo.exc import TorchDynamoException

        if self.failed:
            return self.eager(*args)
        try:
            return self.compiled(*args)
        except TorchDynamoException as e:  # a compiler failure; the segment's own errors
            # (and checkpoint's early stop of a recompute) pass through
            cause = getattr(e, "inner_exception", None) or e  # a backend's own error
            what = f"{type(cause).__name__}: {first_line(cause, 200)}"
            if self.strict:
                raise CompileError(f"parallel.compile=strict: {self.name} did not compile: "
                                   f"{what}") from e
            warnings.warn(f"parallel.compile: {self.name} runs eagerly; it did not compile "
                          f"({what})", RuntimeWarning, stacklevel=2)
            self.failed = True
            return self.eager(*args)


def compile_blocks(model: nn.Module, strict: bool = False) -> int:
    """Compile the ``partial`` and ``combine`` of every block of ``model.blocks()``;
    returns how many segments were wrapped. Under sequence parallelism (set before) the
    segments a schedule runs around the all-gather are compiled instead of ``partial``:
    ``prologue`` and ``region`` (``partial`` still, where a block defines it itself)."""
    torch._inductor.config.fallback_random = True
    outside_compiled_graphs()
    n = 0
    for i, blk in enumerate(model.blocks()):
        segs = ("partial", "combine")
        if getattr(blk, "sequence_parallel", False) and blk.around_gather()[1] != blk.partial:
            segs = ("prologue", "region", "combine")
        for seg in segs:
            fn = getattr(blk, seg)
            if isinstance(fn, CompiledSegment):
                continue
            setattr(blk, seg, CompiledSegment(fn, f"block {i} ({type(blk).__name__}.{seg})",
                                              strict))
            n += 1
    return n


def graphs_compiled() -> int:
    """Graphs compiled so far in this process (dynamo's count)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class CompileLog:
    """What a run says of compiling: the graphs of its first step and the time it took,
    then each time more graphs were compiled (the first evaluation's, which runs without
    gradients; recompiles for new input shapes)."""

    def __init__(self) -> None:
        self.seen = graphs_compiled()

    def _new(self) -> int:
        now = graphs_compiled()
        n, self.seen = now - self.seen, now
        return n

    def first_step(self, seconds: float) -> str:
        n = self._new()
        return (f"parallel.compile: {n} graphs compiled in the first step ({seconds:.1f} s, "
                f"compiling included)")

    def since(self, step: int) -> str | None:
        n = self._new()
        return (f"parallel.compile: {n} more graphs compiled by step {step} (evaluation "
                f"without gradients, or new input shapes)" if n else None)
