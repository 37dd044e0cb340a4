"""How long the layout search takes (cost model only: no cluster, no profiling).

    .venv/bin/python benchmarks/plan_search.py [--repeats 3] [--budget 6]

Two problems, each searched with ``--search uniap`` and ``amp`` on an analytic
profile (FLOP counts at 400 TFLOP/s, bf16), nodes of 8 devices with 80 GiB,
2400 Gbit/s inside a node and 200 Gbit/s between nodes:

    32 layers x 16 devices   the Llama-2-7B shape, global batch 128
    96 layers x 64 devices   a GPT-3-175B shape (d 12288, 96 heads), global batch 512

Reports the layouts enumerated, MILPs solved, solver and total seconds (median of
``--repeats``) and the chosen layout against the best uniform one and AMP's pick,
to ``benchmarks/results/plan_search.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from oases.planner.cluster import Cluster  # noqa: E402
from oases.planner.cost import ModelShape  # noqa: E402
from oases.planner.fit import analytic_profile  # noqa: E402
from oases.planner.search import search  # noqa: E402
from oases.planner.stages import Job, profile_run  # noqa: E402

PROBLEMS = {
    "32 layers x 16 devices": (ModelShape("llama", 32, 4096, 32, 32, 11008, 32000, 4096,
                                          False, False), 2, 128),
    "96 layers x 64 devices": (ModelShape("gpt", 96, 12288, 96, 96, 49152, 50257, 2048),
                               8, 512),
}


def run(name: str, method: str, budget: float) -> dict:
    shape, nodes, batch = PROBLEMS[name]
    job = Job(shape, batch, 2, "oases", "fine", act_bytes=2)
    cluster = Cluster("bench", nodes, 8, 80.0, 2400.0, 200.0)
    base = profile_run(job, 8, 8)
    prof = analytic_profile(shape, base, shape.valid_degrees(8), flops_per_s=400e12)
    res = search(job, cluster.world, cluster, prof, base, method=method, budget_s=budget,
                 log=lambda s: None)
    best = res.best
    return {"problem": name, "method": method, "layouts": res.choices, "milps": res.milps,
            "solve_s": res.solve_s, "total_s": res.total_s, "plan": best.describe(),
            "source": best.source, "time_s": best.time,
            "vs_uniform": res.megatron.time / best.time if res.megatron else None,
            "vs_amp": res.amp.time / best.time if res.amp else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=6.0, help="MILP seconds per search")
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
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "command": " ".join(["python benchmarks/plan_search.py", *sys.argv[1:]]),
            "repeats": args.repeats, "budget_s": args.budget}
    (out / "plan_search.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["# Layout search time (cost model only)", "",
             f"Machine: {meta['machine']}; command: `{meta['command']}`; median of "
             f"{args.repeats}; MILP budget {args.budget} s per search.", "",
             "| problem | search | layouts | MILPs | solver (s) | total (s) | uniform / plan "
             "| AMP / plan | plan |", "|---|---|---|---|---|---|---|---|---|"]
    ratio = lambda v: "none fits" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['problem']} | {r['method']} | {r['layouts']} | {r['milps']} | "
                     f"{r['solve_s']:.2f} | {r['total_s']:.2f} | {ratio(r['vs_uniform'])} | "
                     f"{ratio(r['vs_amp'])} | {r['plan'].replace(' | ', '; ')} |")
    (out / "plan_search.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
