"""Incremental decoding with a key/value cache: the path ``python -m oases.generate``
takes through a model.

    cache = model.new_kv_cache(batch, max_len)
    logits = model.decode(prompt, cache, pad)   # (B, T0) -> (B, T0, V): fills slots 0..T0-1
    logits = model.decode(next_ids, cache)      # (B, 1) -> (B, 1, V): slot T0, T0+1, ...
    logits = model.decode(prompt, cache, pad, last_only=True)   # (B, T0) -> (B, 1, V)

Rows of unequal length are left-padded: ``pad[b]`` slots at the start of row ``b``
hold no token. The token in slot ``s`` of row ``b`` is at position ``s - pad[b]``
(rotary and learned positions use it) and no query attends to a slot ``< pad[b]``;
with ``model.sliding_window`` w, query slot i sees slots ``i - w < j <= i``. Every
TP rank calls with the same ids and gets the same (gathered) logits; each keeps the
keys and values of its own (local, possibly replicated) kv heads. The attention
block's own steps (``qkv_heads``, ``_core``, ``out_partial``, ``combine``) run it,
so decoding computes what a full forward computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from oases.models.attention import window_mask
from oases.parallel.comm import gather_from_tp, group_size, reduce_from_tp


@dataclass
class KVCache:
    """Per-layer key and value buffers, (B, nkv_local, max_len, hd) each, and how many
    slots are filled (``length``). ``pad``: (B,) left-padding slots of each row."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    max_len: int
    length: int = 0
    pad: Optional[torch.Tensor] = field(default=None)


def _check(model) -> None:
    if not (model.is_first and model.is_last):
        raise ValueError("decode needs the whole model on one stage (parallel.pp=1)")
    if model.resharder is not None:
        raise ValueError("decode needs one TP degree for every block (no per-block plan)")
    if model.sequence_parallel:
        raise ValueError("decode runs on whole sequences: set_sequence_parallel(False) first")
    if group_size(model.cp_group) > 1:  # decoding attends the cache, not the ring
        raise ValueError(f"decode runs on whole sequences: the model is context-parallel "
                         f"(cp={group_size(model.cp_group)}); build it without a cp group")


def new_kv_cache(model, batch: int, max_len: int) -> KVCache:
    _check(model)
    if not 0 < max_len <= model.cfg.seq_len:
        raise ValueError(f"a cache of {max_len} slots: it must hold 1 to model.seq_len="
                         f"{model.cfg.seq_len} tokens")
    w = model.embed.wte.weight
    ks, vs = [], []
    for layer in model.layers:
        a = layer.attn
        shape = (batch, a.n_kv, max_len, a.head_dim)  # (B, nkv, S, hd)
        ks.append(torch.zeros(shape, dtype=w.dtype, device=w.device))
        vs.append(torch.zeros(shape, dtype=w.dtype, device=w.device))
    return KVCache(ks, vs, max_len)


@torch.no_grad()
def decode(model, ids: torch.Tensor, cache: KVCache, pad: Optional[torch.Tensor] = None,
           last_only: bool = False) -> torch.Tensor:
    """Append the (B, t) ``ids`` to ``cache`` (slots ``length .. length+t-1``) and
    return their (B, t, vocab_size) float logits; with ``last_only``, those of the last
    slot alone, (B, 1, vocab_size) (the head runs on it only). ``pad`` (B,) long: the
    left padding of each row (given once, with the prompt, or with every call)."""
    _check(model)
    B, t = ids.shape
    s0, s1 = cache.length, cache.length + t
    if s1 > cache.max_len:
        raise ValueError(f"the cache holds {cache.max_len} slots; {s1} needed")
    if pad is not None:
        cache.pad = pad.to(device=ids.device, dtype=torch.long)
    elif cache.pad is None:
        cache.pad = torch.zeros(B, dtype=torch.long, device=ids.device)
    slots = torch.arange(s1, device=ids.device)
    positions = (slots[s0:][None, :] - cache.pad[:, None]).clamp(min=0)  # (B, t)
    # query slot i sees slot j: causal (within the window), never a padding slot; a
    # padding query sees itself, so that no row of the softmax is empty
    q_slots, k_slots = slots[s0:], slots
    real = (k_slots[None, :] >= cache.pad[:, None])[:, None, :]        # (B, 1, s1)
    mask = window_mask(q_slots, k_slots, model.cfg.sliding_window or 0)[None] & real  # (B, t, s1)
    mask = (mask | (q_slots[:, None] == k_slots[None, :]))[:, None]    # (B, 1, t, s1)
    was_training = model.training
    if was_training:
        model.eval()
    try:
        emb = model.embed
        x = emb.combine(ids, reduce_from_tp(emb.partial(ids), emb.tp_group), positions)
        rotary = next(iter(model.layers)).attn.rotary  # one for every layer
        rope = rotary.tables(t, positions, x.dtype) if rotary is not None else None
        for i, layer in enumerate(model.layers):
            a = layer.attn
            q, k, v = a.qkv_heads(x, positions, rope)
            cache.k[i][:, :, s0:s1] = k
            cache.v[i][:, :, s0:s1] = v
            y = a._core(q, cache.k[i][:, :, :s1], cache.v[i][:, :, :s1], mask)
            x = a.combine(x, reduce_from_tp(a.out_partial(y), a.tp_group))
            x = layer.mlp(x)
        if last_only:
            x = x[:, -1:]
        logits = gather_from_tp(model.head_logits(x), model.tp_group, dim=-1)
    finally:
        if was_training:
            model.train()
    cache.length = s1
    return logits[..., : model.vocab_size].float()
