"""The causal LM every architecture subclasses (its blocks: oases.models.attention, oases.models.blocks).

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

import copy
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from oases.models.attention import ParallelAttention
from oases.models.blocks import LayerStack, TiedEmbedding, TokenEmbedding, TransformerLayer
from oases.models.decode import KVCache, decode, new_kv_cache
from oases.models.documents import DocumentSlot
from oases.models.rope import Rotary
from oases.config import ModelConfig
from oases.parallel.block import TPBlock
from oases.parallel.comm import all_reduce, copy_to_tp, gather_from_tp, group_size
from oases.parallel.layers import ColumnParallelLinear
from oases.parallel.loss import IGNORE_INDEX, ce_combine, ce_partial
from oases.parallel.recompute import recompute
from oases.parallel.sequence import gathered_region, set_sequence_parallel


class CausalLM(nn.Module):
    """embedding -> layers -> norm -> vocab-parallel head -> vocab-parallel loss.

    Subclasses say which norm, MLP and position scheme to use.
    """

    learned_positions = False
    qkv_bias = False  # q/k/v biases without the other projections' (Qwen2)
    sequence_parallel = False  # set_sequence_parallel

    def __init__(self, cfg: ModelConfig, padded_vocab: int) -> None:
        """The whole model, unsharded: architecture only. Build it on the meta device and
        :func:`oases.models.parallelize.parallelize` it (TP groups and per-block degrees,
        pipeline stage, recompute, sequence parallelism, parameter tags), then
        materialise and initialise it (:func:`oases.models.parallelize.build`)."""
        super().__init__()
        self.cfg = cfg
        self.vocab_size, self.padded_vocab = cfg.vocab_size, padded_vocab
        # what parallelize sets: the whole model at tp = 1 until then
        self.tp_group, self.tracker, self.recompute = None, None, "none"
        self.cp_group = None  # context parallelism's group: the model holds its rank's tokens
        self.cp_clock = None  # the ring's waits, timed (an IntervalTimer; None: untimed)
        self.layer_range = (0, cfg.n_layer)
        self.is_first = self.is_last = True
        self.home_degree = 1  # TP degree of the (stage's) input and output
        self.resharder = None  # DegreeGroups when blocks run at several degrees
        self.wgrad = None  # a WeightGradStore: the blocks' dW deferrable (zero-bubble)
        self.chunks = None  # interleaved-1f1b: a view per chunk (a plain list, not modules)
        self.embed = TokenEmbedding(cfg, padded_vocab, None, self.learned_positions)
        rotary = self.make_rotary(cfg)
        self.layers = LayerStack([
            TransformerLayer(
                ParallelAttention(cfg, self.make_norm(cfg), None, None, rotary, self.qkv_bias),
                self.make_mlp(cfg, self.make_norm(cfg), None))
            for _ in range(cfg.n_layer)])
        # the documents of the rows computed now, which attention and positions follow
        # (oases.models.documents): filled by the engines, read by every layer
        self.documents = DocumentSlot()
        self.embed.documents = self.documents
        for layer in self.layers:
            layer.attn.documents = self.documents
        self.norm = self.make_norm(cfg)
        self.head = None if cfg.tie_embeddings else ColumnParallelLinear(
            cfg.d_model, padded_vocab, None, bias=False, init_std=cfg.init_std,
            logical=cfg.vocab_size)

    def keep_layers(self, a: int, b: int) -> None:
        """A pipeline stage: only layers [a, b) stay, with the embedding on the first
        stage (on the last one too, as a tied head's copy) and the final norm and head
        on the last."""
        self.keep_chunks([(a, b)])

    def keep_chunks(self, ranges: list[tuple[int, int]]) -> None:
        """The layers of every range in ``ranges`` (ascending, disjoint) stay: one rank's
        chunks under interleaved-1f1b (several virtual stages, :meth:`chunk` runs each),
        or one stage's range. The embedding stays when layer 0 does, the final norm and
        head when the last layer does (and the tied table's copy with them)."""
        cfg = self.cfg
        kept = {i for a, b in ranges for i in range(a, b)}
        for i in range(cfg.n_layer):
            if i not in kept:
                self.layers.pop(str(i))
        self.layer_range = (ranges[0][0], ranges[-1][1])
        self.is_first, self.is_last = 0 in kept, cfg.n_layer - 1 in kept
        if not self.is_first:
            with torch.device(self.param_device()):
                self.embed = TiedEmbedding(cfg, self.padded_vocab, None) \
                    if self.is_last and cfg.tie_embeddings else None
        if not self.is_last:
            self.norm = self.head = None

    def chunk(self, a: int, b: int) -> "CausalLM":
        """The virtual stage of layers [a, b) of this rank's model (:meth:`keep_chunks`): a
        model that shares this one's modules and runs only that chunk, with the
        embedding if a is 0 and the final norm, head and loss if b is the last layer.
        Its hooks are its own; the parameters, and everything the optimizer, the DP
        reducer and checkpoints see, stay this model's."""
        view = copy.copy(self)  # nn.Module's __dict__, shallow: modules and buffers shared
        for name in ("_modules", "_parameters", "_buffers"):
            view.__dict__[name] = dict(self.__dict__[name])
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                     "_backward_pre_hooks", "_forward_hooks_with_kwargs",
                     "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs"):
            if name in self.__dict__:
                view.__dict__[name] = type(self.__dict__[name])()
        view.chunks = None
        view.layers = LayerStack([self.layers[i] for i in range(a, b)], first=a)
        view.layer_range = (a, b)
        view.is_first, view.is_last = a == 0, b == self.cfg.n_layer
        if not (view.is_first or view.is_last):
            view.embed = None
        if not view.is_last:
            view.norm = view.head = None
        return view

    def train(self, mode: bool = True) -> "CausalLM":
        super().train(mode)
        for view in self.chunks or ():  # they share the modules, not the flag
            view.training = mode
        return self

    def param_device(self) -> torch.device:
        return next(self.parameters()).device

    def reset_buffers(self) -> None:
        """The tensors that are not parameters (rotary tables), made again on the
        parameters' device: after a build on the meta device. Computed on the CPU and
        moved, as a model built on the CPU has them."""
        rotary = self.make_rotary(self.cfg)
        if rotary is not None:
            rotary = rotary.to(self.param_device())
        for layer in self.layers:
            layer.attn.rotary = rotary

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

    def set_sequence_parallel(self, on: bool) -> None:
        """``parallel.sequence_parallel``: the activations between the blocks, a pipeline
        stage's input and output, and the final norm hold this rank's chunk of the
        sequence (oases.parallel.sequence)."""
        if on:
            T, tp = self.cfg.seq_len, group_size(self.tp_group)
            if T % tp:
                raise ValueError(f"sequence parallelism splits the sequence over the TP "
                                 f"ranks: model.seq_len={T} does not divide by tp={tp}")
        set_sequence_parallel(self, on)

    def reshard(self, x: torch.Tensor, t_from: int, t_to: int) -> torch.Tensor:
        if t_from == t_to:
            return x
        return self.resharder.reshard(x, t_from, t_to, self.sequence_parallel)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, d) final hidden states (before the final norm); on
        a later pipeline stage, the stage's (B, T, d) input -> its output. Under sequence
        parallelism both are this rank's chunk, (B, T/tp, d), as are a stage's input and
        output (:class:`~oases.pipeline.cross_mesh.CrossMeshTransfer` moves chunks)."""
        x = self.embed(ids) if self.is_first else ids  # a later stage's: its chunk under SP
        prev = self.home_degree
        for layer in self.layers:
            x = self.reshard(x, prev, layer.attn.degree)
            if self.recompute == "full" and self.training and torch.is_grad_enabled():
                x = recompute(layer, x, tracker=self.tracker)
            else:
                x = layer(x)
            prev = layer.mlp.degree
        return self.reshard(x, prev, self.home_degree)

    def head_prologue(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm: sequence-local (under sequence parallelism, on the chunk)."""
        return self.norm(x)

    def head_region(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, d) normed, whole sequence -> (B, T, V_pad/tp) logits of this rank's
        vocabulary slice (entering the TP region)."""
        w = self.embed.wte.weight if self.head is None else self.head.weight
        return F.linear(copy_to_tp(h, self.tp_group), w)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, V_pad/tp) logits of this rank's vocabulary slice. Under
        sequence parallelism ``x`` is the chunk, and the normed chunks are gathered."""
        h = self.head_prologue(x)
        if not self.sequence_parallel:
            return self.head_region(h)
        return gathered_region(self.head_region, h, self.tp_group)  # on (B, T, d)

    def loss_partial(self, x: torch.Tensor, targets: torch.Tensor, entered: bool = False):
        """The loss up to its one collective: (state, buffer to sum over ``tp_group``).
        The ``oases`` engine launches that all-reduce asynchronously and runs the other
        sub-batch meanwhile; :meth:`loss_from_hidden` does it in one blocking call.
        ``entered``: ``x`` is the normed whole sequence the region reads (the engine
        gathered it under sequence parallelism)."""
        logits = self.head_region(x) if entered else self.head_logits(x)
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

    def new_kv_cache(self, batch: int, max_len: int) -> KVCache:
        """An empty key/value cache for :meth:`decode`: ``batch`` rows of up to
        ``max_len`` slots, this rank's local kv heads, the model's dtype and device."""
        return new_kv_cache(self, batch, max_len)

    def decode(self, ids: torch.Tensor, cache: KVCache, pad: Optional[torch.Tensor] = None,
               last_only: bool = False) -> torch.Tensor:
        """(B, t) token ids appended to ``cache`` -> (B, t, vocab_size) logits (gathered
        over TP, padding removed; ``last_only``: (B, 1, vocab_size), the last slot's);
        see :func:`oases.models.decode.decode`."""
        return decode(self, ids, cache, pad, last_only)

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
