"""Ring attention (oases/parallel/ring_attention.py) and head-tail chunks
(oases/parallel/cp_chunks.py).

Parity: on gloo with NCCL's point-to-point semantics (tests/support/nccl_semantics.py,
so a ring that would hang on GPUs raises instead), every rank's output and q/k/v
gradients equal its head-tail shard of single-process attention over the whole
sequence (F.scaled_dot_product_attention), at cp=2 (two cp groups interleaved in a
world of 4, so group ranks differ from global ones) and cp=4: MHA and GQA, causal and
not, with documents that cross chunk boundaries. Without documents a block takes torch's
CPU flash kernel (forward with its lse, backward from the global output and lse); the
query-tile test takes the fp32 math path for every case.

Tolerance: fp32 on both sides, but in another order: the ring sums each query's keys
block by block and merges the blocks by log-sum-exp, and dk/dv sum the ranks' shares
around the ring. Every value is a sum of at most T = 64 terms of magnitude about
max|ref|, so two summation orders differ by at most about T * 6e-8 (fp32's unit
roundoff) = 3.8e-6 of max|ref| (sqrt(T) * 6e-8 = 5e-7 for random rounding). The
largest seen is 9.8e-7 of it (dk at cp=4, MHA, causal); we allow 4e-6. Dropping the
log-sum-exp rescale of the merge, or the received accumulator of dk/dv, gives errors
of order 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from oases.models.rope import Rotary
from oases.parallel.cp_chunks import (block_plan, chunk_ids, global_positions,
                                      shard_sequence, unshard_sequence)
from oases.parallel import ring_kernels
from oases.parallel.ring_attention import ring_attention
from tests.support.distributed import run_distributed

REL_TOL = 4e-6   # of max|reference|: see the module doc
B, D, CHUNK = 2, 8, 8    # a sequence of 2 cp CHUNK tokens

# (query heads, kv heads, documents, causal)
CASES = [(4, 4, False, True), (4, 2, False, True), (4, 2, True, True), (4, 4, True, True),
         (4, 2, False, False), (4, 2, True, False)]


def _inputs(cp: int, hq: int, hkv: int, docs: bool, device="cpu", dtype=torch.float32):
    """q, k, v, an output weight and the documents of the whole sequence (the same on
    every rank: one seed). Documents start at random tokens (about one in six), so they
    cross chunk and rank boundaries."""
    T = 2 * cp * CHUNK
    g = torch.Generator().manual_seed(1000 * cp + 10 * hkv + docs)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (hq, hkv, hkv))
    w = torch.randn(B, hq, T, D, generator=g)
    doc = torch.cumsum((torch.rand(B, T, generator=g) < 0.17).long(), dim=1) if docs else None
    if docs:   # several documents per row, and some of them span a chunk boundary
        inner = torch.arange(CHUNK, T, CHUNK)
        assert int(doc[:, -1].min()) >= 3
        assert bool((doc[:, inner] == doc[:, inner - 1]).any())
    move = (lambda t: t.to(device, dtype))
    return (*map(move, (q, k, v, w)), None if doc is None else doc.to(device))


def _reference(q, k, v, w, doc, causal: bool):
    """Whole-sequence attention: (out, dq, dk, dv) of the loss sum(out * w)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if doc is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    else:
        T = doc.shape[1]
        mask = doc[:, :, None] == doc[:, None, :]
        if causal:
            mask = mask & torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _check_case(group, cp: int, rank: int, case, device="cpu", rel_tol=REL_TOL):
    hq, hkv, docs, causal = case
    # one rank (cp 1) holds a two-rank sequence whole: documents enough to cross chunks
    q, k, v, w, doc = _inputs(max(cp, 2), hq, hkv, docs, device)
    ref = _reference(q, k, v, w, doc, causal)
    ql, kl, vl = (shard_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, group, causal=causal, doc=doc)
    (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref):
        want = shard_sequence(want, cp, rank, dim=2)
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= rel_tol * scale, (f"cp={cp} rank {rank} case (hq, hkv, docs, causal)="
                                        f"{case}: {name} off by {err:.2e} (max|ref| {scale:.2f})")


