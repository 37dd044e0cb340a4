"""The layout search's timing problems and the exhaustive reference it is measured against
(``python -m benchmarks.plan_search``): the problems, one timed search, the priced
enumeration, its sampled rate, and how the report words each figure."""

from __future__ import annotations

import random
import statistics
import time

from oases.planner.cluster import Cluster
from oases.planner.cost import ModelShape
from oases.planner.fit import analytic_profile
from oases.planner.search import exhaustive, search, space_size
from oases.planner.stages import Job, build, enumerate_choices, profile_run
from oases.planner.uniap import evaluate

LLAMA7B = dict(d_model=4096, n_head=32, n_kv_heads=32, ffn_hidden=11008, vocab_size=32000,
               seq_len=4096, tie_embeddings=False, bias=False)
# name -> (shape, nodes, devices per node, GiB per device, global batch)
PROBLEMS = {
    "8 layers x 8 devices": (ModelShape("llama", 8, **LLAMA7B), 2, 4, 12.0, 32),
    "32 layers x 16 devices": (ModelShape("llama", 32, **LLAMA7B), 2, 8, 80.0, 128),
    "96 layers x 64 devices": (ModelShape("gpt", 96, 12288, 96, 96, 49152, 50257, 2048),
                               8, 8, 96.0, 512),
}
MEMORY_NOTE = ("The 96-layer problem's devices have 96 GiB: with Adam and no ZeRO its only "
               "layouts that fit are pp 8 x tp 8 with uneven stages, whose first stages need "
               "76.7-79.7 GiB, and of an 80 GiB device the planner leaves a plan 75 GiB "
               "(5% and 1 GiB of headroom, `oases.planner.cluster.usable_bytes`): on 80 GiB "
               "devices no layout fits.")


def setup(name: str):
    """(job, cluster, profile, profiled run) of one problem."""
    shape, nodes, per_node, gib, batch = PROBLEMS[name]
    job = Job(shape, batch, 2, "oases", "fine", act_bytes=2)
    cluster = Cluster("bench", nodes, per_node, gib, 2400.0, 200.0)
    base = profile_run(job, per_node, 8)
    prof = analytic_profile(shape, base, shape.valid_degrees(per_node), flops_per_s=400e12)
    return job, cluster, prof, base


def problems(name: str) -> list:
    """One :class:`~oases.planner.stages.Problem` per outer choice, as the search builds them."""
    job, cluster, prof, base = setup(name)
    return [build(job, ch, cluster, prof, base)
            for ch in enumerate_choices(job, cluster.world, max_tp=base.tp)]


def run(name: str, method: str, budget: float) -> dict:
    job, cluster, prof, base = setup(name)
    res = search(job, cluster.world, cluster, prof, base, method=method, budget_s=budget,
                 log=lambda s: None)
    best = res.best
    return {"problem": name, "method": method, "layouts": res.choices, "milps": res.milps,
            "solve_s": res.solve_s, "total_s": res.total_s, "plan": best.describe(),
            "source": best.source, "time_s": best.time,
            "vs_uniform": res.megatron.time / best.time if res.megatron else None,
            "vs_amp": res.amp.time / best.time if res.amp else None}


def run_exhaustive(name: str) -> dict:
    """Build every choice's problem and price every plan (timed together)."""
    t0 = time.perf_counter()
    best, priced = exhaustive(problems(name))
    return {"total_s": time.perf_counter() - t0, "priced": priced,
            "time_s": best.time if best else None, "plan": best.describe() if best else None}


def price_rate(probs: list, n: int = 4000, seed: int = 0) -> float:
    """Plans priced per second, as :func:`exhaustive` prices them (time and memory of
    one plan, checked against the limits), on ``n`` plans of ``probs`` drawn with each
    choice weighted by its share of the space: the rate the enumeration would run at."""
    rng = random.Random(seed)
    weights = [float(space_size([p])) for p in probs]
    plans = []
    for prob in rng.choices(probs, weights=weights, k=n):
        L, P = prob.inst.L, prob.inst.stages
        starts = [0] + sorted(rng.sample(range(1, L), P - 1))
        plans.append((prob, starts, [rng.randrange(prob.inst.S) for _ in range(L)]))
    best = float("inf")
    t0 = time.perf_counter()
    for prob, starts, strat in plans:  # exhaustive's inner loop
        t, used = evaluate(prob.inst, starts, strat)
        if t + prob.constant < best and all(u <= m for u, m in zip(used, prob.inst.memory_limit)):
            best = t + prob.constant
    return n / (time.perf_counter() - t0)


def against_exhaustive(name: str, rows: list, repeats: int, max_s: float) -> dict:
    probs = problems(name)
    plans, rate = space_size(probs), price_rate(probs)
    by = {r["method"]: r for r in rows if r["problem"] == name}
    uniap_s = by["uniap"]["total_s"]
    out = {"problem": name, "plans": plans, "rate_plans_per_s": rate,
           "estimate_s": plans / rate, "measured": plans / rate <= max_s,
           "uniap_s": uniap_s, "amp_s": by["amp"]["total_s"]}
    if out["measured"]:
        runs = [run_exhaustive(name) for _ in range(repeats)]
        got = runs[-1]
        assert got["priced"] == plans, (got["priced"], plans)
        best = got["time_s"]
        out.update(exhaustive_s=statistics.median(r["total_s"] for r in runs),
                   measured_rate=plans / statistics.median(r["total_s"] for r in runs),
                   optimum_time_s=best, optimum_plan=got["plan"],
                   uniap_vs_optimum=(by["uniap"]["time_s"] - best) / best,
                   amp_vs_optimum=(by["amp"]["time_s"] - best) / best)
    seconds = out["exhaustive_s"] if out["measured"] else out["estimate_s"]
    out["speedup"] = seconds / uniap_s
    return out


def count_text(n: int) -> str:
    return f"{n:,}" if n < 10**9 else f"{float(n):.3e}"


def seconds_text(e: dict) -> str:
    if e["measured"]:
        return f"{e['exhaustive_s']:.2f} (measured, {e['measured_rate']:,.0f} plans/s)"
    years = e["estimate_s"] / (365.25 * 86400)
    return (f"estimated {e['estimate_s']:.2e} s ({years:.1e} years) at "
            f"{e['rate_plans_per_s']:,.0f} plans/s; not run")


def vs_optimum_text(e: dict) -> str:
    if not e["measured"]:
        return "unknown (not enumerated)"
    return f"uniap {e['uniap_vs_optimum']:+.2e}, amp {e['amp_vs_optimum']:+.2e}"
