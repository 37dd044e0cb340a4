"""The MLP blocks, the embeddings and the layer containers GPT and LLaMA are made of
(the attention block: :mod:`oases.models.attention`)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from oases.models.attention import ResidualBlock
from oases.models.documents import DocumentSlot
from oases.config import ModelConfig
from oases.parallel.block import TPBlock
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from oases.parallel.sequence import part_dropout, seq_part
from oases.parallel.sharding import set_spec


class GeluMLP(ResidualBlock):
    def __init__(self, cfg: ModelConfig, norm: nn.Module, tp_group) -> None:
        super().__init__(tp_group, cfg.dropout)
        self.norm = norm
        self.fc = ColumnParallelLinear(cfg.d_model, cfg.ffn_hidden, tp_group, bias=cfg.bias,
                                       init_std=cfg.init_std)
        self.proj = RowParallelLinear(cfg.ffn_hidden, cfg.d_model, tp_group, bias=cfg.bias,
                                      reduce_output=False,
                                      init_std=cfg.init_std / math.sqrt(2 * cfg.n_layer))

    def region(self, h):
        return self.proj.partial(F.gelu(self.fc(h), approximate="tanh"))


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

    def region(self, h):
        gate, up = self.fc(h).split(self.fc.local_parts, dim=-1)
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
        self.documents: Optional[DocumentSlot] = None  # the model's (positions per document)

    def partial(self, ids):
        return self.wte.partial(ids)

    def combine(self, ids, reduced, positions=None):
        """``positions``: (B, T) long position of each token (decoding), else the
        documents' (``data.reset_position_ids``), else 0..T-1. Under sequence
        parallelism ``reduced`` is this rank's chunk of the sequence: its positions, and
        its chunk of the whole sequence's dropout mask. Under context parallelism
        ``ids`` are this rank's head-tail tokens and the positions their global ones
        (:meth:`~oases.models.documents.DocumentSlot.local_positions`)."""
        j, n = seq_part(self)
        T = reduced.shape[1]
        if positions is None and self.wpe is not None and self.documents is not None:
            positions = self.documents.local_positions(self.degree, T * n, reduced.device)
            if positions is not None:  # (B, T/n) or (T/n,): this rank's chunk
                positions = positions[..., j * T: (j + 1) * T]
        if self.wpe is not None:
            reduced = reduced + (self.wpe[j * T: (j + 1) * T] if positions is None
                                 else self.wpe[positions])
        return part_dropout(self.dropout, reduced, seq=(j, n))


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
            x = self.resharder.reshard(x, self.attn.degree, self.mlp.degree,
                                       self.attn.sequence_parallel)
        return self.mlp(x)
