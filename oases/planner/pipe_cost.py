"""What the pipeline schedule changes in a plan's price: its time and its memory rows.

The planner prices a plan with UniAP's time per iteration (:mod:`oases.planner.uniap`),
T_p stage p's forward and backward of one micro-batch, O_p the transfer at its cut,
W_p the weight-gradient (W) part of T_p, c micro-batches, v chunks per rank:

    time = alpha sum_p T_p + sum_p O_p + beta max(T_0.., O_0..) - kappa sum_p W_p

    gpipe, 1f1b, eager-1f1b  alpha 1, beta c - 1, kappa 0    (UniAP's TPI)
    zb-h1, eager-zb-h1       alpha 1, beta c - 1, kappa 2 (P - 1) / P
    interleaved-1f1b         alpha 1/v, beta c - 1/v, kappa 0

For P equal stages (T = F + B + W each) without transfers that is the makespan of
:func:`oases.pipeline.actions.simulate` (tests/test_planner_schedules.py checks
:func:`makespan` against it): 1F1B's bubble is (P - 1) T, ZB-H1's (P - 1)(F + B - W)
(Qi et al. 2024: only B is on the path back through the stages, and the W's fill the
cool-down), Megatron's interleaved one (P - 1) T / v. ZB-H1's needs W <= F and W <= B,
which :meth:`oases.planner.cost.CostModel.wgrad_time` keeps. Eager warm-ups change
neither: they hide transfers, which this model does not charge per micro-batch. Spread
over the stages (2 (P - 1) / P of every stage's W, not 2 W of all but one stage) the
zero-bubble term stays linear in the MILP's variables; with unequal stages it is an
estimate, as UniAP's TPI is for 1F1B.

Memory. What a stage holds depends only on the order of its own computes
(:func:`oases.pipeline.schedules.compute_order`), not on timing: walking it gives the
states (f, q) it passes through, f micro-batches with F done and B not (a whole
activation each), q with B done and W not (the linear layers' X and dY each,
:mod:`oases.parallel.wgrad`). The stage's peak is the largest over its Pareto-maximal
states, one memory row each (:func:`pipeline_states`):

    gpipe             (c, 0)
    1f1b              (min(c, P - p), 0)
    eager-1f1b        (min(c, 2 (P - p) - 1), 0)
    zb-h1 (c >= P)    (P - p, p) and (P - p - 1, p + 1): right after B(k), before W(k - p);
                      so the W's bytes cost beyond 1F1B's only where they exceed an
                      activation's (under recompute)
    eager-zb-h1       the same over eager-1F1B's f
    interleaved-1f1b  (min(v c, (v - 1) P + 2 (P - p) - 1) / v, 0): Megatron's chunks in
                      flight, each 1/v of the stage
"""

from __future__ import annotations

from functools import lru_cache

from oases.errors import ConfigError
from oases.pipeline.schedules import SPLIT_KINDS, compute_order


def time_weights(kind: str, P: int, c: int, virtual: int = 1) -> tuple[float, float, float]:
    """(alpha, beta, kappa) of the module docstring."""
    kappa = 2 * (P - 1) / P if kind in SPLIT_KINDS else 0.0
    return (1.0, c - 1.0, kappa) if virtual == 1 else (1 / virtual, c - 1 / virtual, kappa)


def makespan(kind: str, P: int, c: int, f: float, b: float, w: float = 0.0,
             virtual: int = 1) -> float:
    """The time per iteration the planner predicts for P equal stages, each F = f, B = b
    (the input-gradient part) and W = w per micro-batch, no transfers."""
    alpha, beta, kappa = time_weights(kind, P, c, virtual)
    t = f + b + w
    return alpha * P * t + beta * t - kappa * P * w


def memory_states(kind: str, P: int, p: int, c: int, virtual: int = 1) -> list[tuple]:
    """Stage p's Pareto-maximal (f, q) (module docstring), f in stages' worth (chunks / v)."""
    f = q = 0
    seen = set()
    for a in compute_order(kind, P, p, c, virtual):
        if a.kind == "F":
            f += 1
        elif a.kind == "B":
            f -= 1
            q += kind in SPLIT_KINDS
        else:
            q -= 1
        seen.add((f, q))
    top = [s for s in seen if not any(o != s and o[0] >= s[0] and o[1] >= s[1] for o in seen)]
    return sorted((f / virtual, float(q)) for f, q in top)


@lru_cache(maxsize=256)
def pipeline_states(kind: str, P: int, c: int, virtual: int = 1) -> list[list[tuple]]:
    """:func:`memory_states` of every stage; :class:`ConfigError` where the generators
    refuse the schedule (naming why)."""
    try:
        return [memory_states(kind, P, p, c, virtual) for p in range(P)]
    except ValueError as e:
        raise ConfigError(f"pipeline schedule {kind} at {P} stages, {c} micro-batches, "
                          f"{virtual} chunks per rank: {e}") from None
