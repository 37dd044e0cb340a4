"""The per-call state of the ``oases`` engine and its round-robin runner.

Everything one call of the engine (``forward_backward``, or a pipeline stage's
``forward`` and later ``backward``) needs lives in an :class:`MicroBatchRun`; the
engine object holds only its configuration. Two runs of one engine may therefore
be in flight at once (a pipeline keeps several micro-batches between their
forward and backward) or run on two threads, and neither sees the other.

A run's sub-batches are *programs*: generators that compute a segment and yield
where they need a collective. :func:`run_programs` resumes them in turn with the
results of what they asked for (the timelines are in :mod:`oases.overlap.engines`).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Generator, NamedTuple, Optional

import torch
import torch.nn as nn

from oases.overlap.megatron import AmpFactory
from oases.overlap.memory import SavedTensorMeter
from oases.overlap.rng_streams import (draws_random, rng_fingerprint, rng_restore, rng_snapshot,
                                       same_rng)
from oases.parallel.comm import all_gather_async, all_reduce, reduce_scatter_async, trivial
from oases.parallel.model_view import view_of
from oases.parallel.random import TPRNGTracker
from oases.parallel.timing import label

Program = Generator[list, list, None]


@dataclass
class Launch:
    """Yielded by a program: start these collectives and resume me at once (the
    answer is an opaque ticket for :class:`Wait`); I have compute that does not
    need their results."""
    reqs: list


@dataclass
class Wait:
    """Yielded by a program: switch to the others, then hand me the results of the
    collectives of this ticket (from :class:`Launch`)."""
    launched: list


class UndeclaredRandomError(RuntimeError):
    """A model the engine found no dropout in drew random numbers during a run."""


class StashModifiedError(RuntimeError):
    """A block modified in place a tensor the engine keeps to recompute it."""


class Stashed:
    """A tensor kept for recompute, with its version counter when it was kept.

    Recompute assumes the tensor still holds the forward's values. A block that
    modifies its input ``x`` (``x += y``) or the reduced tensor (``reduced.add_(b)``)
    in place would make the recompute, and so the gradients, silently wrong; the
    version counter (shared by every view and ``detach`` of the tensor, bumped by
    every in-place op) tells, and :meth:`get` refuses with an error naming the block.
    """

    __slots__ = ("tensor", "version", "what")

    def __init__(self, t: torch.Tensor, what: str) -> None:
        self.tensor, self.version, self.what = t, t._version, what

    def check(self, blk: nn.Module, i: int, recompute: str) -> None:
        if self.tensor._version != self.version:
            raise StashModifiedError(
                f"block {i} ({type(blk).__name__}) modified its {self.what} in place; "
                f"recompute={recompute} keeps that tensor to recompute the block in "
                f"backward: return new tensors instead (y = x + z, not x += z)")

    def get(self, blk: nn.Module, i: int, recompute: str) -> torch.Tensor:
        self.check(blk, i, recompute)
        return self.tensor


@dataclass
class MicroBatchRun:
    """One call's state: the model's blocks, the sub-batches, their RNG streams, the
    device and autocast of the run, and what the forward stashed. ``rng`` False: the
    model draws no random numbers (:func:`~oases.overlap.rng_streams.draws_random`), so
    the sub-batches have no streams and nothing is snapshot, swapped or replayed."""
    model: nn.Module
    blocks: list
    groups: list
    subs: list
    streams: list                             # each sub-batch's RNG streams
    tracker: Optional[TPRNGTracker]
    device: torch.device
    amp: AmpFactory = contextlib.nullcontext  # entered around every forward segment
    input_grad: bool = False                  # the input is a previous stage's activation
    home: int = 1                             # degree of the input and output (embedding's)
    forwards_left: int = 0                    # sub-batches whose forward is still running
    stash_bytes: int = 0                      # bytes stashed for recompute (memory tests)
    rng: bool = True                          # the sub-batches draw from their own streams
    sequence_parallel: bool = False           # the model's (oases.overlap.sequence)
    stagger: bool = False                     # odd sub-batches a turn late (SP, run_joint)
    documents: Optional[tuple] = None         # (the model's slot, each sub-batch's documents)

    def documents_of(self, s: int):
        """Sub-batch ``s``'s documents in the model's slot while it computes (none: a
        no-op)."""
        if self.documents is None:
            return contextlib.nullcontext()
        slot, docs = self.documents
        return slot.use(docs[s])

    # -- RNG: every segment of a sub-batch runs on that sub-batch's streams --
    def snap(self) -> Optional[dict]:
        """The generators' states (None when the run draws nothing: replay is a no-op)."""
        return rng_snapshot(self.tracker, self.device) if self.rng else None

    def restore(self, st: Optional[dict]) -> None:
        if st is not None:
            rng_restore(self.tracker, self.device, st)

    @contextlib.contextmanager
    def replay(self, st: Optional[dict]):
        """Run the block with the RNG states ``st`` captured in forward (recompute)."""
        if st is None:
            yield
            return
        live = self.snap()
        self.restore(st)
        try:
            yield
        finally:
            self.restore(live)

    def stash(self, t: torch.Tensor, what: str) -> Stashed:
        self.stash_bytes += t.numel() * t.element_size()
        SavedTensorMeter.track(t)
        return Stashed(t, what)

    def cast_cache(self):
        """Hold autocast's weight-cast cache for the whole run.

        Autocast caches the low-precision copy of each weight (a leaf that requires
        grad) until the outermost autocast region exits. The engine enters ``amp()``
        around each forward segment, so without an enclosing region every segment,
        and every sub-batch, would cast every weight again (and under
        ``recompute=none`` each sub-batch's graph would keep its own copy). This
        region encloses the run with autocast *disabled*: the segments' ``amp()``
        nest inside it, so a weight is cast once per run and the copy shared by the
        sub-batches and by recompute (the weights do not change within a run), while
        the backward segments run outside autocast, as they should. The copies live
        until the run ends (2 bytes per weight under bf16). A caller holding an
        enclosing autocast region (a whole step) extends the cache to it; its autocast
        itself is off inside the run, where ``amp`` alone applies.
        Activations that are leaves requiring grad would be cached too (and kept
        until the run ends): the graph cuts hand views to the layers for that reason
        (:class:`oases.parallel.region.CutRecorder`)."""
        return torch.autocast(self.device.type, enabled=False)


