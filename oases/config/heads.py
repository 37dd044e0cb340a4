"""How attention heads spread over the ranks of a TP group of size t (pure Python:
the config, the planner and the models share these rules).

Query heads are split evenly: t must divide ``n_head``. Key/value heads (GQA:
``n_kv_heads`` <= ``n_head``) are split the same way while t <= ``n_kv_heads``;
above that, each kv head is *replicated* on the ``t / n_kv_heads`` consecutive
ranks whose query heads use it (as Megatron-LM does):

    n_head 4, n_kv_heads 2       rank:     0    1    2    3
    t = 2: q heads / kv heads             0,1  2,3
                                          0    1
    t = 4: q heads / kv heads             0    1    2    3
                                          0    0    1    1     <- kv replicas {0,1} {2,3}

Query head h uses kv head ``h // (n_head / n_kv_heads)``; rank j holds query heads
``[j n_head/t, (j+1) n_head/t)``, which all use kv head ``j // (t / n_kv_heads)`` when
t is a multiple of ``n_kv_heads`` -- so every rank needs exactly one kv head. A t
that neither divides ``n_kv_heads`` nor is a multiple of it would split a rank's
query heads over two kv heads, or a kv head over two ranks: refused.
"""

from __future__ import annotations

from typing import Optional


def kv_replicas(n_kv_heads: int, t: int) -> int:
    """On how many ranks of a degree-t group each kv head lives (1: not replicated)."""
    return t // n_kv_heads if t > n_kv_heads else 1


def local_kv_heads(n_kv_heads: int, t: int) -> int:
    """kv heads a rank of a degree-t group holds."""
    return n_kv_heads // t if t <= n_kv_heads else 1


def heads_problem(n_head: int, n_kv_heads: int, t: int) -> Optional[str]:
    """Why degree t cannot shard the attention heads (``"does not divide model.n_head=6"``),
    or None when it can."""
    if n_head % t:
        return f"does not divide model.n_head={n_head}"
    if n_kv_heads % t and t % n_kv_heads:
        return (f"neither divides model.n_kv_heads={n_kv_heads} nor is a multiple of it "
                f"(kv heads are split, or replicated, whole)")
    return None
