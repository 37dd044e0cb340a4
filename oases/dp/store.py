"""The ZeRO parameter store: a level-3 block's parameters gathered for each use.

:class:`ParamStore` is the :class:`~oases.parallel.engine.BlockParams` hook of a run
with sharded parameters: the ``oases`` engine calls it before each block's compute;
under plain ``model(...)`` calls (the ``megatron`` engine, evaluation) hooks on the
model call it (:meth:`ParamStore.install_hooks`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from oases.dp.zero import ShardedFlat, free_
from oases.parallel.comm import comm_scope, current_scope
from oases.parallel.engine import HEAD
from oases.parallel.model_view import view_of
from oases.parallel.timing import IntervalTimer


class ParamStore:
    """Gathers a level-3 unit's parameters before use and frees them after; waits for a
    level-1/2 unit's post-step all-gather before its first use.

    A *unit* is one block of the model's block protocol (index as in
    ``model.blocks()``), or the parameters outside every block (norm and head: the
    last index; :data:`~oases.parallel.engine.HEAD` to :meth:`use`).
    ``use(u, prefetch)`` makes unit u's parameters whole (waiting for its prefetch, or
    gathering now) and starts the all-gather of unit ``prefetch``, so the next block's
    gather runs during this block's compute, in forward (prefetch = u + 1) and
    backward (prefetch = u - 1); the gathers of ``depth`` units ahead are queued. At
    most ``keep + depth`` units stay gathered; the least recently used one is freed
    first (so the last blocks of the forward are still whole when backward starts).
    A unit is never used without ``use``: the engines call it before a block's
    forward, recompute and backward, and hooks on the model cover plain
    ``model(...)`` calls (the megatron engine, evaluation).
    Every rank of a unit's group makes the same calls in the same order (they run
    the same schedule), so the all-gathers match. ``release()`` (end of every
    backward pass of a step, before the optimizer changes the owned ranges) frees all.

    Streams: ``use`` waits for a gather on the current stream, and a freed unit's
    storage goes back to the caching allocator for reuse at once; both are safe because
    every kernel reading the parameters runs on the default stream (the engines and the
    reducer refuse another, :func:`~oases.parallel.comm.require_default_stream`).
    """

    def __init__(self, units: dict[int, list[ShardedFlat]], head: int, tied: bool,
                 keep: int = 4, prefetch: bool = True,
                 pending: Optional[dict[int, list[ShardedFlat]]] = None) -> None:
        self.units = {u: fl for u, fl in units.items() if fl}
        self.pending = {u: fl for u, fl in (pending or {}).items() if fl}  # levels 1, 2
        self.head, self.tied, self.keep, self.prefetch = head, tied, keep, prefetch
        self.depth = 2          # units gathered ahead (queued in order on the group)
        # time waiting for all-gathers (exposed), since take_wait: on CUDA the wait holds
        # the stream, not the host, so it is timed on the device's timeline
        flats = [fl for fls in (*self.units.values(), *self.pending.values()) for fl in fls]
        self.wait = IntervalTimer(flats[0].flat.device if flats else None)
        self._gathered: dict[int, int] = {}   # unit -> last use (a counter)
        self._clock = 0
        self.gathers = 0        # all-gathers issued (tests, the benchmark)
        self.late = 0           # of which not prefetched: the caller waited for them

    def use(self, block: int, prefetch: Optional[int] = None) -> None:
        if block == HEAD:
            self.use_head()
            return
        if block in self.pending:
            t0 = self.wait.start()
            for fl in self.pending[block]:
                fl.settle()
            self.wait.stop(t0)
        if block not in self.units:
            self._prefetch(block, prefetch)
            return
        self._clock += 1
        if block not in self._gathered:
            self.late += 1
            self._launch(block)
        self._gathered[block] = self._clock
        t0 = self.wait.start()
        for fl in self.units[block]:
            if fl.work is not None:
                fl.work.wait()
                fl.work = None
        self.wait.stop(t0)
        self._prefetch(block, prefetch)
        self._evict(block, prefetch)

    def _prefetch(self, u: int, nxt: Optional[int]) -> None:
        """Launch the gathers of the next ``depth`` units in the direction u -> nxt (the
        head counts as the unit after the last block)."""
        if not self.prefetch or nxt is None:
            return
        step = nxt - u
        for k in range(self.depth):
            v = nxt + k * step
            if v in self.units and v not in self._gathered:
                self._launch(v)

    def use_head(self) -> None:
        """The head's parameters, and with tied embeddings (pp = 1) the embedding's."""
        if self.tied:
            self.use(0)
        self.use(self.head)

    def _launch(self, u: int) -> None:
        if u in self._gathered:
            return
        for fl in self.units[u]:
            fl.work = fl.gather(async_op=True)
        self.gathers += 1
        self._gathered[u] = self._clock

    def _evict(self, u: int, nxt: Optional[int]) -> None:
        ahead = set()
        if nxt is not None:
            ahead = {nxt + k * (nxt - u) for k in range(self.depth)}
        while len(self._gathered) > self.keep + self.depth:
            cands = [k for k in self._gathered if k != u and k not in ahead]
            if not cands:
                return
            self._free(min(cands, key=lambda k: self._gathered[k]))

    def _free(self, u: int) -> None:
        for fl in self.units[u]:
            if fl.work is not None:
                fl.work.wait()
                fl.work = None
            free_(fl.flat)
        del self._gathered[u]

    @contextlib.contextmanager
    def two_passes(self):
        """A backward and a forward interleaved (``overlap_fb``) use blocks from both ends
        at once: keep the other pass's window (its block and the ``depth`` ahead) as well,
        so the two do not evict each other's prefetched blocks."""
        self.keep += 1 + self.depth
        try:
            yield
        finally:
            self.keep -= 1 + self.depth

    def take_wait(self) -> float:
        """Seconds spent waiting for all-gathers since the last call (on CUDA: once
        they have run)."""
        return self.wait.take()

    def release(self) -> None:
        for fls in self.pending.values():
            for fl in fls:
                fl.settle()
        for u in list(self._gathered):
            self._free(u)

    def sync_params(self) -> None:
        """Levels 1, 2 after the optimizer step: launch the all-gathers in forward order."""
        for u in sorted(self.pending):
            for fl in self.pending[u]:
                fl.sync_params()

    def gather_all(self) -> None:
        """Every unit whole, until :meth:`release` (inspection: tests compare levels)."""
        for fls in self.pending.values():
            for fl in fls:
                fl.settle()
        for u in sorted(self.units):
            for fl in self.units[u]:
                if fl.work is not None:
                    fl.work.wait()
                    fl.work = None
                # the exact parameters (not the compute dtype's rounding of them)
                fl.gather(async_op=False, exact=True)
            self._gathered[u] = self._clock

    def install_hooks(self, model: nn.Module) -> list:
        """Hooks for plain ``model(...)`` calls: a block's forward uses it and prefetches
        the next; the gradient of a block's output (its backward is next) uses it and
        prefetches the block below; the final norm uses the head; the gradient of the
        model's output (backward starts) uses the head or, on a pipeline stage before
        the last, the last block."""
        handles = []
        blocks = model.blocks()
        for i, blk in enumerate(blocks):
            handles.append(blk.register_forward_pre_hook(
                lambda m, args, i=i: self.use(i, i + 1)))
            handles.append(blk.register_forward_hook(
                lambda m, args, out, i=i: self._on_output(out, i, i - 1)))
        if model.is_last:  # a CausalLM (stage) holds its final norm on the last stage only
            handles.append(model.norm.register_forward_pre_hook(lambda m, args: self.use_head()))
            last = self.head
        else:
            last = len(blocks) - 1
        handles.append(model.register_forward_hook(
            lambda m, args, out: self._on_output(out, last, len(blocks) - 1)))
        for chunk in view_of(model).chunks or ():  # interleaved: each chunk is called
            first = chunk.blocks()[0]
            a = next(i for i, b in enumerate(blocks) if b is first)
            z = a + len(chunk.blocks()) - 1  # its last block, in the model's numbering
            u, nxt = (self.head, z) if chunk.is_last else (z, z - 1 if z > a else None)
            handles.append(chunk.register_forward_hook(
                lambda m, args, out, u=u, nxt=nxt: self._on_output(out, u, nxt)))
        return handles

    def _on_output(self, out, u: int, nxt: int) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            # on CUDA the hook runs on autograd's device thread: its gathers belong to the
            # forward's comm scope (counters, observers)
            scope = current_scope()

            def hook(g):
                with comm_scope(scope):
                    if u == self.head and self.tied:
                        self.use(0)
                    self.use(u, nxt)
            out.register_hook(hook)
