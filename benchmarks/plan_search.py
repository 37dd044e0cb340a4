"""How long the layout search takes (cost model only: no cluster, no profiling),
against exhaustive enumeration.

    .venv/bin/python benchmarks/plan_search.py [--repeats 3] [--budget 6] [--max-exhaustive-s 60]

Three problems, each searched with ``--search uniap`` and ``amp`` on an analytic
profile (FLOP counts at 400 TFLOP/s, bf16), 2400 Gbit/s inside a node and 200 Gbit/s
between nodes:

    8 layers x 8 devices     the Llama-2-7B layer, 8 layers, global batch 32, 2 nodes
                             of 4 devices with 12 GiB (small enough to enumerate; the
                             memory makes it pipeline and the MILP run)
    32 layers x 16 devices   the Llama-2-7B shape, global batch 128, nodes of 8 x 80 GiB
    96 layers x 64 devices   a GPT-3-175B shape (d 12288, 96 heads), global batch 512,
                             nodes of 8 x 80 GiB

Reports the layouts enumerated, MILPs solved, solver and total seconds (median of
``--repeats``) and the chosen layout against the best uniform one and AMP's pick.

Against exhaustive enumeration (:func:`oases.planner.search.exhaustive`: every
outer choice x contiguous partition of the layers into pp stages x TP degree per
layer, each plan priced on the cost model and checked against the memory limits):
the plans in the space are counted exactly (sum over choices of C(L-1, pp-1) S^L);
the rate of pricing plans is measured per problem on a sample of its own plans
(drawn in proportion to the choices' shares of the space). Where the space at that
rate would take over ``--max-exhaustive-s`` it is not enumerated: its time is an
estimate (plans / rate); otherwise it is enumerated ``--repeats`` times (building
the problems included, as in the search's total) and its optimum compared with
the searches' picks. Writes ``benchmarks/results/plan_search.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from oases.planner.cluster import Cluster  # noqa: E402
from oases.planner.cost import ModelShape  # noqa: E402
from oases.planner.fit import analytic_profile  # noqa: E402
from oases.planner.search import exhaustive, search, space_size  # noqa: E402
from oases.planner.stages import Job, build, enumerate_choices, profile_run  # noqa: E402
from oases.planner.uniap import evaluate  # noqa: E402

LLAMA7B = dict(d_model=4096, n_head=32, n_kv_heads=32, ffn_hidden=11008, vocab_size=32000,
               seq_len=4096, tie_embeddings=False, bias=False)
# name -> (shape, nodes, devices per node, GiB per device, global batch)
PROBLEMS = {
    "8 layers x 8 devices": (ModelShape("llama", 8, **LLAMA7B), 2, 4, 12.0, 32),
    "32 layers x 16 devices": (ModelShape("llama", 32, **LLAMA7B), 2, 8, 80.0, 128),
    "96 layers x 64 devices": (ModelShape("gpt", 96, 12288, 96, 96, 49152, 50257, 2048),
                               8, 8, 80.0, 512),
}


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


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**9 else f"{float(n):.3e}"


def _seconds(e: dict) -> str:
    if e["measured"]:
        return f"{e['exhaustive_s']:.2f} (measured, {e['measured_rate']:,.0f} plans/s)"
    years = e["estimate_s"] / (365.25 * 86400)
    return (f"estimated {e['estimate_s']:.2e} s ({years:.1e} years) at "
            f"{e['rate_plans_per_s']:,.0f} plans/s; not run")


def _vs_optimum(e: dict) -> str:
    if not e["measured"]:
        return "unknown (not enumerated)"
    return f"uniap {e['uniap_vs_optimum']:+.2e}, amp {e['amp_vs_optimum']:+.2e}"


def markdown(meta: dict, rows: list, exh: list) -> str:
    lines = ["# Layout search time (cost model only)", "",
             f"Machine: {meta['machine']}; command: `{meta['command']}`; median of "
             f"{meta['repeats']}; MILP budget {meta['budget_s']} s per search.", "",
             "| problem | search | layouts | MILPs | solver (s) | total (s) | uniform / plan "
             "| AMP / plan | plan |", "|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda v: "none fits" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['problem']} | {r['method']} | {r['layouts']} | {r['milps']} | "
                     f"{r['solve_s']:.2f} | {r['total_s']:.2f} | {ratio(r['vs_uniform'])} | "
                     f"{ratio(r['vs_amp'])} | {r['plan'].replace(' | ', '; ')} |")
    lines += ["", "## Against exhaustive enumeration", "",
              "Every outer choice x contiguous partition of the layers into pp stages x TP "
              "degree per layer, each plan priced on the cost model and checked against the "
              "memory limits (`oases.planner.search.exhaustive`). Plans in the space are "
              "exact (sum over choices of C(L-1, pp-1) S^L). The rate of pricing is measured "
              "on a sample of each problem's own plans; where the space would take over "
              f"{meta['max_exhaustive_s']:g} s at that rate it is not enumerated and its "
              "time is an **estimate** (plans / rate). Measured times are medians of "
              f"{meta['repeats']} and include building the problems, as the search's total "
              "does. Speed-up: exhaustive seconds / `uniap` total seconds. Pick vs optimum: "
              "(predicted time of the search's pick - exhaustive optimum) / optimum.", "",
              "| problem | plans in the space | exhaustive (s) | uniap (s) | speed-up "
              "| pick vs optimum |", "|---|---|---|---|---|---|"]
    for e in exh:
        lines.append(f"| {e['problem']} | {_count(e['plans'])} | {_seconds(e)} | "
                     f"{e['uniap_s']:.2f} | {e['speedup']:.3g}x"
                     f"{'' if e['measured'] else ' (estimate)'} | {_vs_optimum(e)} |")
    for e in exh:
        if e["measured"]:
            lines += ["", f"{e['problem']}: the sampled rate was {e['rate_plans_per_s']:,.0f} "
                      f"plans/s against {e['measured_rate']:,.0f} measured over the whole "
                      f"space (building included); the optimum: {e['optimum_plan']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=6.0, help="MILP seconds per search")
    ap.add_argument("--max-exhaustive-s", type=float, default=60.0,
                    help="enumerate a space only if its estimated time is at most this")
    args = ap.parse_args()
    rows = []
    for name in PROBLEMS:
        for method in ("uniap", "amp"):
            runs = [run(name, method, args.budget) for _ in range(args.repeats)]
            row = dict(runs[-1])
            for k in ("solve_s", "total_s"):
                row[k] = statistics.median(r[k] for r in runs)
            rows.append(row)
            print(f"{name} {method}: {row['total_s']:.2f} s ({row['milps']} MILPs, solver "
                  f"{row['solve_s']:.2f} s) -> {row['plan']}", flush=True)
    exh = []
    for name in PROBLEMS:
        exh.append(against_exhaustive(name, rows, args.repeats, args.max_exhaustive_s))
        e = exh[-1]
        print(f"{name} exhaustive: {_count(e['plans'])} plans, {_seconds(e)}; speed-up "
              f"{e['speedup']:.3g}x; {_vs_optimum(e)}", flush=True)
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "command": " ".join(["python benchmarks/plan_search.py", *sys.argv[1:]]),
            "repeats": args.repeats, "budget_s": args.budget,
            "max_exhaustive_s": args.max_exhaustive_s}
    (out / "plan_search.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                      "exhaustive": exh}, indent=1))
    (out / "plan_search.md").write_text(markdown(meta, rows, exh))


if __name__ == "__main__":
    main()
