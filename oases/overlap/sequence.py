"""Sequence parallelism under the ``oases`` engine: each block's all-gather and
reduce-scatter are collectives the other sub-batch's compute hides, like the all-reduce
they replace (oases.parallel.sequence has the layout).

A block of a sub-batch is three segments and two collectives, forward and backward:

    forward    | Pj: prologue(x_j) | AG h | R: region(h) | RS p | C: combine(x_j, r_j) |
    backward   | C' -> dr_j | AG dr | R' -> dh | RS dh | P' -> dx_j (+ residual) |

so a sub-batch yields twice per block where it yielded once, and its segments
alternate short (C P: norms, dropout, residual, on 1/tp of the tokens) and long (R).
With two sub-batches in step, half the collectives can only hide behind a short
segment:

    compute  | a:C0 P1 | b:C0 P1 | a:R1 | b:R1 | a:C1 P2 | b:C1 P2 | ...
    comm             | AG a1   | AG b1 |RS a1 | RS b1   | AG a2   | ...
                       (AG a1 and RS b1: exposed)

A sequence-parallel run of three sub-batches or more is staggered (``MicroBatchRun.stagger``):
the odd sub-batches run a segment behind the even ones, so every collective has a long
segment of another sub-batch after it (four sub-batches):

    compute  | a:C P | b:R | c:C P | d:R | a:R | b:C P | c:R | d:C P | a:C P | ...
    launched       AG a  RS b  AG c    RS d  RS a  AG b    RS c  AG d

    (AG a is needed by a:R, four segments on, two of them long; likewise each.)

(``parallel.sub_batches`` defaults to four under sequence parallelism for this.)

Under autocast h crosses the all-gather in the compute dtype (:mod:`oases.parallel.wire`):
the region's linears cast it so anyway, and its gradient is reduce-scattered in it.

Recompute: ``fine`` keeps the block's input chunk x_j, the all-gathered h (the whole
sequence: the region needs it, and recompute never re-issues a forward collective) and
the reduce-scattered r_j; ``full`` keeps each layer's input chunk and re-issues both
collectives. The RNG states are replayed as without SP: the prologue and the region draw
from the state captured before the prologue, the combine from the one before it.

A pipeline stage's input and output, and their gradients, are this rank's chunks: the
cross-mesh transfer moves chunks (``CrossMeshTransfer(sharded=True)``). The last
stage's final norm runs on the chunk and the normed chunks are all-gathered before the
vocab-parallel head (the model's ``head_prologue``, ``loss_partial(entered=True)``).
"""

from __future__ import annotations

from typing import Optional

import torch

from oases.overlap.block_programs import drive, program_backward
from oases.overlap.runner import MicroBatchRun, Program, collect
from oases.overlap.state import BlockState, SubBatch
from oases.parallel.backprop import backward
from oases.parallel.engine import HEAD
from oases.parallel.region import GATHERED, entering
from oases.parallel.sequence import batch_major, seq_major
from oases.parallel.timing import label
from oases.parallel.wire import to_wire


def _region_input(prologue, x: torch.Tensor) -> torch.Tensor:
    """``prologue(x)`` as it crosses the all-gather: in the compute dtype under autocast,
    as :func:`~oases.parallel.sequence.seq_enter` sends it (the region's linears cast it
    so anyway), unless the prologue is the identity (the region reads the chunk in its
    own dtype). Cast inside the prologue's graph, so that the region input's gradient
    is reduce-scattered in the compute dtype too."""
    h = prologue(x)
    return to_wire(h) if h is not x else h


def gather_seq(x: torch.Tensor, group) -> Program:
    """The whole sequence from the chunks, through ``yield from`` (overlapped)."""
    (g,) = yield from collect([("ag", seq_major(x.detach()), group)])
    return batch_major(g)


