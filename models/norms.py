"""The normalisations: LayerNorm (GPT) and RMSNorm (LLaMA family), replicated over TP."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

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
