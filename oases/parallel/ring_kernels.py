"""The kernels of ring attention (:mod:`oases.parallel.ring_attention`): one key/value
block's attention with its log-sum-exp, the merge of two blocks' partial results, and
one block's gradients from the whole sequence's output and log-sum-exp.

**Kernels.** Without documents or dropout a block takes a fused kernel that returns its
lse, with kv heads expanded for it: on CUDA the one SDPA would pick (flash in
fp16/bf16, memory-efficient otherwise), on CPU torch's CPU flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``). The backward takes flash's backward
kernel with the global out and lse: CUDA's in bf16/fp16, the CPU's in every dtype. Else,
and wherever a mask beyond the causal one is needed (documents), each block is plain
matmul + softmax in fp32 that returns the lse, in tiles of ``MATH_ROWS`` query rows (a
tile's score matrix is materialised: (B, Hq, MATH_ROWS, Tk)).

**Dropout** (``dropout`` > 0) multiplies each tile's probabilities by a keep mask drawn
from the current generator of the device (the caller's random stream) in a fixed order;
the lse stays the undropped one, so blocks merge exactly, and the backward draws the
same masks again from the forward's generator state. It takes the fp32 path everywhere.
"""

from __future__ import annotations

from typing import Optional

import torch

from oases.parallel.cp_chunks import Block

# the fused CUDA forward (flash / memory-efficient kernels returning an lse); False
# keeps CUDA on the fp32 math path
FUSED_ON_CUDA = True
# torch's CPU flash kernel, forward (returns the lse) and backward (takes it); False keeps
# the CPU on the fp32 math path
FUSED_ON_CPU = True
# query rows per tile of the fp32 math path (documents, dropout): a tile's score matrices
# are (B, H, MATH_ROWS, Tk) fp32, so the path's memory is linear in the block's keys
MATH_ROWS = 256


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
    q, k, v = _expanded(q, k, v)
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


def _expanded(q, k, v):
    """k and v with each kv head repeated for its query heads (the fused kernels want
    equal head counts: expanded locally, only kv heads travel), all three contiguous."""
    r = q.shape[1] // k.shape[1]
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    return q.contiguous(), k.contiguous(), v.contiguous()


def _fused(q: torch.Tensor, doc_q, dropout: float) -> bool:
    """Whether a fused kernel may take the block: no documents, no dropout, and the
    device's kernels switched on."""
    if doc_q is not None or dropout:
        return False
    return FUSED_ON_CUDA if q.is_cuda else q.device.type == "cpu" and FUSED_ON_CPU


def _cpu_forward(q, k, v, causal: bool, scale: float):
    """torch's CPU flash kernel: (out, lse)."""
    q, k, v = _expanded(q, k, v)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                      scale=scale)


def _cpu_grads(q, k, v, dout, out, lse, causal: bool, scale: float):
    """torch's CPU flash backward of one block given the *global* out and lse, as
    :func:`_fused_grads` on CUDA: fp32 (dq, dk, dv), the kv heads' query groups summed."""
    B, hq, tk, D = q.shape[0], q.shape[1], k.shape[2], q.shape[3]
    r = hq // k.shape[1]
    q, k, v = _expanded(q, k, v)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal,
        scale=scale)
    if r > 1:
        dk, dv = (g.view(B, hq // r, r, tk, D).sum(2, dtype=torch.float32) for g in (dk, dv))
    return dq.float(), dk.float(), dv.float()


def attend(q, k, v, blk: Block, doc_q, doc_k, scale: float, dropout: float = 0.0):
    """One block's (out fp32, lse fp32) of the rows ``blk.q`` against keys ``blk.k``, or
    None when the documents leave no pair to compute."""
    q, k, v = q[:, :, blk.q], k[:, :, blk.k], v[:, :, blk.k]
    if _fused(q, doc_q, dropout):
        res = (_fused_forward if q.is_cuda else _cpu_forward)(q, k, v, blk.causal, scale)
        if res is not None:
            return res[0].float(), res[1].float()
    mask = _block_mask(blk, doc_q, doc_k, q.device)
    if mask is not None and doc_q is not None and not bool(mask.any()):
        return None
    return _math_forward(q, k, v, mask, scale, dropout)


def merge(out: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, l_b: torch.Tensor,
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
    q, k, v = _expanded(q, k, v)
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


def block_grads(q, k, v, dout, lse, delta, blk: Block, doc_q, doc_k, scale: float,
                 out=None, dropout: float = 0.0):
    """fp32 (dq, dk, dv) of one block, from the global out/lse: dq for rows ``blk.q``,
    dk/dv for keys ``blk.k``; None when the documents leave nothing. ``out`` (the global
    output, in q's dtype; ``dout`` then too) lets the fused backward take the block."""
    if out is not None and _fused(q, doc_q, dropout):
        res = (_fused_grads if q.is_cuda else _cpu_grads)(
            q[:, :, blk.q], k[:, :, blk.k], v[:, :, blk.k], dout[:, :, blk.q],
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