class Traits(NamedTuple):
    draws: bool   # running the model draws random numbers (in its current training mode)
    alone: bool   # its every collective, each block's and the loss's, is over one rank,
    #               and it has no ring attention (context parallelism) to hide


class ModelTraits:
    """What an engine decides once per model (held weakly), not per run: whether running
    it draws random numbers (:func:`~oases.overlap.rng_streams.draws_random`, per training
    mode: a walk over the modules) and whether its every collective, each block's and
    the loss's, is over one rank with no ring exchange beside them. Called with the
    model and its blocks."""

    def __init__(self) -> None:
        self._of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __call__(self, model: nn.Module, blocks: list) -> Traits:
        facts = self._of.get(model)
        if facts is None:
            view = view_of(model)
            facts = {"alone": all(trivial(b.tp_group) for b in blocks)
                     and trivial(view.tp_group) and trivial(view.cp_group)}
            self._of[model] = facts
        if model.training not in facts:
            facts[model.training] = draws_random(model)
        return Traits(facts[model.training], facts["alone"])


def collect(reqs: list[tuple]) -> Program:
    """The results of the collectives ``reqs`` (("ar" | "ag" | "rs", tensor, group), as a program
    yields them), through ``yield from``: asked of the runner, which runs the other
    sub-batches meanwhile, when one of them communicates; else at once. A collective
    over one rank (a block of degree 1) has nothing to hide: a switch there only costs."""
    if all(trivial(group) for _, _, group in reqs):
        return [t for _, t, _ in reqs]  # what _launch and _wait give for a one-rank group
    return (yield reqs)


def reduce_buffer(p: torch.Tensor, graph: bool, blk: nn.Module, x_in: torch.Tensor
                  ) -> torch.Tensor:
    """The buffer a block's partial sum ``p`` is all-reduced in, in place. Where the
    forward keeps no graph (``graph`` False: recompute keeps the stash instead), ``p``
    itself: a partial sum is a new tensor (a matmul's output) that nothing else holds,
    and reducing it where it lies saves a copy of the activation per collective. A
    partial that hands back memory of its input or of the block's parameters (a view,
    the input itself) gets a copy, as every partial kept in a graph does (the graph may
    have saved it: an op that saves its output, such as ``tanh``)."""
    if not graph and p.is_contiguous() and not _aliases(p, blk, x_in):
        return p
    return p.detach().clone(memory_format=torch.contiguous_format)


def _aliases(p: torch.Tensor, blk: nn.Module, x_in: torch.Tensor) -> bool:
    mem = p.untyped_storage().data_ptr()
    return mem == x_in.untyped_storage().data_ptr() or any(
        mem == w.untyped_storage().data_ptr() for w in blk.parameters())


