"""Pieces shared by GPT and LLaMA: norms, attention and MLP blocks, the LM base.

Parameter names are stable across TP degrees and pipeline stages (they key
initialisation, checkpoints and HF import; ``i`` is the layer's index in the whole
model, whichever stage holds it):

    embed.wte.weight   embed.wpe.weight (GPT)
    layers.{i}.attn.{norm,qkv,proj}.*   layers.{i}.mlp.{norm,fc,proj}.*
    norm.*   head.weight (untied only)

A pipeline stage builds only its own layers; the first stage the embedding, the
last the final norm, the head and the loss. With tied embeddings the last stage
holds a copy of ``embed.wte.weight`` (same name, same initial value) for its
head; the runtime sums the two copies' gradients, so they stay equal.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.documents import document_mask
from oases.config import ModelConfig
from oases.config.heads import heads_problem, local_kv_heads
from oases.parallel.block import TPBlock
from oases.parallel.comm import all_reduce, copy_to_tp, gather_from_tp, group_size
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from oases.parallel.loss import IGNORE_INDEX, ce_combine, ce_partial
from oases.parallel.random import TPRNGTracker
from oases.parallel.recompute import recompute
from oases.parallel.sharding import set_spec


class LayerNorm(nn.Module):
    def __init__(self, d: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_spec(nn.Parameter(torch.empty(d)), None, ("ones",))
        self.bias = set_spec(nn.Parameter(torch.empty(d)), None, ("zeros",)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_spec(nn.Parameter(torch.empty(d)), None, ("ones",))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary embeddings, rotate-half convention (as HF LLaMA): no weight permutation."""

    def __init__(self, head_dim: int, max_len: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)  # (T, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1)                                # (T, hd)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def forward(self, q, k):
        T = q.shape[-2]
        cos, sin = self.cos[:T].to(q.dtype), self.sin[:T].to(q.dtype)  # (T, hd)
        return (q * cos + self._rotate_half(q) * sin,
                k * cos + self._rotate_half(k) * sin)


class ResidualBlock(TPBlock):
    """x + dropout(proj(...) reduced + bias): the combine of attention and MLP.

    The residual dropout is in the replicated region: its mask comes from the default
    generator, which is the same on all TP ranks. A block below the full TP degree
    (a plan's degree t < T) runs on part ``g`` of ``k = T/t`` parts of the batch, and
    all parts start from the same generator state; drawing the part's mask directly
    would give every part the same mask (correlated noise). Instead each part draws
    the mask of the whole (sub-)batch, as the block at degree T would, and keeps its
    rows: the masks are then exactly those of the uniform model.
    """

    proj: RowParallelLinear

    def __init__(self, tp_group, dropout: float) -> None:
        super().__init__(tp_group)
        self.dropout = nn.Dropout(dropout)  # replicated region: default generator, same on TP ranks
        self.batch_part = (0, 1)            # (g, k): this rank's part of the batch (plans)

    def combine(self, x, reduced):
        y = self.proj.add_bias(reduced)
        g, k = self.batch_part
        if k == 1 or not self.training or self.dropout.p == 0.0:
            return x + self.dropout(y)
        whole = y.new_ones((k * y.shape[0], *y.shape[1:]))          # (k B, T, d)
        mask = self.dropout(whole).narrow(0, g * y.shape[0], y.shape[0])  # 0 or 1/(1-p)
        return x + y * mask


