"""What a ZeRO level costs a block: bytes held per rank and bytes moved per step.

Pure arithmetic for the planner (no torch). A block with ``n`` parameters of
``elem`` bytes, its gradient group of ``G`` ranks (dp, times the replicas of a
block below the full TP degree), AdamW's two fp32 moments:

    level   params        grads          Adam state      moved per step (bytes per rank)
    0       n e           n e            8 n             all-reduce: 2 (G-1)/G n e
    1       n e           n e            8 n / G         all-reduce + all-gather after the
                                                         step: 3 (G-1)/G n e
    2       n e           n e / G (*)    8 n / G         reduce-scatter + all-gather:
                                                         2 (G-1)/G n e
    3       n e / G (**)  n e / G (*)    8 n / G         reduce-scatter + all-gather in
                                                         forward and in backward:
                                                         3 (G-1)/G n e

(*) between steps; the whole gradient buffer exists while the backward fills it.
(**) outside the block in use; the all-gathers of level 3 are prefetched one block
ahead, so they overlap the previous block's compute as the TP collectives do.
Owned ranges are padded to a multiple of G (a few elements per bucket).

Level 3 with a node-local secondary shard (``parallel.zero_secondary=node``, L of the
group's ranks on a node) also holds ``n s / L`` (``s``: bytes per element of the compute
dtype), and of its two gathers per step only the first crosses nodes; the other runs
over the node's L ranks: ``(L-1)/L n e`` sent inside the node instead.

bf16 compute weights over fp32 masters (``train.precision=bf16``, ``master``): the
parameters hold ``w`` = 2 bytes per element (levels 0-2; at level 3 nothing between
steps), a ``master`` row holds the fp32 masters (4 n at level 0, 4 n / G at levels 1-3),
gradients are fp32 main-grads (``e`` = 4), and every parameter gather (level 3's, levels
1-2's after the step) moves ``w`` bytes per element.
"""

from __future__ import annotations

from typing import Optional

_FACTOR = {0: (1, 1, 1), 1: (1, 1, 0), 2: (1, 0, 0), 3: (0, 0, 0)}  # 1: whole, 0: / G
_MOVED = {0: 2, 1: 3, 2: 2, 3: 3}  # (G-1)/G n e units


def zero_memory(n: int, elem: int, level: int, dp: int, secondary: int = 0,
                sec_elem: Optional[int] = None, weight_elem: Optional[int] = None
                ) -> dict[str, float]:
    """Bytes per rank held between steps for ``n`` parameters at ``level`` over ``dp``;
    ``secondary``: L, the group's ranks per node, when level 3 keeps a node-local shard
    (0: none) of ``sec_elem`` bytes per element (default ``elem``), its own row.
    ``weight_elem``: bytes per element of bf16 compute weights over fp32 masters (None:
    the parameters are the masters), with the ``master`` row."""
    if level not in _FACTOR:
        raise ValueError(f"ZeRO level {level}")
    whole_p, whole_g, whole_o = _FACTOR[level]
    div = lambda whole: 1 if whole or dp <= 1 else dp  # noqa: E731
    out = {"params": n * elem / div(whole_p), "grads": n * elem / div(whole_g),
           "optim": 8 * n / div(whole_o)}
    if weight_elem is not None:
        out["params"] = 0.0 if level == 3 and dp > 1 else n * weight_elem
        out["master"] = n * elem / div(whole_o)
    if secondary and level == 3 and dp > 1:
        out["secondary"] = n * (elem if sec_elem is None else sec_elem) / secondary
    return out


def zero_traffic(n: int, elem: int, level: int, dp: int,
                 reduce_elem: Optional[int] = None, secondary: int = 0,
                 gather_elem: Optional[int] = None) -> float:
    """Bytes a rank sends per step over its whole group for the block's data parallelism
    at ``level``; ``reduce_elem``: bytes per gradient element on the wire (default
    ``elem``; ``parallel.grad_reduce_dtype``), the parameter gathers stay at ``elem``;
    ``secondary``: L of a level-3 node-local shard, whose second gather runs inside the
    node instead (not counted here: see the module's docstring); ``gather_elem``: bytes
    per element of the parameter gathers (bf16 compute weights: 2; default ``elem``)."""
    if dp <= 1:
        return 0.0
    r = elem if reduce_elem is None else reduce_elem
    w = elem if gather_elem is None else gather_elem
    reduced = 2 if level < 2 else 1        # all-reduce, or reduce-scatter (units below)
    moved = _MOVED[level] - (1 if secondary and level == 3 else 0)
    return (reduced * r + (moved - reduced) * w) * (dp - 1) / dp * n