def _launch(reqs: list[tuple]) -> list:
    """Start each requested collective: ("ar", buf, group) all-reduces ``buf`` in
    place; ("ag", t, group) all-gathers ``t`` along dim 0 into a new tensor.
    A strided ``buf`` (a user block's partial sum or cut gradient may be a view) is
    reduced as a contiguous copy, which is what the program gets back.
    (Active observers see them through the comm functions.)"""
    out = []
    for kind, t, group in reqs:
        if trivial(group):
            out.append((t, None))
        elif kind == "ar":
            t = t.contiguous()
            with label("launch all-reduce"):
                out.append((t, all_reduce(t, group, async_op=True)))
        elif kind == "rs":
            with label("launch reduce-scatter"):
                out.append(reduce_scatter_async(t, group))
        else:
            with label("launch all-gather"):
                out.append(all_gather_async(t, group))
    return out


def _wait(pending: list) -> list[torch.Tensor]:
    res = []
    for b, work in pending:
        if work is not None:
            with label("wait"):
                work.wait()  # orders the current stream after the collective
        res.append(b)
    return res


def run_programs(run: MicroBatchRun, programs: list[Program]) -> None:
    """Round-robin over one run's sub-batch programs (see :func:`run_joint`)."""
    run_joint([(run, programs)])


def run_joint(parts: list[tuple[MicroBatchRun, list[Program]]]) -> None:
    """Round-robin: resume each program with the results of the collectives it
    launched before the others ran their next segment. ``parts``: one or more runs,
    each with its sub-batches' programs (two runs when a micro-batch's backward is
    paired with the next one's forward, ``parallel.overlap_fb``); the turn order is
    the order given, program after program. Program ``s`` of a run runs on that
    run's sub-batch streams (``run.streams[s]``), which advance only by its draws,
    so the interleaving never changes what a sub-batch draws.

    ``run.stagger``: the run's odd sub-batches start one turn late, so that they stay a
    segment behind the even ones. A program whose segments alternate short and long
    (sequence parallelism: the combine and prologue, then the region) then has, between
    any two of its segments, a long segment of another program to hide its collective;
    in step, a short segment's collective would find only the others' short segments
    (:mod:`oases.overlap.sequence`). It needs three sub-batches or more: with two, one
    of a sub-batch's two collectives per block still meets a short segment."""
    owners = [(run, s) for run, progs in parts for s in range(len(progs))]
    programs = [p for _, progs in parts for p in progs]
    pending: list = [None] * len(programs)
    alive = [True] * len(programs)

    def advance(k: int, value) -> None:
        run, s = owners[k]
        live = run.snap()
        run.restore(run.streams[s])
        try:
            with label(f"sub-batch {s}"), run.documents_of(s):
                req = programs[k].send(value)
                while isinstance(req, Launch):  # launch, keep computing in the same program
                    req = programs[k].send(_launch(req.reqs))
        except StopIteration:
            alive[k] = False
            pending[k] = None
            return
        finally:  # sub-batch s's streams advance only by its own draws (none: no-ops)
            run.streams[s] = run.snap()
            run.restore(live)
        # a Wait hands back collectives launched earlier; a list is launched now
        pending[k] = req.launched if isinstance(req, Wait) else _launch(req)

    # The runs that swap no streams rely on their model drawing nothing: check it, for
    # the price of reading the generators twice. (Another thread drawing meanwhile would
    # trip it too; such runs take each other's draws anyway, see OasesEngine.)
    quiet = next((run for run, _ in parts if not run.rng), None)
    before = rng_fingerprint(quiet.tracker, quiet.device) if quiet is not None else None
    # one autocast region around all of them: the runs share the weights' casts
    with parts[0][0].cast_cache():
        late = [run.stagger and s % 2 == 1 for run, s in owners]
        for k in range(len(programs)):
            if not late[k]:
                advance(k, None)
        while any(alive):
            for k in range(len(programs)):
                if late[k]:
                    late[k] = False
                    advance(k, None)
                elif alive[k]:
                    advance(k, _wait(pending[k]))
    if quiet is not None and not same_rng(before, rng_fingerprint(quiet.tracker, quiet.device)):
        raise UndeclaredRandomError(
            f"{type(quiet.model).__name__} drew random numbers in the oases engine, which "
            "found no dropout in it (oases.overlap.rng_streams.draws_random) and so did "
            "not give its sub-batches their own RNG streams: recompute would replay other "
            "masks. Set `draws_random = True` on the block that draws (F.dropout with a "
            "literal rate, torch.rand, ...) or use an nn.Dropout module")