class ParallelAttention(ResidualBlock):
    """Pre-norm causal self-attention; heads split over TP ranks (GQA: kv heads too).

    Over more ranks than kv heads, each kv head is replicated on the ``r = tp /
    n_kv_heads`` ranks whose query heads use it (oases.config.heads): the fused qkv keeps
    its k and v parts whole per head (``units``), so those r ranks hold the same kv
    rows. Their gradients then need one more sum, over the *kv replica group*:

        forward, rank j of replica group h:   K_j = X W_h^T   (V alike), used only by
                                              rank j's own query heads
        dL/dW_h = sum_j dL/dK_j^T X  over the r ranks j of group h

    each rank's backward computes only its own term (its query heads' share), so the
    kv rows' gradients are summed over the group (oases.dp.replicas, with the
    DP reduction) and the replicas stay identical. The input gradient needs nothing
    new: dL/dX = sum over all tp ranks of dL/dY_j W_j, and each rank's term -- its
    q, its kv share -- is distinct, so the column-parallel all-reduce of dX over the
    TP group already adds every replica's term exactly once.
    """

    def __init__(self, cfg: ModelConfig, norm: nn.Module, tp_group, tracker: Optional[TPRNGTracker],
                 rotary: Optional[Rotary]) -> None:
        super().__init__(tp_group, cfg.dropout)
        tp = group_size(tp_group)
        hd = cfg.head_dim
        problem = heads_problem(cfg.n_head, cfg.n_kv_heads, tp)
        if problem:
            raise ValueError(f"attention at TP degree {tp}: the degree {problem}")
        self.n_head, self.n_kv = cfg.n_head // tp, local_kv_heads(cfg.n_kv_heads, tp)  # local
        self.head_dim = hd
        self.norm = norm
        self.qkv = ColumnParallelLinear(
            cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_heads) * hd, tp_group, bias=cfg.bias,
            parts=(cfg.n_head * hd, cfg.n_kv_heads * hd, cfg.n_kv_heads * hd),
            units=(cfg.n_head, cfg.n_kv_heads, cfg.n_kv_heads), init_std=cfg.init_std)
        self.proj = RowParallelLinear(cfg.n_head * hd, cfg.d_model, tp_group, bias=cfg.bias,
                                      reduce_output=False,
                                      init_std=cfg.init_std / math.sqrt(2 * cfg.n_layer))
        self.rotary = rotary
        self.tracker = tracker
        self.attn_dropout = cfg.dropout
        self.selective = False  # recompute=selective: the core is recomputed in backward
        # (B, 1, T, T) bool: attend within documents only (CausalLM.attend_within_documents);
        # set from the token ids by each forward, read again by a recompute in its backward
        self.doc_mask: Optional[torch.Tensor] = None

    def partial(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split(self.qkv.local_parts, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)    # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)    # (B, nkv, T, hd)
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        if self.selective and self.training and torch.is_grad_enabled():
            y = recompute(self._core, q, k, v, tracker=self.tracker)  # keeps q, k, v only
        else:
            y = self._core(q, k, v)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, nh*hd)
        return self.proj.partial(y)

    def _core(self, q, k, v):
        """softmax(q k^T / sqrt(d)) v with dropout: what ``recompute=selective`` recomputes
        (its saved tensors grow with T^2 where the math kernel keeps the probabilities)."""
        p = self.attn_dropout if self.training else 0.0
        gqa = self.n_kv != self.n_head
        if gqa and not _fused_gqa(q, k, v, p, self.doc_mask):
            # no fused kernel takes unequal head counts here (CUDA's memory-efficient one
            # in fp32, on many versions; flash wants bf16/fp16), and SDPA would fall back
            # to the math kernel, which keeps the T^2 probabilities: give each query head
            # its kv head instead (the same values; backward sums the copies' gradients)
            r = self.n_head // self.n_kv
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)  # (B, nh, T, hd)
            gqa = False
        # within documents: SDPA's boolean mask (CPU; CUDA's memory-efficient kernel)
        mask = {"is_causal": True} if self.doc_mask is None else {"attn_mask": self.doc_mask}
        if p > 0.0 and self.tracker is not None:
            with self.tracker.fork():  # sharded region: each rank's heads get their own masks
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa,
                                                      **mask)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa, **mask)


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


