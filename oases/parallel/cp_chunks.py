"""Head-tail chunks of context parallelism: which tokens of a sequence each cp rank
holds, their global positions, and which parts of a ring step's attention block are
computed.

Causal attention over a sequence cut into cp contiguous pieces is unbalanced: the
last piece's queries see every key, the first's only their own. So, as torchtitan's
head-tail load balancing and Megatron-Core's context parallelism do, the sequence of T
tokens is cut into 2cp chunks of ``T / 2cp`` and rank i holds chunks ``i`` and
``2cp-1-i``, head then tail, concatenated:

    cp=2, T=8 (chunks 0..3)   rank 0: tokens 0 1 | 6 7     rank 1: tokens 2 3 | 4 5

Every rank then holds the same number of (query, key) pairs below the diagonal.
Positions stay the sequence's own (:func:`global_positions`): RoPE and learned
positions must see the global ones, and with ``data.reset_position_ids`` the (B, T)
positions of :meth:`oases.models.documents.Documents.positions` are sharded with
:func:`shard_sequence` like the tokens.

A rank's tokens are increasing in position (head chunk before tail chunk), so a causal
mask over its own concatenated tokens is the global causal mask restricted to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2cp) that ``rank`` holds: (head, tail) = (rank, 2cp-1-rank)."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} is not one of cp={cp} ranks")
    return rank, 2 * cp - 1 - rank


def _chunk_len(T: int, cp: int) -> int:
    if T % (2 * cp):
        raise ValueError(f"a sequence of {T} tokens does not split into 2*cp={2 * cp} "
                         f"equal chunks (cp={cp}): the length must be a multiple of {2 * cp}")
    return T // (2 * cp)


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s tokens of ``x`` along ``dim``: its head chunk then its tail chunk, a
    new tensor of ``x.shape[dim] / cp`` tokens (cp=1: ``x`` itself)."""
    if cp == 1:
        chunk_ids(cp, rank)
        return x
    c = _chunk_len(x.shape[dim], cp)
    head, tail = chunk_ids(cp, rank)
    return torch.cat([x.narrow(dim, head * c, c), x.narrow(dim, tail * c, c)], dim=dim)


def unshard_sequence(parts: Sequence[torch.Tensor], cp: int, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's :func:`shard_sequence`, ``parts[i]`` rank
    i's: the inverse of sharding."""
    if len(parts) != cp:
        raise ValueError(f"unshard_sequence needs one part per cp rank: got {len(parts)} "
                         f"parts for cp={cp}")
    if cp == 1:
        return parts[0]
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        if part.shape[dim] % 2:
            raise ValueError(f"rank {rank}'s part has {part.shape[dim]} tokens along dim "
                             f"{dim}: a part holds two chunks of equal length")
        head, tail = chunk_ids(cp, rank)
        chunks[head], chunks[tail] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def global_positions(T: int, cp: int, rank: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """(T / cp,) int64: the positions in the whole sequence of ``rank``'s tokens."""
    c = _chunk_len(T, cp)
    head, tail = chunk_ids(cp, rank)
    return torch.cat([torch.arange(head * c, (head + 1) * c, device=device),
                      torch.arange(tail * c, (tail + 1) * c, device=device)])


@dataclass(frozen=True)
class Block:
    """The part of one ring step's attention that is computed: query rows ``q`` and key
    rows ``k`` of the local (two-chunk) tokens; ``causal``: with the causal mask over
    them (the rank's own block), else every pair counts."""

    q: slice
    k: slice
    causal: bool


def block_plan(cp: int, rank: int, src: int, Tl: int, causal: bool) -> Block:
    """What rank ``rank`` computes of its queries against the kv block of rank ``src``,
    each ``Tl`` tokens (two chunks of ``Tl/2``). With r = rank, n = 2cp-1, query chunks
    (r, n-r), key chunks (src, n-src); a query chunk sees a key chunk whole below it,
    causally on itself, not at all above it:

        src == r:  (r, r) diagonal, (r, n-r) skipped, (n-r, r) full, (n-r, n-r) diagonal:
                   all queries against all keys with the causal mask over the local order
        src <  r:  both query chunks see key chunk src whole; key chunk n-src > n-r > r
                   is skipped for both: all queries against the head half of the keys
        src >  r:  query chunk r < src sees nothing; query chunk n-r > n-src > src
                   sees both key chunks whole: the tail half of the queries against all keys

    so every step computes a block (none is wholly masked) and every step off the
    diagonal only half of it, with no mask. Not causal: the whole block, no mask."""
    whole, half = slice(0, Tl), Tl // 2
    if not causal:
        return Block(whole, whole, False)
    if src == rank:
        return Block(whole, whole, True)
    if Tl % 2:
        raise ValueError(f"a cp rank's {Tl} tokens are not two equal chunks")
    if src < rank:
        return Block(whole, slice(0, half), False)
    return Block(slice(half, Tl), whole, False)
