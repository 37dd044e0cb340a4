"""Predicted against measured on the emulated cluster, for the planner benchmarks
(``python -m benchmarks.planner``, ``python -m benchmarks.planner_layouts``): train.py
runs that return their step times, rank correlation and error of a prediction, and
the loop over cluster files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from benchmarks.lib import driver
from emucluster import ClusterError, EmulatedCluster, check_prerequisites, free_port


def train_steps(c: EmulatedCluster, ov: list[str], out_dir: Path, timeout: float, warmup: int,
                env: dict | None = None) -> list[float]:
    """``train.py ov`` on every node of ``c`` (its ``out_dir=`` is ``out_dir``): node 0's
    output goes to ``<out_dir>.log``; returns the step times after ``warmup`` steps, or
    raises with the output's last lines when a node failed."""
    port = free_port()
    res = c.run(lambda i: c.torchrun_command(i, ov, "train.py", port), timeout=timeout, env=env)
    (out_dir.parent / f"{out_dir.name}.log").write_text(res[0].output)
    if not all(r.ok for r in res):
        tail = "\n".join(res[0].output.strip().splitlines()[-5:])
        raise RuntimeError(f"run {out_dir.name} failed:\n{tail}")
    recs = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln]
    return [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > warmup]


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):  # average ranks for ties
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def accuracy(plans: list[dict], key: str) -> dict:
    pred = [p[key] for p in plans]
    meas = [p["measured_s"] for p in plans]
    return {"spearman": spearman(pred, meas), "n_plans": len(plans),
            "mean_rel_error": statistics.mean(abs(p - m) / m for p, m in zip(pred, meas))}


def repeat_consistency(plans: list[dict]) -> list[float]:
    """Spearman between the measured times of every two repeats: how well the
    measurement itself ranks the plans (a ceiling for the prediction's)."""
    reps = list(zip(*[p["measured_repeats_s"] for p in plans]))
    return [spearman(list(a), list(b)) for i, a in enumerate(reps) for b in reps[i + 1:]]


def measure_plans(c: EmulatedCluster, cluster_name: str, names: list[str], repeats: int,
                  train: Callable[[str, int], list[float]],
                  describe: Callable[[str], tuple[str, float]]) -> dict[str, list[float]]:
    """Every plan ``train(name, round)`` once per round, plans interleaved round-robin on
    the cluster ``c`` that is up; per plan, the median step time of each round.
    ``describe(name)``: (its layout as printed, its predicted step time)."""
    def one(_, name, rnd):
        t0 = time.monotonic()
        times = train(name, rnd)
        return {"mode": name, "ok": True, "measured_s": statistics.median(times),
                "wall_s": time.monotonic() - t0}

    def line(rec, minutes):
        label, predicted = describe(rec["mode"])
        return (f"[{cluster_name}] rep {rec['round'] + 1}/{repeats} {rec['mode']} {label}: "
                f"{1e3 * rec['measured_s']:.1f} ms/step (predicted {1e3 * predicted:.1f}) "
                f"[{rec['wall_s']:.0f}s]")

    runs = driver.run_rounds([(lambda: contextlib.nullcontext(c), names)], repeats, one, line,
                             catch_interrupt=False)[0]
    return {k: [r["measured_s"] for r in runs if r["mode"] == k] for k in names}


@dataclasses.dataclass
class Validation:
    """A planner benchmark: ``topology(cluster file, args, work dir)`` measures one
    cluster's plans into its result, ``render(prefix, data)`` writes the report from
    ``{"meta", <key>: [results]}`` alone (``refresh(data, args)``: the summaries
    recomputed first, for ``--from-json``)."""
    name: str                      # benchmarks/results/<name>.{json,md,png}
    module: str
    key: str                       # the results' key in the JSON
    model: dict                    # the GPT's defaults, one ``--<key>`` option each
    clusters: list[str]
    topology: Callable[..., dict]
    render: Callable[[Path, dict], Optional[str]]
    refresh: Optional[Callable[[dict, object], dict]] = None
    quick: bool = False            # --quick: 1 repeat, 4 steps, 3 random plans, 1 cluster


def main(v: Validation, doc: str, argv=None) -> int:
    """Parse the options, measure every cluster in turn and save the results after each
    (partial results survive a later failure); ``--from-json``: the report again."""
    ap = driver.parser(doc)
    ap.add_argument("--clusters", nargs="+", default=v.clusters, help="cluster files")
    driver.run_flags(ap, steps=6, warmup=2, vocab=False)
    ap.add_argument("--random", type=int, default=5, help="random plans per cluster")
    ap.add_argument("--seed", type=int, default=0)
    for k, val in v.model.items():
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=val)
    if v.quick:
        ap.add_argument("--quick", action="store_true",
                        help="1 repeat, 4 steps, 3 random plans, the first cluster only")
    driver.report_flags(ap, v.name)
    args = ap.parse_args(argv)
    if args.from_json:
        refresh = v.refresh and (lambda data: v.refresh(data, args.workdir))
        return driver.rerender(Path(args.from_json), v.render, refresh, out=args.out)
    if getattr(args, "quick", False):
        args.repeats, args.steps, args.warmup, args.random = 1, 4, 1, 3
        args.clusters = args.clusters[:1]
    driver.check_run_flags(ap, args)
    out, work = driver.out_prefix(args, v.name), driver.workdir(args, v.name)
    try:
        check_prerequisites()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"machine": f"{platform.node()} ({platform.machine()}, 2 cores shared)",
            "command": driver.command(v.module, argv), "date": time.strftime("%Y-%m-%d %H:%M"),
            "model": {k: getattr(args, k) for k in v.model},
            **{k: getattr(args, k) for k in ("steps", "warmup", "repeats", "random")},
            "json": str(out.with_suffix(".json"))}   # notes beside it: driver.analysis
    results: list[dict] = []
    for path in args.clusters:
        results.append(v.topology(path, args, work))
        driver.save(out, {"meta": meta, v.key: results}, v.render, show=False)
    for r in results:
        print(f"{r['cluster']}: spearman {r['spearman']:.3f}, mean rel error "
              f"{100 * r['mean_rel_error']:.1f}%")
    print(f"wrote {out.with_suffix('.md')}")
    return 0


def plot(results: list[dict], png: Path, picks: Callable[[str], bool]) -> Optional[str]:
    """Predicted against measured per cluster, one panel each: ``picks`` in red, the
    uniform plans in blue."""
    plt = driver.matplotlib_pyplot()
    if plt is None:
        return "matplotlib is not installed (pip install -e '.[bench]'): no chart"
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4.4), squeeze=False)
    for ax, r in zip(axes[0], results):
        for p in r["plans"]:
            col = ("tab:red" if picks(p["name"]) else
                   "tab:blue" if p["name"].startswith("uniform") else "tab:gray")
            x, y = 1e3 * p["predicted_s"], 1e3 * p["measured_s"]
            ax.scatter(x, y, color=col)
            ax.annotate(p["name"].replace("uniform-", "u-"), (x, y), fontsize=6)
        vals = [v for p in r["plans"] for v in (p["predicted_s"], p["measured_s"])]
        lo, hi = 1e3 * min(vals) * 0.9, 1e3 * max(vals) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8)
        ax.set_xlabel("predicted step (ms)")
        ax.set_ylabel("measured step (ms)")
        ax.set_title(f"{r['cluster']}: rho {r['spearman']:.2f}, err "
                     f"{100 * r['mean_rel_error']:.0f}%", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return None
