"""Schedule engines: how a micro-batch's forward and backward run over the blocks.

``megatron`` (:mod:`oases.overlap.megatron`): ordinary autograd, blocking all-reduces.

``oases``: the micro-batch is split along the batch into sub-batches a, b that
take turns. Each sub-batch is a program of compute *segments* separated by TP
collectives; when a sub-batch reaches a collective it launches it
asynchronously and yields, and the other sub-batch computes meanwhile:

    forward     compute  | a:P0 | b:P0 | a:C0 P1 | b:C0 P1 | a:C1 P2 | ...
                comm            | AR a0 | AR b0   | AR a1   | AR b1   | ...

    (Pi = block i's partial, Ci = its combine; ARxi overlaps the other
    sub-batch's compute, across layer boundaries too.)

    backward    compute  | a:Bi | b:Bi | a:Ni Ri-1 Bi-1 | b:Ni Ri-1 Bi-1 | ...
                comm            | ARa  | ARb            | ...

    Each sub-batch's forward and backward form one program, so a's backward
    starts while b's last forward collectives are still running.

    (Bi = backward of block i down to the point where its column-parallel
    input gradient must be all-reduced, Ni = the rest of block i's backward
    (norm, residual), Ri-1 = recompute of block i-1. Recompute and backward of
    a and b interleave with no barrier between a recompute and a backward pass:
    cross-pass scheduling. Under ``fine`` a sub-batch launches Bi's all-reduce
    and runs Ri-1 before it yields, since recompute needs only the stash: the
    all-reduce overlaps its own recompute and then the other sub-batch's work.)

Context parallelism: a block whose partial waits for transfers of its own (ring
attention) is run as a program (:mod:`oases.overlap.block_programs`): each of the ring's
waits, in forward, recompute and backward, is a yield point of the sub-batch too.

The vocab-parallel loss has one collective (see oases.parallel.loss); models
that split their loss into ``loss_partial``/``loss_combine`` get it scheduled
like any other, so it does not block while the other sub-batch's all-reduce
holds the link.

Recompute modes under ``oases``:
* ``none``: the forward keeps every block's autograd graph.
* ``full``: the forward keeps only each transformer layer's input; backward
  recomputes the layer, re-issuing its forward all-reduces (as Megatron's full
  recompute), interleaved with the other sub-batch.
* ``fine``: the forward keeps each block's input and the output of its forward
  all-reduce; backward recomputes from there (partial and combine of the same
  block), so recompute never re-issues a forward collective.
Recompute replays the RNG states (default and TP streams) captured in forward,
so dropout masks are identical.

RNG: each sub-batch draws from its own streams, derived at the start of the
micro-batch (:func:`sub_batch_rng_streams`), and every segment of a sub-batch
runs with its streams swapped in. Its dropout masks are therefore exactly those
of plain autograd run on that sub-batch alone from the same streams, whatever
the interleaving (the parity tests rely on it).
A model that draws nothing (dropout 0: :func:`~oases.overlap.rng_streams.draws_random`)
gets no streams: no generator state is snapshot, swapped or replayed.

Degree 1: a sub-batch does not yield at a collective over one rank
(:func:`~oases.overlap.runner.collect`), and a run whose every collective is (tp = 1)
and that draws nothing takes the micro-batch whole (``whole_when_alone``).

Collective discipline: every rank runs the same programs in the same
round-robin order, so all ranks issue the same collectives in the same order.
Each launched collective is waited exactly once, by the runner, before its
result is handed back to the program that asked for it; no handle outlives
``forward_backward``. On CUDA, ``work.wait()`` makes the *current* stream (the
one every segment computes on) wait for the collective; the buffers stay
referenced by the runner until that wait, so the caching allocator cannot hand
their memory to another kernel while the communication stream still reads them.
Both hold only while every segment runs on the default stream: a run refuses to
start on another (:func:`~oases.parallel.comm.require_default_stream`).

ZeRO-3: the engine reaches parameters only through its ``params`` hook
(:class:`~oases.parallel.engine.BlockParams`), in :meth:`OasesEngine._enter`.

Pipeline stages: ``forward`` and ``backward`` run the same programs as separate
actions, the sub-batches' state kept in a :class:`StageRun` in between; an input
activation becomes a leaf whose gradient ``backward`` returns.

Mixed precision: forward segments and recompute run under ``amp()``, backward
segments without it; the run sits in one enclosing autocast region, so each
weight is cast once per run and its copy shared (:meth:`MicroBatchRun.cast_cache`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from oases.overlap.block_programs import Pieces, drive, program_backward
from oases.overlap.loss_weights import piece_shares
from oases.overlap.megatron import AmpFactory, MegatronEngine, StageRun
from oases.overlap.memory import SavedTensorMeter
from oases.overlap.rng_streams import sub_batch_rng_streams
from oases.overlap.runner import (Launch, ModelTraits, MicroBatchRun, Program, Wait, collect,
                                  reduce_buffer, run_joint, run_programs)
from oases.overlap.sequence import SequencePrograms
from oases.overlap.transitions import DegreeTransitions
from oases.overlap.state import BlockState, ReducedAsPartial, SubBatch
from oases.parallel.backprop import backward
from oases.parallel.comm import require_default_stream
from oases.parallel.engine import HEAD, WHOLE, BlockParams, Engine
from oases.parallel.model_view import view_of
from oases.parallel.random import TPRNGTracker
from oases.parallel.program import ProgramCutRecorder
from oases.parallel.region import Cut, CutRecorder
from oases.parallel.timing import label

__all__ = ["MegatronEngine", "OasesEngine", "StageRun", "build_engine",
           "sub_batch_rng_streams"]


class OasesEngine(SequencePrograms, DegreeTransitions):
    """The ``oases`` engine. It holds only its configuration: each call's state lives
    in an :class:`~oases.overlap.runner.MicroBatchRun` (a pipeline stage's is returned in
    the :class:`StageRun`), so one engine serves interleaved runs (several forwards
    before their backwards) and several threads. (Dropout draws from the process's
    generators, a sub-batch's streams swapped in per segment: runs that draw random
    numbers on two threads at once would take each other's draws.)"""

    name = "oases"
    pairs = True  # backward_forward interleaves the two passes' collectives

    def __init__(self, tp_group, sub_batches: int = 2, recompute: str = "none",
                 tracker: Optional[TPRNGTracker] = None,
                 params: Optional[BlockParams] = None, whole_when_alone: bool = False) -> None:
        if recompute not in ("none", "full", "fine"):
            raise ValueError(f"recompute={recompute!r}")
        self.tp_group = tp_group
        self.n = sub_batches
        # True (build_engine's): a run with nothing to hide (tp = 1) nor to draw takes
        # the micro-batch whole; False lets a one-process test drive the sub-batches
        self.whole_when_alone = whole_when_alone
        self.recompute = recompute
        self.tracker = tracker
        self.params: BlockParams = WHOLE if params is None else params  # see _enter
        # Recompute the next block down while an input-gradient all-reduce is in flight
        # (it needs only the stash). Not under ``full``: its recompute re-issues forward
        # all-reduces, which would queue on the link behind the pending one (measured
        # slower); there the recompute follows the wait.
        self._early_prepare = recompute != "full"
        self._traits = ModelTraits()  # per model: whether it draws, whether it communicates

    # ------------------------------------------------------------------ API
    def forward_backward(self, model: nn.Module, ids: torch.Tensor, targets: torch.Tensor,
                         scale: float = 1.0, amp: AmpFactory = contextlib.nullcontext,
                         docs=None) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its (detached) token-mean loss
        (:mod:`~oases.overlap.loss_weights`). Gradients accumulate scaled by ``scale``.
        ``docs``: its documents, split with the rows (each sub-batch's in the model's
        slot while that sub-batch computes)."""
        run = self._start(model, ids, targets, amp, docs=docs)
        run.forwards_left = len(run.subs)
        # One program per sub-batch, forward then backward: no barrier between the two
        # passes either (a's backward starts while b's last forward collectives run).
        run_programs(run, [self._program(run, sb, scale * sb.share) for sb in run.subs])
        return torch.stack([sb.share * sb.loss for sb in run.subs]).sum()

    def forward(self, model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                amp: AmpFactory = contextlib.nullcontext, docs=None) -> StageRun:
        """Forward of one micro-batch on a pipeline stage (see
        :meth:`MegatronEngine.forward`): the sub-batches take turns as in
        :meth:`forward_backward`, and keep their state until :meth:`backward`."""
        run = self._start(model, inp, targets, amp, inp.is_floating_point(), docs)
        run_programs(run, [self._forward(run, sb) for sb in run.subs])
        return self._stage_run(run)

    @staticmethod
    def _stage_run(run: MicroBatchRun) -> StageRun:
        if run.subs[0].targets is not None:
            return StageRun(run, loss=torch.stack([sb.share * sb.loss for sb in run.subs]).sum())
        return StageRun(run, output=torch.cat([sb.out for sb in run.subs]))

    def backward_forward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float,
                         model: nn.Module, inp: torch.Tensor, targets: Optional[torch.Tensor],
                         amp: AmpFactory = contextlib.nullcontext, docs=None):
        """:meth:`backward` of ``run`` and :meth:`forward` of the next micro-batch as one
        interleaved program (``parallel.overlap_fb``); returns what the two return,
        (input gradient, StageRun). Their programs take turns at every collective, so
        the forward's all-reduces, link-bound on a slow link, run while the backward
        computes, and the backward's while the forward computes:

            compute  | Bm:a | Bm:b | Fm+1:a | Fm+1:b | Bm:a | Bm:b | Fm+1:a | ...
            link            | ARa  | ARb    | AR'a   | AR'b | ARa  | ...

        Each run keeps its own sub-batch RNG streams and stash, so losses, gradients and
        dropout masks are those of the backward followed by the forward."""
        brun = self._resume(run, grad, amp)
        frun = self._start(model, inp, targets, amp, inp.is_floating_point(), docs)
        # the backward first: its input gradient is what the previous stage waits for
        with self.params.two_passes():
            run_joint([(brun, [self._backward(brun, sb, scale * sb.share) for sb in brun.subs]),
                       (frun, [self._forward(frun, sb) for sb in frun.subs])])
        return self._grad_in(brun), self._stage_run(frun)

    def backward(self, run: StageRun, grad: Optional[torch.Tensor], scale: float = 1.0,
                 amp: AmpFactory = contextlib.nullcontext) -> Optional[torch.Tensor]:
        """Backward of a :meth:`forward` run (see :meth:`MegatronEngine.backward`)."""
        orun = self._resume(run, grad, amp)
        run_programs(orun, [self._backward(orun, sb, scale * sb.share) for sb in orun.subs])
        return self._grad_in(orun)

    def _resume(self, srun: StageRun, grad: Optional[torch.Tensor], amp: AmpFactory) -> MicroBatchRun:
        """A forward's run, taken from its StageRun, with the output's gradient per sub-batch."""
        run, srun.state = srun.state, None
        require_default_stream(run.device, "the oases engine")
        run.amp = amp  # recompute runs under it
        if grad is not None:
            for sb, g in zip(run.subs, grad.chunk(len(run.subs))):
                sb.grad_out = g
        return run

    @staticmethod
    def _grad_in(run: MicroBatchRun) -> Optional[torch.Tensor]:
        return torch.cat([sb.grad_in for sb in run.subs]) if run.input_grad else None

    def _start(self, model, ids, targets, amp, input_grad: bool = False,
               docs=None) -> MicroBatchRun:
        require_default_stream(ids.device, "the oases engine")
        if ids.shape[0] % self.n:
            raise ValueError(f"micro-batch of {ids.shape[0]} does not split into {self.n} "
                             f"sub-batches")
        blocks = model.blocks()
        first = 0 if input_grad else 1  # the model's first block (embedding): never recomputed
        view = view_of(model)  # a user's model needs only blocks() and loss_from_hidden()
        groups = view.groups(len(blocks), first)
        rng, alone = self._traits(model, blocks)
        # Nothing to hide nor drawn: the micro-batch whole (a split would cost smaller
        # matmuls). With dropout the split stays, as the masks are the sub-batch streams';
        # its programs then run in turn (none yields at a one-rank collective: collect).
        n = 1 if self.whole_when_alone and alone and not rng else self.n
        tgts = targets.chunk(n) if targets is not None else [None] * n
        subs = [SubBatch("abcdefgh"[s] if s < 8 else str(s), x, y, w) for s, (x, y, w)
                in enumerate(zip(ids.chunk(n), tgts, piece_shares(model, tgts)))]
        streams = sub_batch_rng_streams(self.tracker, ids.device, n) if rng else [None] * n
        home, sp = view.home(blocks), view.sequence_parallel
        return MicroBatchRun(model, blocks, groups, subs, streams, self.tracker, ids.device, amp,
                             input_grad, home, rng=rng, sequence_parallel=sp, stagger=sp and n >= 3,
                             documents=sub_batch_documents(view.documents, docs, n))

    def _program(self, run: MicroBatchRun, sb: SubBatch, scale: float) -> Program:
        yield from self._forward(run, sb)
        run.forwards_left -= 1
        if run.forwards_left == 0:  # every sub-batch's activations are saved now
            SavedTensorMeter.end_of_forward()
        yield from self._backward(run, sb, scale)

    def _segment(self, run: MicroBatchRun, i: int, span: str, grad: bool, entry, cuts: list,
                 toward: Optional[int] = None):
        """``segment(first)`` for :func:`~oases.overlap.block_programs.drive`: a piece of
        block i's forward runs inside its parameters (the first piece also starts
        gathering block ``toward``'s), grad mode, ``run.amp()``, the TP region ``entry``
        (a reusable context: a CutRecorder, ``entering(GATHERED)``) and the recorder of its
        deferred backwards, ``cuts``."""
        return Pieces(lambda first: (self._enter(i, toward if first else None, span),
                                     torch.set_grad_enabled(grad), run.amp(), entry,
                                     ProgramCutRecorder(cuts)))

    def _enter(self, block: int, toward: Optional[int] = None, span: Optional[str] = None):
        """The way into a block's compute, taken on entering it and again on resuming it
        after a wait (the other sub-batches ran meanwhile): its parameters whole through
        the :class:`~oases.parallel.engine.BlockParams` hook (ZeRO-3 gathers them there,
        and starts gathering block ``toward``, where the pass goes next), then its span.
        The hook sees the same calls in the same order on every rank."""
        self.params.use(block, toward)
        return label(span) if span is not None else contextlib.nullcontext()

    # ------------------------------------------------------------- forward
    def _forward(self, run: MicroBatchRun, sb: SubBatch) -> Program:
        model, blocks, groups = run.model, run.blocks, run.groups
        starts = {a for a, _ in groups}
        in_group = {i for a, b in groups for i in range(a, b)}
        home = run.home
        x = sb.ids
        sp = run.sequence_parallel  # then a later stage's input is a chunk
        block = self._sp_block if sp else self._block
        for i, blk in enumerate(blocks):
            prev = blocks[i - 1].degree if i > 0 else home
            if x.is_floating_point():
                x = yield from self._to_degree(model, x, prev, blk.degree)
            keep = self.recompute == "none" or i not in in_group
            st = BlockState()
            if i == 0 and not run.input_grad:  # token ids into the embedding
                x_in = x
            else:
                x_in = x.detach().requires_grad_(keep)
            if not keep:
                st.rng_partial = run.snap()
                if self.recompute == "fine" or i in starts:
                    st.saved_x = run.stash(x_in, "input x")
            x = yield from block(run, i, x_in, keep, st, f"F{sb.name}")
            # a block that modified what recompute keeps fails here, not with wrong gradients
            for kept in (st.saved_x, st.saved_g, st.saved_r):
                if kept is not None:
                    kept.check(blk, i, self.recompute)
            sb.blocks.append(st)
        x = yield from self._to_degree(model, x, blocks[-1].degree, home)
        if sb.targets is None:  # a pipeline stage before the last: its output goes on
            sb.out = x.detach()
            return
        if sp:
            yield from self._sp_loss(run, sb, x)
            return
        x_last = x.detach().requires_grad_()
        view = view_of(model)
        if view.split_loss:  # then the loss's collective is scheduled too
            with label(f"F{sb.name} loss"), run.amp(), CutRecorder() as rec:
                state, stats = view.loss_partial(x_last, sb.targets)
            (stats,) = yield from collect([("ar", stats, view.tp_group)])
            with label(f"F{sb.name} loss"), run.amp():
                loss = view.loss_combine(state, stats)
        else:
            with label(f"F{sb.name} loss"), run.amp(), CutRecorder() as rec:
                loss = model.loss_from_hidden(x_last, sb.targets)
        sb.head = (x_last, rec.cuts, loss)
        sb.loss = loss.detach()

    def _block(self, run: MicroBatchRun, i: int, x_in: torch.Tensor, keep: bool, st: BlockState,
               name: str) -> Program:
        """Block i of a sub-batch, forward: partial, all-reduce, combine; returns its
        output. ``keep``: its graph stays live (else the ``fine`` stash is kept)."""
        blk = run.blocks[i]
        rec = CutRecorder()
        p = yield from drive(run, lambda: blk.partial_steps(x_in),
                             self._segment(run, i, f"{name} P{i}", keep, rec, st.later, i + 1),
                             cuts=st.later)
        (reduced,) = yield from collect([("ar", reduce_buffer(p, keep, blk, x_in), blk.tp_group)])
        if not keep:
            st.rng_combine = run.snap()
            if self.recompute == "fine":
                st.saved_r = run.stash(reduced, "reduced input (the all-reduced partial sum)")
        with self._enter(i, span=f"{name} C{i}"), torch.set_grad_enabled(keep), run.amp():
            out = blk.combine(x_in, ReducedAsPartial.apply(p, reduced) if keep else reduced)
        if keep:
            st.x_in, st.cuts, st.out = x_in, rec.cuts, out
        return out

    # ------------------------------------------------------------ backward
    def _cut_backward(self, cuts: list[Cut], name: str, prepare: Optional[Program],
                      block: int = HEAD) -> Program:
        """All-reduce the cuts' input gradients, continue from them (:meth:`_reduce_back`)."""
        cuts = [c for c in cuts if c.leaf.grad is not None]
        yield from self._reduce_back([("ar", c.leaf.grad, c.group) for c in cuts],
                                     [c.source for c in cuts], prepare, block, name)

    def _reduce_back(self, reqs: list, sources: list, prepare: Optional[Program],
                     block: int, name: str, after=None) -> Program:
        """Launch the collectives ``reqs`` of input gradients and continue backward from
        ``sources`` with their results (each through ``after``). ``prepare`` (the next
        block down's recompute, or None) needs only the stash: under ``_early_prepare``
        it runs while they are in flight, before this sub-batch yields; else after."""
        early = self._early_prepare and prepare is not None
        if reqs:
            ticket = yield Launch(reqs)
            if early:
                yield from prepare
            grads = yield Wait(ticket)
            with self._enter(block, span=name):
                backward(sources, [after(g) for g in grads] if after else grads)
        if prepare is not None and not (early and reqs):
            yield from prepare

    def _rebuild(self, run: MicroBatchRun, blk, st: BlockState, reduced: torch.Tensor,
                 x_in: torch.Tensor, p):
        with run.replay(st.rng_combine), torch.enable_grad(), run.amp():
            st.out = blk.combine(x_in, ReducedAsPartial.apply(p, reduced))
        st.x_in = x_in

    def _recompute_fine(self, run: MicroBatchRun, i: int, st: BlockState, name: str) -> Program:
        blk = run.blocks[i]
        x_in = st.saved_x.get(blk, i, self.recompute).detach().requires_grad_()
        reduced = st.saved_r.get(blk, i, self.recompute)
        rec = CutRecorder()
        p = yield from drive(run, lambda: blk.partial_steps(x_in),
                             self._segment(run, i, name, True, rec, st.later),
                             replay=st.rng_partial, cuts=st.later)
        st.cuts = rec.cuts
        with label(name):
            self._rebuild(run, blk, st, reduced, x_in, p)
        st.saved_x = st.saved_r = None

    def _recompute_group(self, run: MicroBatchRun, sbs: list[BlockState], a: int, b: int,
                         name: str) -> Program:
        """Re-run blocks a..b-1 from the stashed group input, forward all-reduces (and
        resharding all-gathers) included."""
        model, blocks = run.model, run.blocks
        x = sbs[a].saved_x.get(blocks[a], a, self.recompute)
        for i in range(a, b):
            st = sbs[i]
            if i > a:
                x = yield from self._to_degree(model, x, blocks[i - 1].degree, blocks[i].degree)
            x_in = x.detach().requires_grad_()
            rec = CutRecorder()
            p = yield from drive(run, lambda: blocks[i].partial_steps(x_in),
                                 self._segment(run, i, f"{name} P{i}", True, rec, st.later,
                                               i + 1), replay=st.rng_partial, cuts=st.later)
            buf = p.detach().clone(memory_format=torch.contiguous_format)
            (reduced,) = yield from collect([("ar", buf, blocks[i].tp_group)])  # re-issued
            st.cuts = rec.cuts
            with label(f"{name} C{i}"):
                self._rebuild(run, blocks[i], st, reduced, x_in, p)
            x = st.out
        sbs[a].saved_x = None

    def _prepare(self, run: MicroBatchRun, group_of, sb: SubBatch, i: int) -> Program:
        """Make block i's autograd graph live again (recompute), if the forward dropped it."""
        st = sb.blocks[i]
        if st.out is not None:
            return
        sp = run.sequence_parallel
        with self._enter(i):
            if self.recompute == "fine":
                fine = self._sp_recompute_fine if sp else self._recompute_fine
                yield from fine(run, i, st, f"R{sb.name} {i}")
            else:
                a, b = group_of[i]
                group = self._sp_recompute_group if sp else self._recompute_group
                yield from group(run, sb.blocks, a, b, f"R{sb.name}")

    def _backward(self, run: MicroBatchRun, sb: SubBatch, scale: float) -> Program:
        """Block by block from the loss. Each input-gradient all-reduce is launched, the
        recompute of the next block down runs while it is in flight (it needs only the
        stash, not the gradient; not under ``full``, see ``_early_prepare``), and only
        then does this sub-batch wait and let the others run: the all-reduce overlaps
        this sub-batch's recompute and the other sub-batches' work."""
        model, blocks, groups = run.model, run.blocks, run.groups
        group_of = {i: (a, b) for a, b in groups for i in range(a, b)}
        home = run.home
        last_block = self._prepare(run, group_of, sb, len(blocks) - 1)
        sp = run.sequence_parallel
        if sb.head is None:  # the gradient of the stage's output: from the next stage
            yield from last_block
            g_out, sb.grad_out = sb.grad_out, None
        elif sp:
            g_out = yield from self._sp_loss_backward(run, sb, scale, last_block)
        else:
            x_last, cuts, loss = sb.head
            with self._enter(HEAD, span=f"B{sb.name} loss"):
                backward(loss, torch.ones_like(loss) * scale)
            yield from self._cut_backward(cuts, f"B{sb.name} head", last_block)
            sb.head, g_out = None, x_last.grad
        g = yield from self._grad_to_degree(model, g_out, home, blocks[-1].degree)
        block_backward = self._sp_block_backward if sp else self._block_backward
        for i in reversed(range(len(blocks))):
            st = sb.blocks[i]
            nxt = self._prepare(run, group_of, sb, i - 1) if i > 0 else None
            yield from block_backward(run, sb, i, g, nxt)
            g = st.x_in.grad if i > 0 or run.input_grad else None
            t_to = blocks[i - 1].degree if i > 0 else home
            g = yield from self._grad_to_degree(model, g, blocks[i].degree, t_to)
            sb.blocks[i] = None
        sb.grad_in = g

    def _block_backward(self, run: MicroBatchRun, sb: SubBatch, i: int, grad: torch.Tensor,
                        prepare: Optional[Program]) -> Program:
        """Backward of block i from its output's gradient, its input-gradient all-reduce
        scheduled (:meth:`_cut_backward`)."""
        st = sb.blocks[i]
        with self._enter(i, i - 1 if i > 0 else None, f"B{sb.name} {i}"):
            backward(st.out, grad)
        yield from program_backward(run, st.later,
                                    lambda first: self._enter(i, span=f"B{sb.name} {i} ring"))
        yield from self._cut_backward(st.cuts, f"B{sb.name} {i} in", prepare, i)


def sub_batch_documents(slot, docs, n: int) -> Optional[tuple]:
    """(the model's slot, each sub-batch's documents), or None where the run has none:
    the rows split as the sub-batches split them."""
    if docs is None:
        return None
    if slot is None:
        raise ValueError("the model has no document slot (`documents`): it cannot keep "
                         "attention inside packed documents")
    return slot, docs.chunk(n)


def build_engine(name: str, tp_group, sub_batches: int = 2, recompute: str = "none",
                   tracker: Optional[TPRNGTracker] = None,
                   params: Optional[BlockParams] = None) -> Engine:
    """The engine for ``parallel.schedule``. Under ``megatron`` recompute is the model's
    business (``CausalLM(recompute=...)``); under ``oases`` the engine does it."""
    if name == "megatron":
        return MegatronEngine()
    if name == "oases":  # selective recompute is the model's (its attention cores)
        return OasesEngine(tp_group, sub_batches, "none" if recompute == "selective" else
                             recompute, tracker, params, whole_when_alone=True)
    raise ValueError(f"unknown schedule {name!r}")