def _parity_body(rank: int, cp: int, device: str = "cpu", rel_tol: float = REL_TOL,
                 rows: int = 0):
    if rows:  # the fp32 path's query tiles (ring_kernels.MATH_ROWS), every case on it
        ring_kernels.MATH_ROWS = rows
        ring_kernels.FUSED_ON_CPU = False
    # fp32 matmuls, whatever an in-process training run set before the fork (TF32)
    torch.set_float32_matmul_precision("highest")
    world = dist.get_world_size()
    # cp groups of interleaved ranks ({0, 2}, {1, 3} in a world of 4): ring peers are
    # group ranks translated to global ones
    groups = [dist.new_group(list(range(i, world, world // cp))) for i in range(world // cp)]
    group = groups[rank % (world // cp)]
    for case in CASES:
        _check_case(group, cp, dist.get_rank(group), case, device, rel_tol)


@pytest.mark.parametrize("cp,world", [(2, 4), (4, 4)])
def test_ring_matches_whole_sequence_attention(cp, world):
    run_distributed(_parity_body, world=world, tp=None, args=(cp,))


def test_ring_in_query_tiles_matches_whole_sequence_attention():
    # the fp32 math path for every case (elsewhere it takes those with documents; the
    # others take torch's CPU flash kernel) in tiles of 5 rows: several per block, the
    # last one short, a causal mask cut across them
    run_distributed(_parity_body, world=2, tp=None, args=(2, "cpu", REL_TOL, 5))


def _plain_gloo_body(rank: int):
    _check_case(dist.group.WORLD, 2, rank, (4, 2, True, True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("rows", [0, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2)])
def test_ring_dropout_is_attention_dropout_with_the_masks_it_drew(hq, hkv, rows, device,
                                                                  monkeypatch):
    """One rank (the ring's causal block; the merge across ranks is the dropout-free
    one, tested above, as the lse is of the undropped probabilities). The reference is
    softmax attention whose probabilities are multiplied by the keep masks drawn from
    the same generator state in the ring's order (one draw per tile of query rows, rows
    0 = one tile), through plain autograd in float64: the output and q, k, v gradients
    agree to fp32 (1e-5 of max|ref|), and a second call from the same state is equal."""
    if rows:
        monkeypatch.setattr(ring_kernels, "MATH_ROWS", rows)
    p, T, B, D = 0.3, 16, 2, 8
    g = torch.Generator().manual_seed(3)
    q, k, v, w = (torch.randn(B, h, T, D, generator=g).to(device) for h in (hq, hkv, hkv, hq))
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    torch.manual_seed(11)
    out = ring_attention(ql, kl, vl, None, causal=True, dropout=p)
    (out * w).sum().backward()
    torch.manual_seed(11)
    assert torch.equal(ring_attention(q, k, v, None, causal=True, dropout=p), out.detach())
    torch.manual_seed(11)
    step = rows or T
    keep = torch.cat([torch.rand(B, hkv, hq // hkv, min(step, T - a), T, device=device) >= p
                      for a in range(0, T, step)], dim=3).reshape(B, hq, T, T)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    r = hq // hkv
    s = qd @ kd.repeat_interleave(r, 1).transpose(-1, -2) / D ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=device).tril(), float("-inf"))
    ref = (s.softmax(-1) * keep / (1 - p)) @ vd.repeat_interleave(r, 1)
    (ref * w.double()).sum().backward()
    for name, got, want in (("out", out, ref), ("dq", ql.grad, qd.grad), ("dk", kl.grad, kd.grad),
                            ("dv", vl.grad, vd.grad)):
        err, scale = (got.double() - want).abs().max().item(), want.abs().max().item()
        assert err <= 1e-5 * scale, f"{name} off by {err:.2e} (max|ref| {scale:.2f})"


def test_ring_runs_on_plain_gloo():
    """Without the NCCL emulation: gloo's own batch_isend_irecv (CPU training)."""
    run_distributed(_plain_gloo_body, world=2, tp=None, nccl_p2p=False)


@pytest.mark.cuda
def test_ring_on_one_gpu_matches_whole_sequence_attention():
    """One rank on GPU 0: the CUDA kernels of a ring step (the fused forward that returns
    an lse, the fp32 backward) against SDPA, every case. Gloo cannot carry CUDA tensors
    point to point ("writev: Bad address"), so the ring's transfers on CUDA need NCCL and
    two GPUs (below). The fused kernels' exp and accumulation order are not the math
    path's: 1e-5 of max|ref| (measured on an H200: within it)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for case in CASES:
            _check_case(None, 1, 0, case, "cuda", 1e-5)
    finally:
        torch.set_float32_matmul_precision(precision)


@pytest.mark.cuda
@pytest.mark.parametrize("hq,hkv,causal", [(4, 4, True), (4, 2, True), (4, 2, False)])
def test_ring_in_bf16_takes_flash_both_ways_on_one_gpu(hq, hkv, causal):
    """bf16 on one GPU: flash's forward and flash's backward fed the global output and
    lse (the op is seen in the profile). Against SDPA in fp32 the ring's error is at most
    twice SDPA's own in bf16 (both run flash's kernels; on an H200 at 4k-32k tokens the
    ring's was 0.7-1.2 times SDPA's)."""
    from torch.profiler import profile

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, hq, 256, 64, device="cuda", generator=g)
    k, v = (torch.randn(2, hkv, 256, 64, device="cuda", generator=g) for _ in range(2))
    w = torch.randn(2, hq, 256, 64, device="cuda", generator=g)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ref = _reference(q, k, v, w, None, causal)
    finally:
        torch.set_float32_matmul_precision(precision)
    lo = [t.to(torch.bfloat16) for t in (q, k, v)]
    sdpa = _reference(*lo, w.to(torch.bfloat16), None, causal)
    ql, kl, vl = (t.detach().clone().requires_grad_() for t in lo)
    with profile() as prof:
        out = ring_attention(ql, kl, vl, None, causal=causal)
        (out * w.to(torch.bfloat16)).sum().backward()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_backward" in ops, sorted(ops)[:40]
    for name, got, want, base in zip(("out", "dq", "dk", "dv"),
                                     (out, ql.grad, kl.grad, vl.grad), ref, sdpa):
        err = (got.float() - want).abs().max().item()
        own = (base.float() - want).abs().max().item()
        assert err <= 2 * own, f"{name}: ring off by {err:.2e}, SDPA bf16 by {own:.2e}"


@pytest.mark.cuda(gpus=2)
def test_ring_on_two_gpus_matches_whole_sequence_attention():
    run_distributed(_parity_body, world=2, tp=None, args=(2, "cuda", 1e-5), device="cuda")


def _ordering_body(rank: int):
    cp = dist.get_world_size()
    q, k, v, w, _ = _inputs(cp, 4, 2, False)
    ql, kl, vl = (shard_sequence(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v))
    trace: list = []
    # the ring's batches as issued, in the same list as its attention steps: the trace's
    # "post_recv" must follow a real batch, not just the ring's word for it
    real = dist.batch_isend_irecv

    def recording(ops):
        kinds = [op.op.__name__.lstrip("_") for op in ops]
        assert kinds == ["isend", "irecv"], kinds   # one order on every rank
        trace.append(("batch", tuple(ops[1].tensor.shape)))
        return real(ops)

    dist.batch_isend_irecv = recording
    try:
        out = ring_attention(ql, kl, vl, dist.group.WORLD, trace=trace)
        forward = list(trace)
        trace.clear()
        (out * shard_sequence(w, cp, rank, dim=2)).sum().backward()
        backward = list(trace)
        trace.clear()
        ring_attention(ql, kl, vl, dist.group.WORLD, trace=trace, overlap=False)
        serial = list(trace)
    finally:
        dist.batch_isend_irecv = real
    kv = ("batch", (2, B, 2, 2 * CHUNK, D))
    want = []
    for s in range(cp - 1):
        want += [kv, ("post_recv", s + 1), ("attend", s), ("wait", s + 1)]
    assert forward == want + [("attend", cp - 1)], forward
    # backward: the next kv block and this block's dk/dv accumulator are both in flight
    # while the block's gradients are computed; the accumulator goes on after them
    want = [kv, ("bwd_post_recv", 1), ("bwd_attend", 0), kv, ("bwd_wait", 1)]
    for s in range(1, cp - 1):
        want += [kv, ("bwd_post_recv", s + 1), ("bwd_attend", s), ("bwd_wait_dkv", s), kv,
                 ("bwd_wait", s + 1)]
    want += [("bwd_attend", cp - 1), ("bwd_wait_dkv", cp - 1), kv]
    assert backward == want, backward
    want = []   # overlap=False: each block waited for before the attention it overlapped
    for s in range(cp - 1):
        want += [kv, ("post_recv", s + 1), ("wait", s + 1), ("attend", s)]
    assert serial == want + [("attend", cp - 1)], serial


def test_next_block_is_received_before_the_current_block_is_attended():
    run_distributed(_ordering_body, world=4, tp=None)


# --------------------------------------------------------------------------- one process

@pytest.mark.parametrize("hkv,causal", [(2, True), (4, False)])
def test_one_rank_is_plain_attention(hkv, causal):
    q, k, v, w, _ = _inputs(1, 4, hkv, False)
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, None, causal=causal)
    (out * w).sum().backward()
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad),
                               _reference(q, k, v, w, None, causal)):
        assert (got - want).abs().max() <= REL_TOL * want.abs().max(), name


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_unshard_round_trip(cp):
    x = torch.arange(3 * 2 * cp * 5 * 2).view(3, 2 * cp * 5, 2)
    parts = [shard_sequence(x, cp, r, dim=1) for r in range(cp)]
    assert all(p.shape == (3, 10, 2) for p in parts)
    assert torch.equal(unshard_sequence(parts, cp, dim=1), x)
    # rank r holds chunks r and 2cp-1-r: together every token once
    held = torch.cat([p[0, :, 0] for p in parts]).sort().values
    assert torch.equal(held, x[0, :, 0])


def test_chunks_and_positions():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert global_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert global_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        for r in range(cp):
            want = shard_sequence(torch.arange(24 * cp)[None], cp, r, dim=1)[0]
            assert torch.equal(global_positions(24 * cp, cp, r), want)
    with pytest.raises(ValueError, match="multiple of 4"):
        shard_sequence(torch.zeros(1, 10), 2, 0)
    with pytest.raises(ValueError, match="rank 2 is not one of cp=2"):
        chunk_ids(2, 2)


def test_rope_at_global_positions_is_the_shard_of_the_whole():
    cp, T, hd = 4, 32, 8
    rot = Rotary(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd), T)
    q, k = torch.randn(2, 3, T, hd), torch.randn(2, 1, T, hd)
    whole_q, whole_k = rot(q, k)
    for r in range(cp):
        pos = global_positions(T, cp, r).expand(2, -1)
        got_q, got_k = rot(shard_sequence(q, cp, r, 2), shard_sequence(k, cp, r, 2), pos)
        assert torch.equal(got_q, shard_sequence(whole_q, cp, r, 2))
        assert torch.equal(got_k, shard_sequence(whole_k, cp, r, 2))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_block_plan_computes_each_causal_pair_once(cp):
    """Over a rank's cp steps, the blocks cover exactly its (query, key) pairs with
    key <= query, once each, and every step off the diagonal computes half a block."""
    T = 2 * cp * 3
    Tl = T // cp
    for rank in range(cp):
        qpos = global_positions(T, cp, rank).tolist()
        seen = []
        for src in range(cp):
            kpos = global_positions(T, cp, src).tolist()
            blk = block_plan(cp, rank, src, Tl, causal=True)
            area = (blk.q.stop - blk.q.start) * (blk.k.stop - blk.k.start)
            assert area == (Tl * Tl if src == rank else Tl * Tl // 2), (rank, src, blk)
            assert blk.causal == (src == rank)
            for i in range(blk.q.start, blk.q.stop):
                for j in range(blk.k.start, blk.k.stop):
                    if not blk.causal or j <= i:
                        seen.append((qpos[i], kpos[j]))
        want = sorted((a, b) for a in qpos for b in range(T) if b <= a)
        assert sorted(seen) == want, rank   # no pair missed, none above, none twice


def test_errors_name_the_values():
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(ValueError, match="3 kv heads do not divide 4"):
        ring_attention(q, torch.zeros(1, 3, 6, 8), torch.zeros(1, 3, 6, 8), None)
    with pytest.raises(ValueError, match=r"documents of shape \(1, 5\).*\(1, 6\)"):
        ring_attention(q, q, q, None, doc=torch.zeros(1, 5, dtype=torch.long))
