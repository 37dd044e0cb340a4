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

**Kernels.** On CPU, and wherever a mask beyond the causal one is needed, each block is
plain matmul + softmax in fp32 that returns the lse, in tiles of ``MATH_ROWS`` query
rows (a tile's score matrix is materialised: (B, Hq, MATH_ROWS, Tk)). On CUDA without
documents the forward uses the fused kernel SDPA would pick that returns an lse (flash
in fp16/bf16, memory-efficient otherwise), with kv heads expanded for it; the backward
takes flash's backward kernel with the global out and lse (bf16/fp16), else the fp32
math above.

**Dropout** (``dropout`` > 0) multiplies each tile's probabilities by a keep mask drawn
from the current generator of the device (the caller's random stream) in a fixed order;
the lse stays the undropped one, so blocks merge exactly, and the backward draws the
same masks again from the forward's generator state. It takes the fp32 path everywhere.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist

from oases.parallel.comm import group_rank, group_size
from oases.parallel.cp_chunks import Block, block_plan, shard_sequence

# the fused CUDA forward (flash / memory-efficient kernels returning an lse); False
# keeps every device on the fp32 math path
FUSED_ON_CUDA = True
# query rows per tile of the fp32 math path (CPU, documents): a tile's score matrices
# are (B, H, MATH_ROWS, Tk) fp32, so the path's memory is linear in the block's keys
MATH_ROWS = 256


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


def _wait(works: list, clock=None) -> None:
    """Wait for ``works``; ``clock`` (an :class:`~oases.parallel.timing.IntervalTimer`)
    times the wait: the ring's exposed transfer time."""
    t0 = clock.start() if clock is not None and works else None
    for w in works:
        w.wait()
    if t0 is not None:
        clock.stop(t0)


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, T, D) -> (B, Hkv, Hq/Hkv, T, D): query head h reads kv head h // (Hq/Hkv),
    as ``repeat_interleave`` of the kv heads (and SDPA's ``enable_gqa``) pairs them."""
    B, hq, T, D = q.shape
    return q.view(B, hkv, hq // hkv, T, D)


def _block_mask(blk: Block, doc_q: Optional[torch.Tensor], doc_k: Optional[torch.Tensor],
                device) -> Optional[torch.Tensor]:
    """Bool (B or 1, 1, 1, Tq, Tk), True where a query may attend, or None (every pair)."""
    mask = None
    if blk.causal:
        tq, tk = blk.q.stop - blk.q.start, blk.k.stop - blk.k.start
        mask = torch.ones(tq, tk, dtype=torch.bool, device=device).tril()[None, None, None]
    if doc_q is not None:
        same = (doc_q[:, blk.q, None] == doc_k[:, None, blk.k])[:, None, None]
        mask = same if mask is None else mask & same
    return mask


def _row_tiles(n: int) -> list[slice]:
    """The query rows of a block in pieces of MATH_ROWS: the fp32 path's score
    matrices are (B, H, rows, Tk), so its memory grows with Tk, not Tq x Tk."""
    return [slice(a, min(a + MATH_ROWS, n)) for a in range(0, n, MATH_ROWS)]


def _keep(shape, p: float, device) -> torch.Tensor:
    """Attention dropout's scale of one tile: 0 where dropped, 1/(1-p) where kept, drawn
    from the current generator of ``device`` (the backward draws again from the same
    state, in the same order)."""
    return (torch.rand(shape, device=device) >= p).float().div_(1.0 - p)


def _math_forward(q, k, v, mask, scale: float, dropout: float = 0.0):
    """fp32 attention of q (B, Hq, Tq, D) over k, v (B, Hkv, Tk, D): (out (B, Hq, Tq, D),
    lse (B, Hq, Tq)); a row with no key allowed has lse -inf and out 0. Query rows go
    in tiles (:func:`_row_tiles`). ``dropout``: of the probabilities (the lse is of the
    undropped ones, so blocks still merge exactly)."""
    B, hq, tq, D = q.shape
    kt, vf = k.float().unsqueeze(2).transpose(-1, -2), v.float().unsqueeze(2)
    out = torch.empty(B, hq, tq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, hq, tq, dtype=torch.float32, device=q.device)
    for r in _row_tiles(tq):
        rows = r.stop - r.start
        s = _grouped(q[:, :, r].float(), k.shape[1]) @ kt * scale     # (B, Hkv, g, rows, Tk)
        if mask is not None:
            s = s.masked_fill(~mask[..., r, :], float("-inf"))
        lr = torch.logsumexp(s, dim=-1)                               # (B, Hkv, g, rows)
        pr = torch.exp(s - _finite(lr)[..., None])
        if dropout:
            pr = pr * _keep(pr.shape, dropout, q.device)
        out[:, :, r] = (pr @ vf).reshape(B, hq, rows, D)
        lse[:, :, r] = lr.reshape(B, hq, rows)
    return out, lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no key) as 0: exp(-inf - 0) = 0 where exp(-inf - -inf) is NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _fused_forward(q, k, v, causal: bool, scale: float):
    """The CUDA kernels' (out, lse), or None where neither takes the call."""
    r = q.shape[1] // k.shape[1]
    if r > 1:  # the kernels want equal head counts: expand locally, only kv heads travel
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, False)
    if torch.backends.cuda.can_use_flash_attention(params, False):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                 scale=scale)
        return res[0], res[1]
    if torch.backends.cuda.can_use_efficient_attention(params, False):
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :q.shape[2]]  # the kernel pads the lse rows to 32
    return None


