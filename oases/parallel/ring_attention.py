"""Ring attention: exact attention over a sequence split across the ranks of a
context-parallel (cp) group, key/value blocks passed around the ring.

Each rank holds its head-tail tokens (:mod:`oases.parallel.cp_chunks`): queries, keys
and values of ``Tl = T / cp`` tokens. At step s = 0 .. cp-1 rank r holds the kv block
of rank ``src = (r - s) mod cp`` and computes its queries' attention against it: a
partial output ``o_s`` (normalised over that block) and its log-sum-exp ``l_s``. The
partials merge exactly, whatever their order, by

    l = log(exp(l_a) + exp(l_b)),   o = exp(l_a - l) o_a + exp(l_b - l) o_b

so after cp steps the output is softmax attention over the whole sequence. Only the
kv heads travel (GQA: each query head group reads its kv head locally), as one
(2, B, Hkv, Tl, D) message per step. Which parts of a block are computed under the
causal mask (full, diagonal, skipped) is :func:`oases.parallel.cp_chunks.block_plan`.

**Backward** (the standard ring backward): the rank recomputes each block's
probabilities from q, k, the block's keys and the saved *global* output and lse,
``P = exp(q k^T s - lse)``, ``dS = P (dO v^T - rowsum(dO o))``; dq accumulates
locally, and each block's dk/dv accumulator travels with it: rank r adds its share to
the accumulator of the block it holds and passes it on, so after the cp-th hop every
accumulator is home with every rank's share. Accumulators travel in fp32.

**Overlap.** The receive of the next kv block (and in backward, of the next dk/dv
accumulator) is posted before the current block's attention is computed and waited
only when the next step needs it, so the transfer runs behind the compute.
``overlap=False`` waits at once (the reference for measuring how much hides).

**Programs.** Both passes are programs (:mod:`oases.parallel.program`): where the next
step needs a transfer, they yield an :class:`~oases.parallel.program.Await`.
:func:`ring_attention` waits at once; the ``oases`` engine runs the attention as
:func:`ring_attention_steps`, so its sub-batch yields there and the other sub-batches
compute while the transfer completes. Under the engine's recorder
(:class:`~oases.parallel.program.ProgramCutRecorder`) the backward, whose waits are
yield points too, is handed to the engine as a
:class:`~oases.parallel.program.ProgramCut` instead of entering the autograd graph.
With ``overlap=False`` nothing yields: every transfer is waited when posted.
``trace`` (a list) records the order: ``("post_recv", s)`` when the receive of step s's
block is posted, ``("attend", s)`` when step s's attention starts, ``("wait", s)`` when
step s's block is waited for; backward records ``("bwd_post_recv", s)``,
``("bwd_attend", s)``, ``("bwd_wait", s)``, and ``("bwd_wait_dkv", s)`` when the
accumulator of step s's block has arrived.

**NCCL's rules.** Every exchange is one ``batch_isend_irecv`` of [send to r+1, receive
from r-1] on the cp group, and every rank issues the same sequence of exchanges
(forward: kv of steps 1 .. cp-1; backward: kv of step s+1 then the accumulator of step
s, for each s, the last accumulator going home), so the n-th batch of each rank meets
the n-th batch of both neighbours on the group's one stream.

**Document masks.** ``doc`` is the (B, T) document number of every token of the whole
sequence, on every rank (:attr:`oases.models.documents.Documents.doc`). A rank slices
the ids of the block it holds at each step from it rather than ring them along: they
are one integer per token against the 2 Hkv D values of k and v, every rank has the
whole row from the data loader anyway, and no second message per step has to be
ordered on the group. A query attends a key of its own document only (and causally).

**Kernels and dropout:** :mod:`oases.parallel.ring_kernels`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from oases.parallel.comm import group_rank, group_size
from oases.parallel.cp_chunks import block_plan, shard_sequence
from oases.parallel.program import Await, ProgramCut, Steps, finish, recording_cuts
from oases.parallel.ring_kernels import attend, block_grads, merge


class _Ring:
    """The cp group's ring: this rank sends to the next and receives from the previous."""

    def __init__(self, group, cp: int, rank: int) -> None:
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % cp)
        self.prev = dist.get_global_rank(group, (rank - 1) % cp)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor) -> list:
        """Post [send ``send`` to next, receive ``recv`` from prev] as one batch: the same
        order on every rank, so NCCL pairs each rank's batch with its neighbours'."""
        # dist.isend/irecv looked up per call: tests swap them for NCCL's semantics
        ops = [dist.P2POp(dist.isend, send, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return dist.batch_isend_irecv(ops)


class RingArgs(NamedTuple):
    """What both passes of one ring attention take beside the tensors."""
    group: object
    causal: bool
    doc: Optional[torch.Tensor]
    scale: float
    trace: Optional[list]
    overlap: bool
    clock: object
    dropout: float


def _forward_steps(q, k, v, a: RingArgs) -> Steps:
    """The ring's forward (q, k, v detached): returns (out in q's dtype, lse fp32, the
    generator state the dropout masks were drawn from, or None)."""
    cp, rank = group_size(a.group), group_rank(a.group)
    # where the masks are drawn from: the backward draws them again from here
    rng = _rng_state(q.device) if a.dropout else None
    ring = _Ring(a.group, cp, rank) if cp > 1 else None
    Tl = q.shape[2]
    # laid out (B, Tl, Hq, D): the heads' merge after attention is then a view, and
    # the output projection keeps the tensor saved here rather than a copy of it
    B, hq, _, D = q.shape
    out = torch.zeros(B, Tl, hq, D, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    doc_q = None if a.doc is None else shard_sequence(a.doc, cp, rank, dim=1)
    kv = torch.stack([k, v]).contiguous()          # one message: (2, B, Hkv, Tl, D)
    for s in range(cp):
        src = (rank - s) % cp
        works = []
        if s + 1 < cp:
            nxt = torch.empty_like(kv)
            works = ring.exchange(kv, nxt)
            _note(a.trace, "post_recv", s + 1)
            if not a.overlap:
                Await(works, a.clock).wait()
                _note(a.trace, "wait", s + 1)
        blk = block_plan(cp, rank, src, Tl, a.causal)
        doc_k = None if a.doc is None else shard_sequence(a.doc, cp, src, dim=1)
        _note(a.trace, "attend", s)
        res = attend(q, kv[0], kv[1], blk, doc_q, doc_k, a.scale, a.dropout)
        if res is not None:
            merge(out, lse, res[0], res[1], blk.q)
        if s + 1 < cp:
            if a.overlap:
                yield Await(works, a.clock)
                _note(a.trace, "wait", s + 1)
            kv = nxt
    return out.to(q.dtype), lse, rng


class _RingAttention(torch.autograd.Function):
    """The ring's output in the autograd graph, its forward already run
    (:func:`_forward_steps`); the backward runs the ring's, waiting at once."""

    @staticmethod
    def forward(ctx, q, k, v, result, a):
        out, lse, rng = result
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args, ctx.rng = a, rng
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = finish(_backward_steps(dout, q, k, v, out, lse, ctx.args, ctx.rng))
        return dq, dk, dv, None, None


def _rng_state(device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


@contextlib.contextmanager
def _replayed(state: Optional[torch.Tensor], device):
    """Run with ``device``'s generator at ``state`` (None: as it is), then put it back:
    the backward's draws leave every stream where it was."""
    if state is None:
        yield
        return
    outer = _rng_state(device)
    _set_rng(state, device)
    try:
        yield
    finally:
        _set_rng(outer, device)


def _set_rng(state: torch.Tensor, device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _backward_steps(dout, q, k, v, out, lse, a: RingArgs, rng) -> Steps:
    """The ring's backward under the forward's generator state (a program); returns
    (dq, dk, dv)."""
    with _replayed(rng, q.device):  # across yields: the runner keeps streams per sub-batch
        return (yield from _ring_backward(dout, q, k, v, out, lse, a))


def _ring_backward(dout, q, k, v, out, lse, a: RingArgs) -> Steps:
    cp, rank = group_size(a.group), group_rank(a.group)
    ring = _Ring(a.group, cp, rank) if cp > 1 else None
    Tl = q.shape[2]
    dout = dout.to(q.dtype)
    delta = (dout.float() * out.float()).sum(-1)    # rowsum(dO o): (B, Hq, Tl)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    doc_q = None if a.doc is None else shard_sequence(a.doc, cp, rank, dim=1)
    kv = torch.stack([k, v]).contiguous()
    acc_works: list = []       # the accumulator of this step's block, from rank r-1
    acc_in = acc_out = None    # its receive buffer; what this rank sent on (kept alive)
    for s in range(cp):
        src = (rank - s) % cp
        kv_works = []
        if s + 1 < cp:
            nxt = torch.empty_like(kv)
            kv_works = ring.exchange(kv, nxt)
            _note(a.trace, "bwd_post_recv", s + 1)
            if not a.overlap:
                Await(kv_works, a.clock).wait()
                _note(a.trace, "bwd_wait", s + 1)
        blk = block_plan(cp, rank, src, Tl, a.causal)
        doc_k = None if a.doc is None else shard_sequence(a.doc, cp, src, dim=1)
        _note(a.trace, "bwd_attend", s)
        grads = block_grads(q, kv[0], kv[1], dout, lse, delta, blk, doc_q, doc_k, a.scale,
                            out, a.dropout)
        mine = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        if grads is not None:
            dq[:, :, blk.q] += grads[0]
            mine[0][:, :, blk.k] = grads[1]
            mine[1][:, :, blk.k] = grads[2]
        if s > 0:
            yield from _await(acc_works, a)
            _note(a.trace, "bwd_wait_dkv", s)
            mine += acc_in
        if ring is not None:
            # pass the accumulator on: at s = cp-1 that is the hop home
            acc_out, acc_in = mine, torch.empty_like(mine)
            acc_works = ring.exchange(acc_out, acc_in)
        else:
            acc_in = mine
        if s + 1 < cp:
            if a.overlap:
                yield Await(kv_works, a.clock)
                _note(a.trace, "bwd_wait", s + 1)
            kv = nxt
    yield from _await(acc_works, a)
    del acc_out
    return dq.to(q.dtype), acc_in[0].to(k.dtype), acc_in[1].to(v.dtype)


def _await(works: list, a: RingArgs) -> Steps:
    """Wait for ``works``: a yield point where the ring overlaps, else at once."""
    if not works:
        return
    if a.overlap:
        yield Await(works, a.clock)
    else:
        Await(works, a.clock).wait()


def _note(trace: Optional[list], what: str, step: int) -> None:
    if trace is not None:
        trace.append((what, step))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                   causal: bool = True, doc: Optional[torch.Tensor] = None,
                   scale: Optional[float] = None, trace: Optional[list] = None,
                   overlap: bool = True, clock=None, dropout: float = 0.0) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence held by the cp ``group``.

    q (B, Hq, Tl, D); k, v (B, Hkv, Tl, D) with Hkv dividing Hq; Tl: this rank's tokens,
    its two head-tail chunks (:func:`oases.parallel.cp_chunks.shard_sequence`), with
    positions already applied at their global values. ``doc``: (B, T = cp Tl) document
    numbers of the whole sequence, the same on every rank (None: one document).
    ``scale``: of the scores, 1/sqrt(D) by default. ``group`` None: one rank. Returns
    (B, Hq, Tl, D) in q's dtype; see the module doc for ``trace`` and ``overlap``.
    ``clock``: an :class:`~oases.parallel.timing.IntervalTimer` that every wait for a
    transfer adds to (the exposed ring time; None: untimed). ``dropout``: attention
    dropout of the probabilities, drawn from the current generator of q's device (run it
    under the caller's random stream); the backward draws the same masks again from the
    forward's generator state, so a recompute that replays the stream replays them."""
    return finish(ring_attention_steps(q, k, v, group, causal=causal, doc=doc, scale=scale,
                                       trace=trace, overlap=overlap, clock=clock,
                                       dropout=dropout))


def ring_attention_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                         causal: bool = True, doc: Optional[torch.Tensor] = None,
                         scale: Optional[float] = None, trace: Optional[list] = None,
                         overlap: bool = True, clock=None, dropout: float = 0.0) -> Steps:
    """:func:`ring_attention` as a program: it yields an
    :class:`~oases.parallel.program.Await` wherever the next step needs a transfer.
    Under a :class:`~oases.parallel.program.ProgramCutRecorder` (the ``oases`` engine)
    with gradients on, its output is a leaf and its backward a recorded
    :class:`~oases.parallel.program.ProgramCut`; else autograd runs the backward."""
    cp = group_size(group)
    B, hq, Tl, D = q.shape
    if k.shape != v.shape or k.dim() != 4 or (k.shape[0], k.shape[2:]) != (B, (Tl, D)):
        raise ValueError(f"ring attention: q {tuple(q.shape)} and k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} must be (B, H, Tl, D) with the same B, Tl, D")
    if hq % k.shape[1]:
        raise ValueError(f"ring attention: {k.shape[1]} kv heads do not divide {hq} query "
                         f"heads")
    if cp > 1 and Tl % 2:
        raise ValueError(f"ring attention: {Tl} local tokens are not two equal head-tail "
                         f"chunks")
    if doc is not None and tuple(doc.shape) != (B, cp * Tl):
        raise ValueError(f"ring attention: documents of shape {tuple(doc.shape)}, expected "
                         f"the whole sequence's ({B}, {cp * Tl}) = (B, cp * Tl) at cp={cp}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"ring attention: dropout={dropout} is not in [0, 1)")
    a = RingArgs(group, causal, doc, 1.0 / math.sqrt(D) if scale is None else scale, trace,
                 overlap, clock, dropout)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse, rng = yield from _forward_steps(qd, kd, vd, a)
    cuts = recording_cuts()
    if cuts is None or not torch.is_grad_enabled() or not any(
            t.requires_grad for t in (q, k, v)):
        return _RingAttention.apply(q, k, v, (out, lse, rng), a)
    leaf = out.detach().requires_grad_()
    cuts.append(ProgramCut(leaf, (q, k, v), functools.partial(
        _backward_steps, q=qd, k=kd, v=vd, out=out, lse=lse, a=a, rng=rng), held=(out, lse)))
    # a view: autocast caches the casts of leaves that require grad (the weights'), and
    # the engine may hold its cache for a whole run
    return leaf.view_as(leaf)
