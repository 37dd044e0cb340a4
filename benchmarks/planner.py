"""Planner validation on the emulated cluster: predicted vs measured step time.

    sudo .venv/bin/python -m benchmarks.planner                      # 2 nodes, 4 nodes, hetero-4
    sudo .venv/bin/python -m benchmarks.planner --clusters configs/cluster/two-nodes-1g.yaml --repeats 1

Per topology (tp = every node, one process per node, oases + fine):
1. ``train.py parallel.plan=auto`` for one step profiles the live cluster
   (block compute, measured collectives) and writes ``profile.json``;
2. from that profile the cost model predicts the planner's plan, every uniform
   plan and ``--random`` random valid plans; a memory limit where the low
   uniform degrees do not fit adds the planner's plan under that limit;
3. each plan trains ``--steps`` steps, ``--repeats`` times round-robin; the
   measured step time is the median over repeats of the median step time after
   ``--warmup`` steps;
4. reports Spearman rank correlation and mean relative error of predicted vs
   measured, and whether the planner's plan is at least as fast as the best
   uniform plan, to ``benchmarks/results/planner.{md,json,png}``.

Needs root and iproute2 (network namespaces), like emucluster.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path
from typing import Optional

from benchmarks.lib import driver
from emucluster import EmulatedCluster
from benchmarks.lib.validation import (Validation, accuracy, measure_plans, plot,
                                       repeat_consistency, train_steps)
from benchmarks.lib.validation import main as validation_main
from oases.cli.plan import run_shape
from oases.config import load_config
from oases.planner import ilp
from oases.planner.cluster import load_cluster
from oases.planner.cost import CostModel, ModelShape, Profile
from oases.planner.plan_file import Plan, model_dict

REPO = driver.REPO

DEFAULT_CLUSTERS = ["configs/cluster/two-nodes-200m.yaml", "configs/cluster/four-nodes-1g.yaml",
                    "configs/cluster/hetero-4.yaml"]


def overrides(args, tp: int, out_dir: Path, extra: list[str]) -> list[str]:
    return ["--config", "configs/gpt-tiny.yaml", "model.name=gpt-tiny",
            f"model.d_model={args.d_model}", f"model.n_layer={args.n_layer}",
            f"model.n_head={args.n_head}", f"model.n_kv_heads={args.n_head}",
            f"model.ffn_hidden={4 * args.d_model}", f"model.seq_len={args.seq_len}",
            f"parallel.tp={tp}", "parallel.schedule=oases", "parallel.recompute=fine",
            "parallel.device=cpu", f"train.micro_batch_size={args.mbs}", "train.log_interval=1",
            "wandb.mode=disabled", "data.kind=synthetic", "data.val_path=", "eval.interval=0",
            "checkpoint.save_final=false", "checkpoint.interval=0", "resume=none",
            f"out_dir={out_dir}", *extra]


def run_train(c: EmulatedCluster, args, tp: int, out_dir: Path, extra: list[str]) -> list[float]:
    return train_steps(c, overrides(args, tp, out_dir, extra), out_dir, args.run_timeout,
                       args.warmup)


def topology(path: str, args, work: Path) -> dict:
    cluster = load_cluster(path)
    T = cluster.world
    work = work / cluster.name
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_config(None, overrides(args, T, work / "x", [])[2:]).validate(T)
    res: dict = {"cluster": cluster.name, "file": path, "tp": T, "plans": []}
    with EmulatedCluster(path) as c:
        print(f"[{cluster.name}] profiling (parallel.plan=auto, 1 step)", flush=True)
        run_train(c, args, T, work / "auto", ["parallel.plan=auto", "train.steps=1"])
        prof = json.loads((work / "auto" / "profile.json").read_text())
        profile = Profile(prof["blocks"], prof["constant"], prof["comm"])
        cm = CostModel(ModelShape.from_config(cfg.model), run_shape(cfg), cluster, profile)
        cal = prof.get("calibration")
        res["calibration"] = cal
        cm_raw = cm  # the cost model before calibration (the profile alone), for comparison
        if cal:
            comm = dict(prof["comm"], cpu_per_byte=cal["cpu_per_byte_profiled"])
            cm_raw = CostModel(ModelShape.from_config(cfg.model), run_shape(cfg), cluster,
                               Profile(prof["blocks"], prof["constant"], comm))
        plans: dict[str, list[int]] = {}
        sol = ilp.solve(cm)
        plans["planner"] = sol.degrees
        for t in cm.degrees:
            plans[f"uniform-{t}"] = [t] * cm.n
        rng = random.Random(args.seed)
        tries = 0
        while sum(k.startswith("random") for k in plans) < args.random and tries < 1000:
            tries += 1
            p = [rng.choice(cm.degrees) for _ in range(cm.n)]
            if p not in plans.values():
                plans[f"random-{sum(k.startswith('random') for k in plans) + 1}"] = p
        mem = {t: cm.plan_memory([t] * cm.n) for t in cm.degrees}
        order = sorted(cm.degrees, key=lambda t: mem[t])  # cheapest memory first
        limit = None
        if len(order) >= 2:
            # a limit that only the most memory-frugal uniform plan fits
            limit = (mem[order[0]] + mem[order[1]]) / 2
            try:
                lim_sol = ilp.solve(cm, limit)
                plans["planner-memlimit"] = lim_sol.degrees
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                res["memlimit_error"] = str(e)
        res["memory_limit_bytes"] = limit
        res["uniform_memory_bytes"] = {str(t): mem[t] for t in cm.degrees}

        def train(name: str, rnd: int) -> list[float]:
            pf = work / f"{name}.yaml"
            Plan(plans[name], T, model_dict(cfg.model)).save(pf)
            return run_train(c, args, T, work / f"{name}-r{rnd}",
                             [f"parallel.plan={pf}", f"train.steps={args.steps}"])

        measured = measure_plans(c, cluster.name, list(plans), args.repeats, train,
                                 lambda n: (f"{plans[n]}", cm.plan_time(plans[n])))
    for name, degrees in plans.items():
        res["plans"].append({"name": name, "degrees": degrees,
                             "predicted_s": cm.plan_time(degrees),
                             "predicted_uncalibrated_s": cm_raw.plan_time(degrees),
                             "memory_bytes": cm.plan_memory(degrees),
                             "fits_limit": limit is None or cm.plan_memory(degrees) <= limit,
                             "measured_s": statistics.median(measured[name]),
                             "measured_repeats_s": measured[name]})
    res.update(accuracy(res["plans"], "predicted_s"))
    res["repeat_spearman"] = repeat_consistency(res["plans"])
    res["uncalibrated"] = accuracy(res["plans"], "predicted_uncalibrated_s")
    if cal:  # the plans other than the one whose real step calibrated the model
        res["held_out"] = accuracy([p for p in res["plans"] if p["degrees"] != cal["degrees"]],
                                   "predicted_s")
    by = {p["name"]: p for p in res["plans"]}
    uni = [p for p in res["plans"] if p["name"].startswith("uniform")]
    best_uni = min(uni, key=lambda p: p["measured_s"])
    noise = max(statistics.pstdev(p["measured_repeats_s"]) if len(p["measured_repeats_s"]) > 1
                else 0.0 for p in res["plans"])
    res["best_uniform"] = best_uni["name"]
    res["planner_vs_best_uniform"] = best_uni["measured_s"] / by["planner"]["measured_s"]
    res["planner_at_least_as_fast"] = by["planner"]["measured_s"] <= best_uni["measured_s"] + 2 * noise
    if "planner-memlimit" in by:
        fitting = [p for p in uni if p["fits_limit"]]
        lim = by["planner-memlimit"]
        mixed = len(set(lim["degrees"])) > 1
        res["memlimit"] = {
            "plan": lim["degrees"],
            "measured_s": lim["measured_s"],
            "uniform_that_fit": {p["name"]: p["measured_s"] for p in fitting},
            "mixed": mixed,
            "beats_all_fitting_uniform": mixed and all(lim["measured_s"] < p["measured_s"]
                                                       for p in fitting)}
    return res


def render(out: Path, data: dict) -> Optional[str]:
    """``<out>.md`` and ``<out>.png`` from the results JSON."""
    meta, results = data["meta"], data["topologies"]
    m = meta["model"]
    lines = ["# Planner validation on the emulated cluster", "",
             f"Command: `{meta['command']}` ({meta['date']}, {meta['machine']}).",
             f"GPT d_model {m['d_model']}, {m['n_layer']} layers ({2 * m['n_layer']} blocks), "
             f"{m['n_head']} heads, seq {m['seq_len']}, micro-batch {m['mbs']}, oases + fine, "
             f"tp = all nodes. Measured: median over {meta['repeats']} runs of the median step "
             f"time after {meta['warmup']} warm-up steps ({meta['steps']} steps per run). "
             f"Predicted: the cost model on the profile that `parallel.plan=auto` measured on "
             f"the same cluster.", ""]
    for r in results:
        lines += [f"## {r['cluster']} (tp={r['tp']})", "",
                  "| plan | degrees | predicted (ms) | measured (ms) | rel. error | memory (MiB) |",
                  "|---|---|---|---|---|---|"]
        for p in r["plans"]:
            err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
            lines.append(f"| {p['name']} | {p['degrees']} | {1e3 * p['predicted_s']:.1f} | "
                         f"{1e3 * p['measured_s']:.1f} | {100 * err:+.1f}% | "
                         f"{p['memory_bytes'] / 2**20:.1f} |")
        rep = r.get("repeat_spearman") or []
        lines += ["", f"- Spearman rank correlation: **{r['spearman']:.3f}** (target >= 0.9)"
                  + (f"; between two repeats of the measurement itself: "
                     f"{min(rep):.2f}-{max(rep):.2f}" if rep else ""),
                  f"- Mean relative estimation error: **{100 * r['mean_rel_error']:.1f}%** "
                  f"(target <= 10%)"]
        cal = r.get("calibration")
        if cal:
            h, u = r["held_out"], r["uncalibrated"]
            lines += [
                f"- Calibration inside `parallel.plan=auto`: {cal['steps']} real steps at "
                f"{cal['degrees']} measured {1e3 * cal['measured_s']:.1f} ms against "
                f"{1e3 * cal['predicted_before_s']:.1f} ms predicted from the profile alone; "
                f"host cost of communication x{cal['host_cost_scale']:.2f}",
                f"- The {h['n_plans']} plans other than the calibration plan: Spearman "
                f"{h['spearman']:.3f}, mean error {100 * h['mean_rel_error']:.1f}%",
                f"- The profile alone (no calibration), all plans: Spearman "
                f"{u['spearman']:.3f}, mean error {100 * u['mean_rel_error']:.1f}%"]
        lines.append(f"- Planner vs best uniform ({r['best_uniform']}): "
                     f"{r['planner_vs_best_uniform']:.3f}x; at least as fast within noise: "
                     f"**{r['planner_at_least_as_fast']}**")
        if "memlimit" in r:
            m = r["memlimit"]
            lines.append(f"- Memory limit {r['memory_limit_bytes'] / 2**20:.1f} MiB: planner plan "
                         f"{m['plan']} measured {1e3 * m['measured_s']:.1f} ms; uniform plans that "
                         f"fit: {', '.join(f'{k} {1e3 * v:.1f} ms' for k, v in m['uniform_that_fit'].items()) or 'none'}; "
                         + (f"a mixed plan that beats every fitting uniform plan: "
                            f"**{m['beats_all_fitting_uniform']}**" if m.get("mixed", True) else
                            "the planner kept a uniform plan here (no mixed plan to show)"))
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n" + driver.analysis(meta))
    return plot(results, out.with_suffix(".png"), lambda name: name.startswith("planner"))


BENCH = Validation("planner", "benchmarks.planner", "topologies",
                   {"d_model": 512, "n_layer": 2, "n_head": 8, "seq_len": 128, "mbs": 8},
                   DEFAULT_CLUSTERS, topology, render)


def main(argv=None) -> int:
    return validation_main(BENCH, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