def zero_exposed_s(n: int, elem: int, level: int, dp: int, link_Bps: float,
                   fwd_compute_s: float, bwd_compute_s: float,
                   reduce_elem: Optional[int] = None) -> float:
    """Seconds per step a block's data parallelism adds at ``level`` on a link of
    ``link_Bps`` bytes/s, overlap-aware as the TP collectives are: level 3's forward
    all-gather hides behind the previous block's forward (prefetch), its backward
    all-gather and the gradient reduction behind the block's backward; levels 0-2
    reduce during backward too, and 1-2 add the all-gather after the optimizer step,
    which nothing hides."""
    if dp <= 1:
        return 0.0
    piece = (dp - 1) / dp * n * elem / link_Bps       # one all-gather or reduce-scatter
    r = elem if reduce_elem is None else reduce_elem
    reduce = 2 * piece * r / elem                     # all-reduce (or RS on NCCL: piece)
    if level == 0:
        return max(0.0, reduce - bwd_compute_s)
    if level in (1, 2):
        return max(0.0, reduce - bwd_compute_s) + piece
    return max(0.0, piece - fwd_compute_s) + max(0.0, piece + reduce - bwd_compute_s)


# ---- the cost model's rows (oases.planner.cost.CostModel) ----------------------------

def held_per_param(run, G: int) -> float:
    """Bytes per parameter a rank holds between steps for a block whose gradient group
    has G ranks, at the run's ZeRO level, weights and secondary shard (16 at level 0
    with fp32 weights: parameter, gradient and two Adam moments)."""
    rows = zero_memory(1, 4, run.zero, G, run.secondary, run.act_bytes,
                       run.weight_bytes if run.weight_bytes < 4 else None)
    return sum(rows.values())


def reduce_s(cm, n: float, groups: list) -> float:
    """Levels 2-3: the gradients reduce-scattered (a ring moves an all-gather's bytes)."""
    return max(cm.comm.all_gather(n * cm.run.grad_reduce_bytes, g) for g in groups) + cm.call_s


def gather_elem(run) -> int:
    """Bytes per element of the parameter gathers: level 3 gathers in the compute dtype
    (either bf16 mode); levels 1-2 gather the parameters as they are held."""
    return run.act_bytes if run.zero >= 3 else run.weight_bytes


def step_s(cm, n: float, groups: list, fwd: float) -> float:
    """Once per step, after the reduction: the post-step all-gather of levels 1-2 (all
    launched after the optimizer step, in forward order; the store waits for a block's
    before its first use, so it hides behind the blocks before it: what outlasts one
    block's forward is exposed), and under a level-3 secondary shard what the step's
    first gather, over the whole group, adds beyond a node gather (hidden alike)."""
    if max(len(g) for g in groups) < 2:  # no replicas: the runtime runs level 0
        return 0.0
    run = cm.run
    if run.zero in (1, 2):
        ag = max(cm.comm.all_gather(n * gather_elem(run), g) for g in groups)
        return max(0.0, ag - fwd) + cm.call_s
    if run.zero == 3 and run.secondary:
        whole = max(cm.comm.all_gather(n * gather_elem(run), g) for g in groups)
        node = max(cm.comm.all_gather(n * gather_elem(run), g[:run.secondary]) for g in groups)
        return max(0.0, whole - fwd) - max(0.0, node - fwd)
    return 0.0


def micro_batch_s(cm, n: float, groups: list, fwd: float, bwd: float) -> float:
    """Level 3, per micro-batch: the block's gathers before its forward and before its
    backward (recompute reuses the backward's), each prefetched behind a block's
    compute; over the node's ranks under a secondary shard."""
    if max(len(g) for g in groups) < 2:  # no replicas: the runtime runs level 0
        return 0.0
    run = cm.run
    if run.zero < 3:
        return 0.0
    ranks = [g[:run.secondary] if run.secondary else g for g in groups]
    ag = max(cm.comm.all_gather(n * gather_elem(run), g) for g in ranks)
    ag += cm.call_s if ag else 0.0
    return max(0.0, ag - fwd) + max(0.0, ag - bwd)


def zero_variants(levels: tuple, reduce_bytes: tuple, secondary: str, node_ranks: int,
                  mesh_dp: int, tp: int) -> list[tuple[int, int, int]]:
    """(level, secondary L, reduce bytes) a layout may run: ``levels`` (1-3 only where
    the parameters have replicas, ``mesh_dp`` > 1) x ``reduce_bytes`` (where they are
    summed at all); at level 3 a node-local secondary shard where the DP group spans
    nodes of ``node_ranks`` devices (L = its ranks on one node): ``secondary`` "node"
    (always there), "search" (with and without) or "none"."""
    if mesh_dp < 2:
        return [(0, 0, reduce_bytes[0])]
    L = node_ranks // tp if node_ranks and node_ranks % tp == 0 else 0
    spans = 1 <= L < mesh_dp and mesh_dp % L == 0
    out = []
    for z in levels:
        for r in reduce_bytes:
            if not (z == 3 and spans and secondary == "node"):
                out.append((z, 0, r))
            if z == 3 and spans and secondary != "none":
                out.append((z, L, r))
    return out
