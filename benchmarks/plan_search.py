"""How long the layout search takes (cost model only: no cluster, no profiling),
against exhaustive enumeration.

    .venv/bin/python -m benchmarks.plan_search [--repeats 3] [--budget 6] [--max-exhaustive-s 60]
        [--out PREFIX] [--from-json FILE]

Three problems, each searched with ``--search uniap`` and ``amp`` on an analytic
profile (FLOP counts at 400 TFLOP/s, bf16), 2400 Gbit/s inside a node and 200 Gbit/s
between nodes:

    8 layers x 8 devices     the Llama-2-7B layer, 8 layers, global batch 32, 2 nodes
                             of 4 devices with 12 GiB (small enough to enumerate; the
                             memory makes it pipeline and the MILP run)
    32 layers x 16 devices   the Llama-2-7B shape, global batch 128, nodes of 8 x 80 GiB
    96 layers x 64 devices   a GPT-3-175B shape (d 12288, 96 heads), global batch 512,
                             nodes of 8 x 96 GiB (on 80 GiB no layout fits: MEMORY_NOTE)

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
the searches' picks. Writes ``<--out>.{json,md}`` (``benchmarks/results/plan_search``);
``--from-json`` writes the .md again from a saved .json.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.machine import machine_info
from benchmarks.lib.search_timing import (MEMORY_NOTE, PROBLEMS, against_exhaustive,
                                          count_text, run, seconds_text, vs_optimum_text)


def render(out: Path, data: dict) -> None:
    out.with_suffix(".md").write_text(markdown(data["meta"], data["rows"], data["exhaustive"]))


def markdown(meta: dict, rows: list, exh: list) -> str:
    lines = [*driver.report_head("# Layout search time (cost model only)", meta),
             f"Median of {meta['repeats']}; MILP budget {meta['budget_s']} s per search. "
             f"{MEMORY_NOTE}", "",
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
        lines.append(f"| {e['problem']} | {count_text(e['plans'])} | {seconds_text(e)} | "
                     f"{e['uniap_s']:.2f} | {e['speedup']:.3g}x"
                     f"{'' if e['measured'] else ' (estimate)'} | {vs_optimum_text(e)} |")
    for e in exh:
        if e["measured"]:
            lines += ["", f"{e['problem']}: the sampled rate was {e['rate_plans_per_s']:,.0f} "
                      f"plans/s against {e['measured_rate']:,.0f} measured over the whole "
                      f"space (building included); the optimum: {e['optimum_plan']}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=float, default=6.0, help="MILP seconds per search")
    ap.add_argument("--max-exhaustive-s", type=float, default=60.0,
                    help="enumerate a space only if its estimated time is at most this")
    ap.add_argument("--out", help="output prefix (default benchmarks/results/plan_search; "
                    "with --from-json: beside the .json)")
    ap.add_argument("--from-json", help="re-write the report from a saved .json; run nothing")
    args = ap.parse_args()
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
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
        print(f"{name} exhaustive: {count_text(e['plans'])} plans, {seconds_text(e)}; speed-up "
              f"{e['speedup']:.3g}x; {vs_optimum_text(e)}", flush=True)
    meta = {"machine": machine_info(), "command": driver.command("benchmarks.plan_search"),
            "repeats": args.repeats, "budget_s": args.budget,
            "max_exhaustive_s": args.max_exhaustive_s}
    driver.save(Path(args.out or driver.RESULTS / "plan_search"), {"meta": meta, "rows": rows, "exhaustive": exh}, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