class SequencePrograms:
    """The sequence-parallel segments of :class:`~oases.overlap.engines.OasesEngine`
    (mixed into it; ``self`` has its ``_enter``, ``recompute`` and ``_reduce_back``)."""

    # ---------------------------------------------------------------- forward
    def _sp_block(self, run: MicroBatchRun, i: int, x_in: torch.Tensor, keep: bool,
                  st: BlockState, name: str, replay: bool = False) -> Program:
        """Block i of a sub-batch, forward, from its input chunk (or token ids); returns
        its output chunk. ``keep``: its graph stays live (else what recompute needs is
        stashed, see the module docstring). ``replay``: a ``full`` recompute, drawing
        from the RNG states the forward captured in ``st``."""
        blk = run.blocks[i]
        grp = blk.tp_group
        fine = not keep and self.recompute == "fine"
        h = g = mid = None
        if x_in.is_floating_point():
            prologue, region = blk.around_gather_steps()
            with self._enter(i, i + 1, f"{name} P{i}"), torch.set_grad_enabled(keep), \
                    run.replay(st.rng_partial if replay else None), run.amp():
                h = _region_input(prologue, x_in)
                mid = run.snap() if replay else None  # the region draws on from here
            g = yield from gather_seq(h, grp)
            if fine:
                st.saved_g = run.stash(g, "all-gathered region input")
            g = g.detach().requires_grad_(keep)
            p = yield from drive(run, lambda: region(g),
                                 self._segment(run, i, f"{name} R{i}", keep, entering(GATHERED),
                                               st.later),
                                 replay=mid, cuts=st.later)
        else:  # token ids, whole on every rank: no all-gather (never recomputed)
            with self._enter(i, i + 1, f"{name} P{i}"), torch.set_grad_enabled(keep), run.amp():
                p = blk.partial(x_in)
        (r,) = yield from collect([("rs", seq_major(p.detach()), grp)])
        r = batch_major(r)
        if not keep:
            st.rng_combine = run.snap()
            if fine:
                st.saved_r = run.stash(r, "reduce-scattered partial sum")
        r = r.detach().requires_grad_(keep)
        with self._enter(i, span=f"{name} C{i}"), torch.set_grad_enabled(keep), \
                run.replay(st.rng_combine if replay else None), run.amp():
            out = blk.combine(x_in, r)
        if keep:
            st.x_in, st.h, st.g, st.p, st.r, st.out = x_in, h, g, p, r, out
        return out

    def _sp_loss(self, run: MicroBatchRun, sb: SubBatch, x: torch.Tensor) -> Program:
        """The head of the last stage: the final norm on the chunk, the all-gather of the
        normed chunks, the vocab-parallel loss and its all-reduce."""
        model = run.model
        x_last = x.detach().requires_grad_()
        with label(f"F{sb.name} loss"), run.amp():
            h = to_wire(model.head_prologue(x_last))  # read by the head's matmul only
        g = yield from gather_seq(h, model.tp_group)
        g = g.requires_grad_()
        with label(f"F{sb.name} loss"), run.amp(), entering(GATHERED):
            state, stats = model.loss_partial(g, sb.targets, entered=True)
        (stats,) = yield from collect([("ar", stats, model.tp_group)])
        with label(f"F{sb.name} loss"), run.amp():
            loss = model.loss_combine(state, stats)
        sb.head = (x_last, h, g, loss)
        sb.loss = loss.detach()

    # --------------------------------------------------------------- backward
    def _sp_loss_backward(self, run: MicroBatchRun, sb: SubBatch, scale: float,
                          prepare: Program) -> Program:
        """Backward of :meth:`_sp_loss`; returns the gradient of the last block's output."""
        x_last, h, g, loss = sb.head
        with self._enter(HEAD, span=f"B{sb.name} loss"):
            backward(loss, torch.ones_like(loss) * scale)
        yield from self._reduce_back([("rs", seq_major(g.grad), run.model.tp_group)], [h],
                                     prepare, HEAD, f"B{sb.name} head", batch_major)
        sb.head = None
        return x_last.grad

    def _sp_block_backward(self, run: MicroBatchRun, sb: SubBatch, i: int, grad: torch.Tensor,
                           prepare: Optional[Program]) -> Program:
        """Backward of block i from its output chunk's gradient; the input chunk's gradient
        (residual and prologue terms) is left in ``x_in.grad``."""
        st, grp = sb.blocks[i], run.blocks[i].tp_group
        with self._enter(i, i - 1 if i > 0 else None, f"B{sb.name} {i}"):
            backward(st.out, grad)
        (dp,) = yield from collect([("ag", seq_major(st.r.grad), grp)])
        with self._enter(i, span=f"B{sb.name} {i} region"):
            backward(st.p, batch_major(dp))
        yield from program_backward(run, st.later,
                                    lambda first: self._enter(i, span=f"B{sb.name} {i} ring"))
        # the region input's gradient reduce-scattered back to the prologue's output chunk
        into = st.h is not None and st.g.grad is not None
        yield from self._reduce_back([("rs", seq_major(st.g.grad), grp)] if into else [],
                                     [st.h], prepare, i, f"B{sb.name} {i} in", batch_major)

    # -------------------------------------------------------------- recompute
    def _sp_recompute_fine(self, run: MicroBatchRun, i: int, st: BlockState,
                           name: str) -> Program:
        """Block i again from the stash: no collective (a ring's exchanges, if any, again)."""
        blk = run.blocks[i]
        prologue, region = blk.around_gather_steps()
        x_in = st.saved_x.get(blk, i, self.recompute).detach().requires_grad_()
        g = st.saved_g.get(blk, i, self.recompute).detach().requires_grad_()
        r = st.saved_r.get(blk, i, self.recompute).detach().requires_grad_()
        with label(name), run.replay(st.rng_partial), torch.enable_grad(), run.amp():
            h = _region_input(prologue, x_in)
            mid = run.snap()  # the region draws on from here
        p = yield from drive(run, lambda: region(g),
                             self._segment(run, i, name, True, entering(GATHERED), st.later),
                             replay=mid, cuts=st.later)
        with label(name), run.replay(st.rng_combine), torch.enable_grad(), run.amp():
            st.out = blk.combine(x_in, r)
        st.x_in, st.h, st.g, st.p, st.r = x_in, h, g, p, r
        st.saved_x = st.saved_g = st.saved_r = None

    def _sp_recompute_group(self, run: MicroBatchRun, sbs: list, a: int, b: int,
                            name: str) -> Program:
        """Blocks a..b-1 again from the stashed input chunk, both collectives re-issued."""
        x = sbs[a].saved_x.get(run.blocks[a], a, self.recompute)
        for i in range(a, b):
            if i > a:  # a layer whose blocks differ in degree
                x = yield from self._to_degree(run.model, x, run.blocks[i - 1].degree,
                                               run.blocks[i].degree)
            x = yield from self._sp_block(run, i, x.detach().requires_grad_(), True, sbs[i],
                                          name, replay=True)
        sbs[a].saved_x = None