def _attend(q, k, v, blk: Block, doc_q, doc_k, scale: float, dropout: float = 0.0):
    """One block's (out fp32, lse fp32) of the rows ``blk.q`` against keys ``blk.k``, or
    None when the documents leave no pair to compute."""
    q, k, v = q[:, :, blk.q], k[:, :, blk.k], v[:, :, blk.k]
    if q.is_cuda and FUSED_ON_CUDA and doc_q is None and not dropout:
        res = _fused_forward(q, k, v, blk.causal, scale)
        if res is not None:
            return res[0].float(), res[1].float()
    mask = _block_mask(blk, doc_q, doc_k, q.device)
    if mask is not None and doc_q is not None and not bool(mask.any()):
        return None
    return _math_forward(q, k, v, mask, scale, dropout)


def _merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, l_b: torch.Tensor,
           rows: slice) -> None:
    """Merge a block's (o_b, l_b) of query ``rows`` into the running (out, lse), in place."""
    o_a, l_a = out[:, :, rows], lse[:, :, rows]
    new = torch.logaddexp(l_a, l_b)
    base = _finite(new)
    o_a.mul_(torch.exp(l_a - base)[..., None]).add_(torch.exp(l_b - base)[..., None] * o_b)
    l_a.copy_(new)


def _rows_dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels take it: the ring's output (and its gradient) are laid out
    (B, T, H, D) behind a (B, H, T, D) view, which flash reads as it is; a copy only
    where the head dimension is strided."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _fused_grads(q, k, v, dout, out, lse, causal: bool, scale: float):
    """Flash's backward of one block given the *global* out and lse (so P = exp(s - lse)
    and rowsum(dO o) are the whole sequence's): fp32 (dq, dk, dv) with the kv heads'
    query groups summed, or None where flash does not take the call."""
    B, hq, tk, D = q.shape[0], q.shape[1], k.shape[2], q.shape[3]
    r = hq // k.shape[1]
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, causal, False)
    if not torch.backends.cuda.can_use_flash_attention(params, False):
        return None
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)    # no dropout: unread
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _rows_dense(dout), q, k, v, _rows_dense(out), lse.contiguous(), None, None,
        q.shape[2], tk, 0.0, causal, seed, offset, scale=scale)
    if r > 1:
        dk, dv = (g.view(B, hq // r, r, tk, D).sum(2, dtype=torch.float32) for g in (dk, dv))
    return dq.float(), dk.float(), dv.float()


def _block_grads(q, k, v, dout, lse, delta, blk: Block, doc_q, doc_k, scale: float,
                 out=None, dropout: float = 0.0):
    """fp32 (dq, dk, dv) of one block, from the global out/lse: dq for rows ``blk.q``,
    dk/dv for keys ``blk.k``; None when the documents leave nothing. ``out`` (the global
    output, in q's dtype; ``dout`` then too) lets CUDA take flash's backward."""
    if out is not None and q.is_cuda and FUSED_ON_CUDA and doc_q is None and not dropout:
        res = _fused_grads(q[:, :, blk.q], k[:, :, blk.k], v[:, :, blk.k], dout[:, :, blk.q],
                           out[:, :, blk.q], lse[:, :, blk.q], blk.causal, scale)
        if res is not None:
            return res
    dout = dout.float()
    mask = _block_mask(blk, doc_q, doc_k, q.device)
    if mask is not None and doc_q is not None and not bool(mask.any()):
        return None
    hkv = k.shape[1]
    qb, dob = q[:, :, blk.q], dout[:, :, blk.q]
    B, hq, tq, D = dob.shape
    kb = k[:, :, blk.k].float().unsqueeze(2)                          # (B, Hkv, 1, Tk, D)
    vb = v[:, :, blk.k].float().unsqueeze(2)
    dq = torch.empty(B, hq, tq, D, dtype=torch.float32, device=q.device)
    dk = torch.zeros(B, hkv, kb.shape[3], D, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for r in _row_tiles(tq):  # memory: (B, H, rows, Tk) per score matrix
        rows = r.stop - r.start
        qg = _grouped(qb[:, :, r].float(), hkv)                       # (B, Hkv, g, rows, D)
        dog = _grouped(dob[:, :, r], hkv)
        lse_g = lse[:, :, blk.q][:, :, r].reshape(B, hkv, hq // hkv, rows)
        delta_g = delta[:, :, blk.q][:, :, r].reshape(B, hkv, hq // hkv, rows)
        s = qg @ kb.transpose(-1, -2) * scale                         # (B, Hkv, g, rows, Tk)
        if mask is not None:
            s = s.masked_fill(~mask[..., r, :], float("-inf"))
        p = torch.exp(s - lse_g[..., None])
        dp = dog @ vb.transpose(-1, -2)
        if dropout:  # the forward's masks, drawn again: dV from the dropped P, dP dropped
            keep = _keep(p.shape, dropout, q.device)
            dv += ((p * keep).transpose(-1, -2) @ dog).sum(2)
            dp = dp * keep
        else:
            dv += (p.transpose(-1, -2) @ dog).sum(2)                  # (B, Hkv, Tk, D)
        ds = p * (dp - delta_g[..., None])
        dq[:, :, r] = (ds @ kb * scale).reshape(B, hq, rows, D)
        dk += (ds.transpose(-1, -2) @ qg).sum(2) * scale
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, group, causal, doc, scale, trace, overlap, clock, dropout):
        cp, rank = group_size(group), group_rank(group)
        # where the masks are drawn from: the backward draws them again from here
        rng = _rng_state(q.device) if dropout else None
        ring = _Ring(group, cp, rank) if cp > 1 else None
        Tl = q.shape[2]
        # laid out (B, Tl, Hq, D): the heads' merge after attention is then a view, and
        # the output projection keeps the tensor saved here rather than a copy of it
        B, hq, _, D = q.shape
        out = torch.zeros(B, Tl, hq, D, dtype=torch.float32, device=q.device).transpose(1, 2)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        doc_q = None if doc is None else shard_sequence(doc, cp, rank, dim=1)
        kv = torch.stack([k, v]).contiguous()          # one message: (2, B, Hkv, Tl, D)
        for s in range(cp):
            src = (rank - s) % cp
            works = []
            if s + 1 < cp:
                nxt = torch.empty_like(kv)
                works = ring.exchange(kv, nxt)
                _note(trace, "post_recv", s + 1)
                if not overlap:
                    _wait(works, clock)
                    _note(trace, "wait", s + 1)
            blk = block_plan(cp, rank, src, Tl, causal)
            doc_k = None if doc is None else shard_sequence(doc, cp, src, dim=1)
            _note(trace, "attend", s)
            res = _attend(q, kv[0], kv[1], blk, doc_q, doc_k, scale, dropout)
            if res is not None:
                _merge(out, lse, res[0], res[1], blk.q)
            if s + 1 < cp:
                if overlap:
                    _wait(works, clock)
                    _note(trace, "wait", s + 1)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, causal, doc, scale, trace, overlap, clock, dropout, rng)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, doc, scale, trace, overlap, clock, dropout, rng = ctx.args
        with _replayed(rng, q.device):
            return _ring_backward(dout, q, k, v, out, lse, group, causal, doc, scale, trace,
                                  overlap, clock, dropout)


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


def _ring_backward(dout, q, k, v, out, lse, group, causal, doc, scale, trace, overlap, clock,
                   dropout):
    """:meth:`_RingAttention.backward`'s ring, under the forward's generator state."""
    cp, rank = group_size(group), group_rank(group)
    ring = _Ring(group, cp, rank) if cp > 1 else None
    Tl = q.shape[2]
    dout = dout.to(q.dtype)
    delta = (dout.float() * out.float()).sum(-1)    # rowsum(dO o): (B, Hq, Tl)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    doc_q = None if doc is None else shard_sequence(doc, cp, rank, dim=1)
    kv = torch.stack([k, v]).contiguous()
    acc_works: list = []       # the accumulator of this step's block, from rank r-1
    acc_in = acc_out = None    # its receive buffer; what this rank sent on (kept alive)
    for s in range(cp):
        src = (rank - s) % cp
        kv_works = []
        if s + 1 < cp:
            nxt = torch.empty_like(kv)
            kv_works = ring.exchange(kv, nxt)
            _note(trace, "bwd_post_recv", s + 1)
            if not overlap:
                _wait(kv_works, clock)
                _note(trace, "bwd_wait", s + 1)
        blk = block_plan(cp, rank, src, Tl, causal)
        doc_k = None if doc is None else shard_sequence(doc, cp, src, dim=1)
        _note(trace, "bwd_attend", s)
        grads = _block_grads(q, kv[0], kv[1], dout, lse, delta, blk, doc_q, doc_k, scale,
                             out, dropout)
        mine = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        if grads is not None:
            dq[:, :, blk.q] += grads[0]
            mine[0][:, :, blk.k] = grads[1]
            mine[1][:, :, blk.k] = grads[2]
        if s > 0:
            _wait(acc_works, clock)
            _note(trace, "bwd_wait_dkv", s)
            mine += acc_in
        if ring is not None:
            # pass the accumulator on: at s = cp-1 that is the hop home
            acc_out, acc_in = mine, torch.empty_like(mine)
            acc_works = ring.exchange(acc_out, acc_in)
        else:
            acc_in = mine
        if s + 1 < cp:
            if overlap:
                _wait(kv_works, clock)
                _note(trace, "bwd_wait", s + 1)
            kv = nxt
    _wait(acc_works, clock)
    del acc_out
    dk, dv = acc_in[0].to(k.dtype), acc_in[1].to(v.dtype)
    return dq.to(q.dtype), dk, dv, None, None, None, None, None, None, None, None


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
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"ring attention: dropout={dropout} is not in [0, 1)")
    return _RingAttention.apply(q, k, v, group, causal, doc, scale, trace, overlap, clock,
                                dropout)