class GeluMLP(ResidualBlock):
    def __init__(self, cfg: ModelConfig, norm: nn.Module, tp_group) -> None:
        super().__init__(tp_group, cfg.dropout)
        self.norm = norm
        self.fc = ColumnParallelLinear(cfg.d_model, cfg.ffn_hidden, tp_group, bias=cfg.bias,
                                       init_std=cfg.init_std)
        self.proj = RowParallelLinear(cfg.ffn_hidden, cfg.d_model, tp_group, bias=cfg.bias,
                                      reduce_output=False,
                                      init_std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def partial(self, x):
        return self.proj.partial(F.gelu(self.fc(self.norm(x)), approximate="tanh"))


class SwiGLUMLP(ResidualBlock):
    def __init__(self, cfg: ModelConfig, norm: nn.Module, tp_group) -> None:
        super().__init__(tp_group, cfg.dropout)
        self.norm = norm
        # gate and up fused in one column-parallel matmul, each sharded on its own
        self.fc = ColumnParallelLinear(cfg.d_model, 2 * cfg.ffn_hidden, tp_group, bias=cfg.bias,
                                       parts=(cfg.ffn_hidden, cfg.ffn_hidden),
                                       init_std=cfg.init_std)
        self.proj = RowParallelLinear(cfg.ffn_hidden, cfg.d_model, tp_group, bias=cfg.bias,
                                      reduce_output=False,
                                      init_std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def partial(self, x):
        gate, up = self.fc(self.norm(x)).split(self.fc.local_parts, dim=-1)
        return self.proj.partial(F.silu(gate) * up)


class TokenEmbedding(TPBlock):
    """Vocab-parallel token embedding (+ learned positions for GPT), then dropout."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, tp_group, learned_positions: bool):
        super().__init__(tp_group)
        self.wte = VocabParallelEmbedding(padded_vocab, cfg.d_model, tp_group,
                                          logical=cfg.vocab_size, reduce_output=False,
                                          init_std=cfg.init_std)
        if learned_positions:
            self.wpe = set_spec(nn.Parameter(torch.empty(cfg.seq_len, cfg.d_model)), None,
                                ("normal", cfg.init_std))
        else:
            self.wpe = None
        self.dropout = nn.Dropout(cfg.dropout)

    def partial(self, ids):
        return self.wte.partial(ids)

    def combine(self, ids, reduced):
        if self.wpe is not None:
            reduced = reduced + self.wpe[: ids.shape[1]]
        return self.dropout(reduced)


class TiedEmbedding(nn.Module):
    """The last stage's copy of the tied token embedding (``embed.wte``), used by the
    head. Marked ``shared_copy``: gradient norms count the first stage's copy only."""

    def __init__(self, cfg: ModelConfig, padded_vocab: int, tp_group) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(padded_vocab, cfg.d_model, tp_group,
                                          logical=cfg.vocab_size, reduce_output=False,
                                          init_std=cfg.init_std)
        self.wte.weight.shared_copy = True


class LayerStack(nn.ModuleDict):
    """The transformer layers a model (or a pipeline stage) holds, named by their index
    in the whole model (``layers.5.*`` on whichever stage owns layer 5); iterates over
    the layers in order and indexes by that global index."""

    def __init__(self, layers, first: int = 0) -> None:
        super().__init__({str(first + i): layer for i, layer in enumerate(layers)})

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, i):
        return super().__getitem__(str(i))


class TransformerLayer(nn.Module):
    def __init__(self, attn: TPBlock, mlp: TPBlock, resharder=None) -> None:
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.resharder = resharder  # DegreeGroups when attn and mlp may differ in degree

    def forward(self, x):
        x = self.attn(x)
        if self.attn.degree != self.mlp.degree:
            x = self.resharder.reshard(x, self.attn.degree, self.mlp.degree)
        return self.mlp(x)


class CausalLM(nn.Module):
    """embedding -> layers -> norm -> vocab-parallel head -> vocab-parallel loss.

    Subclasses say which norm, MLP and position scheme to use.
    """

    learned_positions = False

    def __init__(self, cfg: ModelConfig, padded_vocab: int, tp_group=None,
                 tracker: Optional[TPRNGTracker] = None, recompute: str = "none",
                 degrees: Optional[list[int]] = None, degree_groups=None,
                 stage: Optional[tuple[int, int]] = None) -> None:
        """``degrees``: a TP degree per transformer block (attn, mlp of each layer, in
        order; see oases.parallel.reshard), with ``degree_groups`` holding the groups.
        None: every block uses the whole TP group. ``stage``: the layers [start, stop)
        of the pipeline stage this rank runs (default: all of them); ``degrees`` then
        covers that stage's blocks only."""
        super().__init__()
        self.cfg = cfg
        self.tp_group = tp_group
        self.tracker = tracker
        self.recompute = recompute
        self.vocab_size, self.padded_vocab = cfg.vocab_size, padded_vocab
        self.eos_id: Optional[int] = None  # attend_within_documents
        a, b = stage if stage is not None else (0, cfg.n_layer)
        self.layer_range = (a, b)
        self.is_first, self.is_last = a == 0, b == cfg.n_layer
        T = group_size(tp_group)
        self.home_degree = T  # degree of the stage's input and output (replicated over TP)
        if self.is_first:
            self.embed = TokenEmbedding(cfg, padded_vocab, tp_group, self.learned_positions)
        elif self.is_last and cfg.tie_embeddings:
            self.embed = TiedEmbedding(cfg, padded_vocab, tp_group)
        else:
            self.embed = None
        if degrees is not None and len(degrees) != 2 * (b - a):
            raise ValueError(f"{len(degrees)} block degrees for {2 * (b - a)} blocks")
        self.resharder = degree_groups if degrees is not None and set(degrees) != {T} else None

        def group(j: int):
            return tp_group if self.resharder is None else degree_groups.sub[degrees[j]]

        rotary = self.make_rotary(cfg)
        self.layers = LayerStack([
            TransformerLayer(
                ParallelAttention(cfg, self.make_norm(cfg), group(2 * i), tracker, rotary),
                self.make_mlp(cfg, self.make_norm(cfg), group(2 * i + 1)), self.resharder)
            for i in range(b - a)], first=a)
        for layer in self.layers:
            layer.attn.selective = recompute == "selective"
        for blk in self.blocks():  # the reduction group of every gradient follows from it
            for p in blk.parameters():
                p.tp_degree = blk.degree
            if self.resharder is not None and blk.degree < T:
                blk.batch_part = (self.resharder.position(blk.degree)[0], T // blk.degree)
        self.norm = self.head = None
        if self.is_last:
            self.norm = self.make_norm(cfg)
            for p in self.norm.parameters():
                p.tp_degree = T
            if cfg.tie_embeddings:
                self.embed.wte.weight.tp_degree = T
            else:
                self.head = ColumnParallelLinear(cfg.d_model, padded_vocab, tp_group, bias=False,
                                                 init_std=cfg.init_std)
                self.head.weight.tp_spec = type(self.head.weight.tp_spec)(
                    0, (padded_vocab, cfg.d_model), logical=cfg.vocab_size)
                self.head.weight.tp_degree = T

    # -- what a subclass chooses --
    def make_norm(self, cfg: ModelConfig) -> nn.Module:  # pragma: no cover - abstract
        raise NotImplementedError

    def make_mlp(self, cfg: ModelConfig, norm: nn.Module, tp_group) -> TPBlock:  # pragma: no cover
        raise NotImplementedError

    def make_rotary(self, cfg: ModelConfig) -> Optional[Rotary]:
        return None

    # -- the block protocol --
    def blocks(self) -> list[TPBlock]:
        """Every block in execution order: embedding (first stage only), then attn/mlp
        of each layer."""
        out: list[TPBlock] = [self.embed] if self.is_first else []
        for layer in self.layers:
            out += [layer.attn, layer.mlp]
        return out

    def recompute_groups(self) -> list[tuple[int, int]]:
        """Block index ranges [a, b) recomputed together under recompute=full: one
        transformer layer each (the embedding block is never recomputed)."""
        k = 1 if self.is_first else 0
        return [(k + 2 * i, k + 2 + 2 * i) for i in range(len(self.layers))]

    def attend_within_documents(self, eos_id: Optional[int]) -> None:
        """``data.reset_attention_at_eos``: a forward from token ids masks attention at
        each ``eos_id`` (None: causal only). Needs pp = 1 and the megatron engine."""
        self.eos_id = eos_id
        if eos_id is None:
            for layer in self.layers:
                layer.attn.doc_mask = None

    def reshard(self, x: torch.Tensor, t_from: int, t_to: int) -> torch.Tensor:
        return x if t_from == t_to else self.resharder.reshard(x, t_from, t_to)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d) final hidden states (before the final norm); on
        a later pipeline stage, the stage's (B, T, d) input -> its output."""
        x = self.embed(ids) if self.is_first else ids
        if self.eos_id is not None and self.is_first:
            mask = document_mask(ids, self.eos_id)
            for layer in self.layers:
                layer.attn.doc_mask = mask
        prev = self.home_degree
        for layer in self.layers:
            x = self.reshard(x, prev, layer.attn.degree)
            if self.recompute == "full" and self.training and torch.is_grad_enabled():
                x = recompute(layer, x, tracker=self.tracker)
            else:
                x = layer(x)
            prev = layer.mlp.degree
        return self.reshard(x, prev, self.home_degree)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, V_pad/tp) logits of this rank's vocabulary slice."""
        x = copy_to_tp(self.norm(x), self.tp_group)
        w = self.embed.wte.weight if self.head is None else self.head.weight
        return F.linear(x, w)

    def loss_partial(self, x: torch.Tensor, targets: torch.Tensor):
        """The loss up to its one collective: (state, buffer to sum over ``tp_group``).
        The ``oases`` engine launches that all-reduce asynchronously and runs the other
        sub-batch meanwhile; :meth:`loss_from_hidden` does it in one blocking call."""
        logits = self.head_logits(x)
        st, stats = ce_partial(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                               self.tp_group, self.vocab_size, ignore_index=IGNORE_INDEX)
        return (st, targets), stats

    def loss_combine(self, state, reduced: torch.Tensor) -> torch.Tensor:
        """Mean loss over the tokens that count (targets == IGNORE_INDEX add nothing)."""
        st, targets = state
        return ce_combine(st, reduced).sum() / self.loss_tokens(targets).clamp(min=1)

    @staticmethod
    def loss_tokens(targets: torch.Tensor) -> torch.Tensor:
        """How many targets the mean loss is over: those that are not IGNORE_INDEX. The
        engines and the step weigh the pieces of a batch by it
        (:mod:`oases.overlap.loss_weights`)."""
        return (targets != IGNORE_INDEX).sum()

    def loss_from_hidden(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        state, stats = self.loss_partial(x, targets)
        if group_size(self.tp_group) > 1:
            all_reduce(stats, self.tp_group)
        return self.loss_combine(state, stats)

    def forward(self, ids: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token loss if ``targets`` is given, else this rank's logits slice.
        A pipeline stage that is not the last returns its output activation."""
        x = self.hidden(ids)
        if not self.is_last:
            return x
        if targets is None:
            return self.head_logits(x)
        return self.loss_from_hidden(x, targets)

    @torch.no_grad()
    def full_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T, vocab_size) logits gathered over TP, padding removed (eval, export)."""
        logits = gather_from_tp(self.head_logits(self.hidden(ids)), self.tp_group, dim=-1)
        return logits[..., : self.vocab_size]

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters of the full (unsharded) model; optionally without the embedding
        tables and the untied head."""
        n = 0
        for name, p in self.named_parameters():
            if exclude_embeddings and name.startswith(("embed.", "head.")):
                continue
            spec = getattr(p, "tp_spec", None)
            n += math.prod(spec.full_shape) if spec else p.numel()
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 N (matmul weights, head included) + 12 L d T
        (attention scores and values; PaLM appendix B)."""
        c = self.cfg
        n = self.num_params(exclude_embeddings=True)
        n += c.vocab_size * c.d_model  # the head matmul, tied or not
        return 6.0 * n + 12.0 * c.n_layer * c.d_model * c.seq_len
