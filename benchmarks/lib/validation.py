"""Predicted against measured on the emulated cluster, for the planner benchmarks
(``python -m benchmarks.planner``, ``python -m benchmarks.planner_layouts``): train.py
runs that return their step times, rank correlation and error of a prediction, and
the loop over cluster files."""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from benchmarks.lib import driver
from benchmarks.emucluster import ClusterError, EmulatedCluster, check_prerequisites, free_port


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


def measure_clusters(clusters: list[str], measure, write) -> Optional[list[dict]]:
    """``measure(path)`` for each cluster file in turn, ``write(results so far)`` after
    each (partial results survive a later failure); None, with the reason printed, when
    this host cannot run the emulated cluster."""
    try:
        check_prerequisites()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    results: list[dict] = []
    for path in clusters:
        results.append(measure(path))
        write(results)
    return results


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


def add_flags(ap, model: dict) -> None:
    """The planner benchmarks' options; ``model``: the GPT's defaults (``--d-model`` ...)."""
    ap.add_argument("--clusters", nargs="+", help="cluster files")
    ap.add_argument("--repeats", type=int, default=3, help="rounds, plans round-robin")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--random", type=int, default=5, help="random plans per cluster")
    ap.add_argument("--seed", type=int, default=0)
    for k, v in model.items():
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=int, default=v)
    ap.add_argument("--run-timeout", type=float, default=300.0)
    ap.add_argument("--work", help="run directories (default /tmp/<benchmark>/<time>)")
    ap.add_argument("--out", help="output prefix")


def plot(results: list[dict], png: Path, picks: Callable[[str], bool]) -> None:
    """Predicted against measured per cluster, one panel each: ``picks`` in red, the
    uniform plans in blue."""
    plt = driver.matplotlib_pyplot()
    if plt is None:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
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
