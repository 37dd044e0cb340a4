"""Activation recompute that replays RNG exactly, TP stream included.

``torch.utils.checkpoint`` already restores the default CPU/CUDA generator
before re-running a function; the TP stream of :class:`TPRNGTracker` lives
outside it, so we snapshot it at forward time and swap the snapshot in while
the recompute runs. Recomputed dropout masks then equal the forward ones in
replicated and sharded regions alike.

The re-run happens inside backward, on autograd's device thread on CUDA, whose comm
scope is empty: it runs in the scope its forward ran in
(:class:`~oases.parallel.comm.CommScope`), so its all-reduces are counted and traced, or
skipped by ``NoopCollectives``, as the forward's were.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
from torch.utils.checkpoint import checkpoint

from oases.parallel.comm import comm_scope, current_scope
from oases.parallel.random import TPRNGTracker


def _recompute_contexts(tracker: Optional[TPRNGTracker]):
    """(forward context, re-run context), made when the forward runs: the re-run gets
    the forward's TP RNG state and comm scope."""
    snap = None if tracker is None or tracker.tp_state is None else tracker.tp_state.clone()
    scope = current_scope()

    @contextlib.contextmanager
    def replay():
        with comm_scope(scope):
            if snap is None:
                yield
                return
            current = tracker.tp_state
            tracker.tp_state = snap.clone()
            try:
                yield
            finally:
                tracker.tp_state = current

    return contextlib.nullcontext(), replay()


def recompute(fn: Callable, *args, tracker: Optional[TPRNGTracker] = None) -> torch.Tensor:
    """Run ``fn(*args)`` saving only its inputs; re-run it in backward. Compiled code
    (``parallel.compile``) calls it eagerly: its RNG replay is Python state
    (:func:`outside_compiled_graphs`)."""
    return _RUN[0](fn, *args, tracker=tracker)


def _checkpointed(fn: Callable, *args, tracker: Optional[TPRNGTracker] = None) -> torch.Tensor:
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: _recompute_contexts(tracker))


_RUN = [_checkpointed]  # what recompute runs


def outside_compiled_graphs() -> None:
    """From here on a compiled segment that calls :func:`recompute` (the selective
    attention core) leaves the checkpoint to eager code, a graph break:
    ``parallel.compile`` (:func:`oases.parallel.compile.compile_blocks`) calls it. Not
    done at import, as ``torch.compiler.disable`` imports dynamo: ~1.5 s of every
    process's start-up, for runs that compile nothing."""
    if _RUN[0] is _checkpointed:
        _RUN[0] = torch.compiler.disable(_checkpointed)
