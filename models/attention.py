"""The residual block and the tensor-parallel attention block (GQA, RoPE, q/k/v biases,
sliding windows, document masks); :mod:`oases.models.decode` reuses its steps."""

from __future__ import annotations

import contextlib

import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from oases.models.documents import DocumentSlot
from oases.models.rope import Rotary
from oases.config import ModelConfig
from oases.config.heads import heads_problem, local_kv_heads
from oases.parallel.block import TPBlock
from oases.parallel.comm import group_size
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear
from oases.parallel.random import TPRNGTracker
from oases.parallel.recompute import recompute
from oases.parallel.program import done, finish
from oases.parallel.ring_attention import ring_attention_steps
from oases.parallel.sequence import part_dropout, seq_part


class ResidualBlock(TPBlock):
    """x + dropout(proj(...) reduced + bias): the combine of attention and MLP.

    The residual dropout is in the replicated region: its mask comes from the default
    generator, which is the same on all TP ranks. A block below the full TP degree
    (a plan's degree t < T) runs on part ``g`` of ``k = T/t`` parts of the batch, and
    all parts start from the same generator state; drawing the part's mask directly
    would give every part the same mask (correlated noise). Instead each part draws
    the mask of the whole (sub-)batch, as the block at degree T would, and keeps its
    rows: the masks are then exactly those of the uniform model. A sequence chunk
    (sequence parallelism) keeps its chunk of the whole sequence's mask alike.
    """

    proj: RowParallelLinear

    def __init__(self, tp_group, dropout: float) -> None:
        super().__init__(tp_group)
        self.dropout = nn.Dropout(dropout)  # replicated region: default generator, same on TP ranks
        self.batch_part = (0, 1)            # (g, k): this rank's part of the batch (plans)

    def prologue(self, x):
        return self.norm(x)

    def combine(self, x, reduced):
        """Under sequence parallelism ``x`` and ``reduced`` are this rank's sequence chunk
        (oases.parallel.sequence), and the mask is that chunk of the whole sequence's."""
        y = self.proj.add_bias(reduced)
        return x + part_dropout(self.dropout, y, self.batch_part, seq_part(self))


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention within a sliding window, as transformers' Mistral: query ``i``
    sees key ``j`` iff ``i - window < j <= i``. Positions broadcast: (..., Tq), (..., Tk)
    -> (..., Tq, Tk) bool; ``window`` 0: no window (plain causal)."""
    d = q_pos[..., :, None] - k_pos[..., None, :]
    return (d >= 0) & (d < window) if window else d >= 0


@functools.lru_cache(maxsize=8)
def _band(T: int, window: int, device: torch.device) -> torch.Tensor:
    """:func:`window_mask` of positions 0..T-1, shared by every layer and step (read only)."""
    pos = torch.arange(T, device=device)
    return window_mask(pos, pos, window)


class ParallelAttention(ResidualBlock):
    """Pre-norm causal self-attention; heads split over TP ranks (GQA: kv heads too).

    Over more ranks than kv heads, each kv head is replicated on the ``r = tp /
    n_kv_heads`` ranks whose query heads use it (oases.config.heads): the fused qkv keeps
    its k and v parts whole per head (``units``), so those r ranks hold the same kv
    rows (and q/k/v bias entries, which shard with their columns). Their gradients then
    need one more sum, over the *kv replica group*:

        forward, rank j of replica group h:   K_j = X W_h^T   (V alike), used only by
                                              rank j's own query heads
        dL/dW_h = sum_j dL/dK_j^T X  over the r ranks j of group h

    each rank's backward computes only its own term (its query heads' share), so the
    kv rows' gradients are summed over the group (oases.dp.replicas, with the
    DP reduction) and the replicas stay identical. The input gradient needs nothing
    new: dL/dX = sum over all tp ranks of dL/dY_j W_j, and each rank's term -- its
    q, its kv share -- is distinct, so the column-parallel all-reduce of dX over the
    TP group already adds every replica's term exactly once.

    ``qkv_bias``: q/k/v biases without output/MLP biases (Qwen2); ``model.bias`` gives
    every projection one. ``model.sliding_window`` w > 0: each query sees its last w
    keys (itself included), combined with the document mask where that is on.

    Context parallelism (``cp_group`` of cp > 1 ranks, those with this rank's TP rank):
    the input is this rank's head-tail tokens of each row; q, k, v of its local heads
    are rotated at the tokens' global positions and attend over the whole row through
    :func:`~oases.parallel.ring_attention.ring_attention` on the cp group (as a program
    under the ``oases`` engine, :meth:`partial_steps`), with the
    whole rows' document numbers (:class:`~oases.models.documents.DocumentSlot`).
    """

    def __init__(self, cfg: ModelConfig, norm: nn.Module, tp_group, tracker: Optional[TPRNGTracker],
                 rotary: Optional[Rotary], qkv_bias: bool = False) -> None:
        super().__init__(tp_group, cfg.dropout)
        hd = cfg.head_dim
        self.heads = (cfg.n_head, cfg.n_kv_heads)  # of the whole model
        self.n_head, self.n_kv = self.local_heads(group_size(tp_group))
        self.head_dim = hd
        self.norm = norm
        self.qkv = ColumnParallelLinear(
            cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_heads) * hd, tp_group,
            bias=cfg.bias or qkv_bias,
            parts=(cfg.n_head * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd),
            units=(cfg.n_head, cfg.n_kv_heads, cfg.n_kv_heads), init_std=cfg.init_std)
        self.proj = RowParallelLinear(cfg.n_head * hd, cfg.d_model, tp_group, bias=cfg.bias,
                                      reduce_output=False,
                                      init_std=cfg.init_std / math.sqrt(2 * cfg.n_layer))
        self.rotary = rotary
        self.window = cfg.sliding_window or 0
        self.tracker = tracker
        self.attn_dropout = cfg.dropout
        self.selective = False  # recompute=selective: the core is recomputed in backward
        self.cp_group = None    # context parallelism: the ring's group (None: cp 1)
        self.cp_overlap = True  # the ring's transfers behind its attention (False: waited)
        self.cp_clock = None    # times the ring's waits (oases.parallel.timing.IntervalTimer)
        # the model's: the documents of the rows computed now (attention stays inside
        # each, positions restart at each under data.reset_position_ids)
        self.documents: Optional[DocumentSlot] = None

    def local_heads(self, tp: int) -> tuple[int, int]:
        """(query heads, kv heads) of one rank at TP degree ``tp``."""
        n_head, n_kv = self.heads
        problem = heads_problem(n_head, n_kv, tp)
        if problem:
            raise ValueError(f"attention at TP degree {tp}: the degree {problem}")
        return n_head // tp, local_kv_heads(n_kv, tp)

    def shard(self, tp_group) -> None:
        self.n_head, self.n_kv = self.local_heads(group_size(tp_group))
        super().shard(tp_group)

    def qkv_heads(self, x, positions: Optional[torch.Tensor] = None,
                  rope: Optional[tuple] = None):
        """(B, T, d) -> q (B, nh, T, hd), k, v (B, nkv, T, hd): norm, projection and
        rotary at positions 0..T-1 or the (B, T) ``positions`` given (``rope``: their
        :meth:`Rotary.tables`, when the caller made them once for every layer)."""
        return self.heads_of(self.norm(x), positions, rope)

    def heads_of(self, h, positions: Optional[torch.Tensor] = None,
                 rope: Optional[tuple] = None):
        """:meth:`qkv_heads` of the normed input ``h``."""
        B, T, _ = h.shape
        q, k, v = self.qkv(h).split(self.qkv.local_parts, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)    # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)    # (B, nkv, T, hd)
        if self.rotary is not None:
            q, k = self.rotary(q, k, positions, rope)
        return q, k, v

    def out_partial(self, y):
        """(B, nh, T, hd) attention output -> this rank's partial sum of the projection."""
        B, _, T, _ = y.shape
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hd)
        return self.proj.partial(y)

    def _positions(self, h):
        docs = self.documents
        return None if docs is None else docs.local_positions(self.degree, h.shape[1], h.device)

    def partial_steps(self, x):
        """Under context parallelism a program that yields at the ring's waits
        (:meth:`region_steps`); else :meth:`partial` in one piece."""
        if group_size(self.cp_group) <= 1:
            return done(self.partial(x))
        return self._ring_region(self.prologue(x))

    def region_steps(self, h):
        if group_size(self.cp_group) <= 1:
            return done(self.region(h))
        return self._ring_region(h)

    def _ring_region(self, h):
        """The region under context parallelism, as a program: attention through the ring
        (:func:`~oases.parallel.ring_attention.ring_attention_steps`), which yields where
        it waits for a kv block or a gradient accumulator.

        recompute=selective does not wrap the ring: it keeps no T^2 probabilities (its
        backward recomputes each block's from q, k, v and the saved output and
        log-sum-exp), so recomputing it would only send every kv block again."""
        q, k, v = self.heads_of(h, self._positions(h))
        whole = None if self.documents is None else self.documents.at(self.degree)
        p = self.attn_dropout if self.training else 0.0
        # each rank's heads draw their own masks; the fork may stay open across the ring's
        # yields (the oases runner keeps each sub-batch's generator states apart)
        with self.tracker.fork() if p > 0.0 and self.tracker is not None \
                else contextlib.nullcontext():
            y = yield from ring_attention_steps(q, k, v, self.cp_group, causal=True,
                                                doc=None if whole is None else whole.doc,
                                                overlap=self.cp_overlap, clock=self.cp_clock,
                                                dropout=p)
        return self.out_partial(y)

    def region(self, h):
        if group_size(self.cp_group) > 1:
            return finish(self._ring_region(h))
        q, k, v = self.heads_of(h, self._positions(h))
        # the mask is taken here, once: a recompute of the core gets it as an input
        mask = self.train_mask(h.shape[1], h.device)
        if self.selective and self.training and torch.is_grad_enabled():
            y = recompute(self._core, q, k, v, mask, tracker=self.tracker)  # keeps q, k, v
        else:
            y = self._core(q, k, v, mask)
        return self.out_partial(y)

    def train_mask(self, T: int, device) -> Optional[torch.Tensor]:
        """The mask of a T-token forward: None for plain causal attention, else bool
        (T, T) or (B, 1, T, T): the sliding window and the documents' mask combined."""
        doc = None if self.documents is None else self.documents.mask(self.degree)
        if not self.window or self.window >= T:
            return doc
        band = _band(T, self.window, torch.device(device))  # (T, T), made once per shape
        return band if doc is None else doc & band

    def _core(self, q, k, v, mask: Optional[torch.Tensor] = None):
        """softmax(q k^T / sqrt(d)) v with dropout: what ``recompute=selective`` recomputes
        (its saved tensors grow with T^2 where the math kernel keeps the probabilities).
        ``mask``: bool, True where a query may attend (None: plain causal)."""
        p = self.attn_dropout if self.training else 0.0
        gqa = self.n_kv != self.n_head
        if gqa and not _fused_gqa(q, k, v, p, mask):
            # no fused kernel takes unequal head counts here (CUDA's memory-efficient one
            # in fp32, on many versions; flash wants bf16/fp16), and SDPA would fall back
            # to the math kernel, which keeps the T^2 probabilities: give each query head
            # its kv head instead (the same values; backward sums the copies' gradients)
            r = self.n_head // self.n_kv
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # (B, nh, T, hd)
            gqa = False
        # a mask: SDPA's boolean mask (CPU; CUDA's memory-efficient kernel)
        kw = {"is_causal": True} if mask is None else {"attn_mask": mask}
        if p > 0.0 and self.tracker is not None:
            with self.tracker.fork():  # sharded region: each rank's heads get their own masks
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa, **kw)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa, **kw)


def _fused_gqa(q, k, v, dropout: float, mask: Optional[torch.Tensor] = None) -> bool:
    """Whether a fused CUDA kernel (flash, memory-efficient or cuDNN) takes this
    grouped-query call as it is (``enable_gqa``; causal, or ``mask`` where given); torch's
    own dispatch checks answer. Off CUDA: True (the CPU flash kernel takes grouped heads)."""
    if q.device.type != "cuda":
        return True
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, mask is None, True)
    return any(can(params, False) for can in (torch.backends.cuda.can_use_flash_attention,
                                              torch.backends.cuda.can_use_efficient_attention,
                                              torch.backends.cuda.can_use_cudnn_attention))
