"""What the layout search tells the user: Plan files and the printed summary. Pure Python.

A :class:`~oases.planner.search.Candidate` becomes a :class:`Plan` with
``stages`` when pp > 1 (per-block ``degrees`` when pp = 1) and the run it was
priced for (``pp``, ``tp``, ``cp``, ``micro_batch_size``, ``micro_batches``), which
:func:`run_overrides` spells as the ``train.py`` overrides that run it.
"""

from __future__ import annotations

from typing import Optional

from oases.planner.plan_file import Plan, model_dict
from oases.planner.search import Candidate, SearchResult, mesh

GIB = 2**30


def run_overrides(c: Candidate) -> list[str]:
    """The dotted overrides a run of this layout needs besides ``parallel.plan``."""
    ch = c.choice
    # cp always: a config's own parallel.cp would otherwise run the plan at another degree
    return [f"parallel.pp={ch.pp}", f"parallel.tp={ch.tp}", f"parallel.cp={ch.cp}",
            f"train.micro_batch_size={ch.rows}",
            f"train.grad_accum={ch.micro_batches}",
            *([f"parallel.pp_schedule={c.schedule}"] if ch.pp > 1 else []),
            *([f"parallel.pp_virtual={c.virtual}"] if ch.pp > 1 and c.virtual > 1 else []),
            *([f"parallel.zero={ch.zero}"] if ch.zero else []),
            *(["parallel.zero_secondary=node"] if ch.secondary else []),
            *(["parallel.grad_reduce_dtype=bf16"] if ch.reduce_bytes == 2 else [])]


def _brief(c: Optional[Candidate], ref: Candidate) -> Optional[dict]:
    if c is None:
        return None
    ch = c.choice
    return {"pp": ch.pp, "dp": ch.dp, "cp": ch.cp, "tp": ch.tp,
            "micro_batches": ch.micro_batches,
            "stages": [[a, b] for a, b in c.ranges()], "degrees": c.degrees,
            "step_time_s": c.time, "vs_plan": c.time / ref.time}


def limits(c: Candidate) -> list[float]:
    """Memory per device each stage may use (the instance's limits are what is left
    after the embedding, head and transient peak)."""
    return [lim + k for lim, k in zip(c.problem.inst.memory_limit, c.problem.memory_const)]


def to_plan(c: Candidate, res: SearchResult, cfg, cluster_name: str) -> Plan:
    ch = c.choice
    blocks = [d for d in c.degrees for _ in (0, 1)]
    predicted = {
        "step_time_s": c.time, "memory_gib": [m / GIB for m in c.memory],
        "memory_limit_gib": [v / GIB for v in limits(c)],
        "search": res.method, "source": c.source, "status": c.status or "exact",
        "gap": c.gap, "solve_s": res.solve_s, "search_s": res.total_s,
        "layouts": res.choices, "milps": res.milps,
        "best_uniform": _brief(res.megatron, c), "amp": _brief(res.amp, c),
        "run": " ".join(run_overrides(c))}
    return Plan(degrees=blocks if ch.pp == 1 else [], tp=ch.tp, model=model_dict(cfg.model),
                stages=c.stages() if ch.pp > 1 else [], schedule=cfg.parallel.schedule,
                recompute=cfg.parallel.recompute, micro_batch_size=ch.rows,
                sub_batches=cfg.sub_batches, pp=ch.pp, micro_batches=ch.micro_batches,
                cluster=cluster_name, predicted=predicted,
                sequence_parallel=any(m.run.sequence_parallel for m in c.problem.models),
                pp_schedule=c.schedule if ch.pp > 1 else "",
                pp_virtual=c.virtual if ch.pp > 1 else 1, cp=ch.cp,
                zero=[ch.zero] * (2 * cfg.model.n_layer + 2) if ch.zero else [],
                zero_secondary="node" if ch.secondary else "none",
                grad_reduce_dtype="bf16" if ch.reduce_bytes == 2 else "fp32")


def _line(name: str, c: Optional[Candidate], ref: Candidate) -> str:
    if c is None:
        return f"{name}: none fits the memory limit"
    return (f"{name}: {c.describe()}: {1e3 * c.time:.1f} ms per iteration "
            f"({c.time / ref.time:.2f}x the plan's)")


def summary(res: SearchResult, c: Candidate) -> list[str]:
    """The chosen layout stage by stage, its time and memory, the best uniform layout,
    AMP's pick and the solver's effort."""
    ch = c.choice
    w = 12 if ch.cp > 1 else 8  # the mesh column: "dp x cp x tp" under cp
    how = {"uniap": f"MILP, {c.status}" + (f", gap {100 * c.gap:.1f}%" if c.gap else ""),
           "amp": "AMP: one degree for every layer, best partition",
           "megatron": "every layer at tp, even split"}[c.source]
    out = [f"plan: pp {ch.pp} x dp {ch.dp} x {mesh(ch)}, {c.batches()} ({ch.rows} per "
           f"replica) [{how}]",
           f"{'stage':>5} {'layers':>9} {'dp x cp x tp' if ch.cp > 1 else 'dp x tp':>{w}}  "
           f"{'memory (GiB)':>14}  degrees per layer"]
    lims = limits(c)
    for p, ((a, b), degs) in enumerate(zip(c.ranges(), c.stage_degrees())):
        ranks = " x ".join(map(str, (ch.dp, ch.cp, ch.tp) if ch.cp > 1 else (ch.dp, ch.tp)))
        out.append(f"{p:>5} {f'{a}-{b - 1}':>9} {ranks:>{w}}  "
                   f"{f'{c.memory[p] / GIB:.3g} / {lims[p] / GIB:.3g}':>14}  {degs}")
    out.append(f"predicted time per iteration: {1e3 * c.time:.1f} ms")
    out.append(_line("best uniform layout (every layer at tp, even split)", res.megatron, c))
    out.append(_line("AMP's pick (one degree for every layer, best partition)", res.amp, c))
    milp = (f"{res.milps} MILPs ({res.pruned} layouts skipped by their lower bound or the "
            f"budget), solver {res.solve_s:.2f} s, " if res.method == "uniap" else "")
    out.append(f"search {res.method}: {res.choices} layouts, {milp}total {res.total_s:.2f} s")
    return out
