"""Planner v2 validation on the emulated cluster: every kind of layout, predicted vs measured.

    sudo .venv/bin/python -m benchmarks.planner_layouts            # 3 clusters, 3 repeats
    sudo .venv/bin/python -m benchmarks.planner_layouts --quick    # one cluster, 1 repeat

Per cluster: profile the live cluster (one ``train.py parallel.plan=auto`` step), price
the candidates (``benchmarks.lib.layouts``: the MILP's pick, AMP's, every uniform
layout, ``--random`` random plans), train each ``--repeats`` rounds round-robin
(``benchmarks.lib.validation``), and report Spearman, mean error and the pick against
the best measured and best uniform candidates to
``benchmarks/results/planner-layouts.{md,json,png}``. The details: benchmarks/README.md,
section planner_layouts.py. Needs root and iproute2 (``emucluster``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.lib import driver
from benchmarks.lib.layouts import PROFILE_MBS, WORLD, candidates, job_config, model_overrides
from benchmarks.lib.validation import (Validation, accuracy, measure_plans, plot,
                                       repeat_consistency, train_steps)
from benchmarks.lib.validation import main as validation_main
from oases.planner import report as rep
from oases.planner.search import search
from oases.planner.stages import build, enumerate_choices, job_from_config, profile_run

REPO = driver.REPO
DEFAULT_CLUSTERS = ["configs/cluster/four-nodes-1g.yaml", "configs/cluster/hetero-4.yaml",
                    "configs/cluster/four-nodes-halfspeed.yaml"]


def live_profile(c, args, cluster, path: str, work: Path):
    """The profile ``parallel.plan=auto`` (tp-only, pp 1, tp 4) measures on the live
    cluster: block compute on every rank at once (averaged over the ranks), the
    collectives of its groups and the host cost of communication calibrated by real
    steps. A fresh HOME keeps any profile DB of this machine out of it. The ranks'
    mean is of speed-1.0 figures where nodes run at other speeds."""
    extra = ["parallel.plan=auto", "parallel.plan_search=tp-only", f"parallel.cluster={path}",
             f"parallel.tp={WORLD}", "parallel.pp=1", f"train.micro_batch_size={PROFILE_MBS}",
             f"train.grad_accum={args.batch // PROFILE_MBS}", "train.steps=1"]
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    run_train(c, args, "auto", work, extra, env={"HOME": str(home)})
    return read_profile(work)


def read_profile(work: Path):
    """(Profile, calibration) from ``<work>/auto/profile.json``: compute times of a
    speed-1.0 device (plan=auto takes each rank's to its node's speed before averaging)."""
    from oases.planner.cost import Profile

    rec = json.loads((work / "auto" / "profile.json").read_text())
    return Profile(rec["blocks"], rec["constant"], rec["comm"]), rec.get("calibration")


def reprice(plans: list[dict], job, cluster, prof, base) -> list[float]:
    """Each recorded plan's predicted time under ``prof`` (the search's pricing)."""
    choices = {(ch.pp, ch.dp, ch.tp, ch.micro_batches): ch
               for ch in enumerate_choices(job, WORLD)}
    built: dict = {}
    out = []
    for p in plans:
        k = (p["pp"], p["dp"], p["tp"], p["micro_batches"])
        if k not in built:
            built[k] = build(job, choices[k], cluster, prof, base)
        prob = built[k]
        strat = [prob.choice.degrees.index(d) for d in p["degrees"]]
        out.append(prob.time([a for a, _ in p["stages"]], strat))
    return out


def run_train(c, args, name: str, work: Path, extra: list[str], env=None) -> list[float]:
    out = work / name
    ov = ["--config", "configs/gpt-tiny.yaml", *model_overrides(args), f"out_dir={out}",
          f"train.steps={args.steps}", *extra]
    return train_steps(c, ov, out, args.run_timeout, args.warmup, env)


def brief(c) -> dict:
    ch = c.choice
    return {"pp": ch.pp, "dp": ch.dp, "tp": ch.tp, "micro_batches": ch.micro_batches,
            "rows": ch.rows, "stages": [[a, b] for a, b in c.ranges()], "degrees": c.degrees,
            "describe": c.describe(), "source": c.source}


def topology(path: str, args, work: Path) -> dict:
    from emucluster import EmulatedCluster
    from oases.planner.cluster import load_cluster

    cluster = load_cluster(path)
    work = work / cluster.name
    work.mkdir(parents=True, exist_ok=True)
    cfg = job_config(args)
    job = job_from_config(cfg)
    choices = enumerate_choices(job, WORLD)
    base = profile_run(job, max(ch.tp for ch in choices), cfg.train.micro_batch_size)
    res: dict = {"cluster": cluster.name, "file": path, "plans": []}
    with EmulatedCluster(path) as c:
        t0 = time.monotonic()
        print(f"[{cluster.name}] profiling (parallel.plan=auto, tp-only, 1 step)", flush=True)
        prof, res["calibration"] = live_profile(c, args, cluster, path, work)
        res["profile_s"] = time.monotonic() - t0
        problems = [build(job, ch, cluster, prof, base) for ch in choices]
        res_u = search(job, WORLD, cluster, prof, base, "uniap", log=lambda s: None)
        res_a = search(job, WORLD, cluster, prof, base, "amp", log=lambda s: None)
        cands, aliases = candidates(problems, res_u, res_a, args.random, args.seed)
        print(f"[{cluster.name}] {len(choices)} layouts, {len(cands)} candidates "
              f"(profile {res['profile_s']:.0f} s)", flush=True)
        plans = {}
        for name, cand in cands.items():
            pf = work / f"{name}.yaml"
            rep.to_plan(cand, res_u, cfg, cluster.name).save(pf)
            plans[name] = [f"parallel.plan={pf}", *rep.run_overrides(cand)]
        measured = measure_plans(
            c, cluster.name, list(cands), args.repeats,
            lambda name, r: run_train(c, args, f"{name}-r{r}", work, plans[name]),
            lambda n: (f"({cands[n].describe()})", cands[n].time))
    for name, cand in cands.items():
        res["plans"].append({"name": name, "also": aliases.get(name, []), **brief(cand),
                             "predicted_s": cand.time,
                             "overrides": plans[name][1:],
                             "measured_s": statistics.median(measured[name]),
                             "measured_repeats_s": measured[name]})
    summarise(res)
    return res


def names(p: dict) -> list[str]:
    """A candidate's name and the names of the same plan found another way."""
    return [p["name"], *p.get("also", [])]


def summarise(res: dict) -> None:
    """Accuracy, noise ceiling and the MILP plan against the best measured and uniform
    candidates (a uniform layout the search picked itself counts as uniform)."""
    plans = res["plans"]
    res.update(accuracy(plans, "predicted_s"))
    res["repeat_spearman"] = (repeat_consistency(plans)
                              if len(plans[0]["measured_repeats_s"]) > 1 else [])
    by = {p["name"]: p for p in plans}
    best = min(plans, key=lambda p: p["measured_s"])
    uni = [p for p in plans if any(n.startswith("uniform") for n in names(p))]
    best_uni = min(uni, key=lambda p: p["measured_s"]) if uni else None
    milp = by.get("milp")
    res["best_measured"] = " = ".join(names(best))
    res["milp_vs_best_measured"] = milp["measured_s"] / best["measured_s"] if milp else None
    res["best_uniform"] = " = ".join(names(best_uni)) if best_uni else None
    res["uniform_vs_milp"] = (best_uni["measured_s"] / milp["measured_s"]
                              if milp and best_uni else None)
    res["predicted_uniform_vs_milp"] = (min(p["predicted_s"] for p in uni) / milp["predicted_s"]
                                        if milp and uni else None)
    res["milp_source"] = milp["source"] if milp else None


def render(out: Path, data: dict) -> Optional[str]:
    """``<out>.md`` and ``<out>.png`` from the results JSON."""
    meta, results = data["meta"], data["clusters"]
    m = meta["model"]
    lines = ["# Planner v2 (layout search) on the emulated cluster", "",
             f"Command: `{meta['command']}` ({meta['date']}, {meta['machine']}).",
             f"GPT d_model {m['d_model']}, {m['n_layer']} layers, {m['n_head']} heads, seq "
             f"{m['seq_len']}, global batch {m['batch']}, oases + fine, 4 nodes x 1 process. "
             f"Measured: median over {meta['repeats']} round-robin repeat(s) of the median step "
             f"time after {meta['warmup']} warm-up steps ({meta['steps']} steps per run). "
             f"Predicted: the layout's instance priced as the search prices it, on the profile "
             f"one `parallel.plan=auto` step (tp-only, tp 4) measured on the same cluster. "
             f"`milp` is the uniap search's pick, `amp` AMP's; `a = b` is one plan that two "
             f"generators produced."
             + (f" **{meta['repriced']}** (the measurements are the run's)."
                if meta.get("repriced") else ""), ""]
    for r in results:
        lines += [f"## {r['cluster']}", "",
                  "| candidate | layout | predicted (ms) | measured (ms) | rel. error |",
                  "|---|---|---|---|---|"]
        for p in sorted(r["plans"], key=lambda p: p["measured_s"]):
            err = (p["predicted_s"] - p["measured_s"]) / p["measured_s"]
            lines.append(f"| {' = '.join(names(p))} | {p['describe'].replace('|', ';')} | "
                         f"{1e3 * p['predicted_s']:.1f} | {1e3 * p['measured_s']:.1f} | "
                         f"{100 * err:+.1f}% |")
        reps = r.get("repeat_spearman") or []
        lines += ["", f"- Spearman predicted vs measured: **{r['spearman']:.3f}** over "
                  f"{r['n_plans']} candidates (target >= 0.9)"
                  + (f"; between two repeats of the measurement: {min(reps):.2f}-{max(reps):.2f}"
                     if reps else "; one repeat: no noise ceiling"),
                  f"- Mean relative error: **{100 * r['mean_rel_error']:.1f}%** (target <= 5%)"]
        if r["milp_vs_best_measured"] is not None:
            lines.append(f"- MILP plan (source: {r.get('milp_source')}) vs best measured "
                         f"({r['best_measured']}): {r['milp_vs_best_measured']:.3f}x its time "
                         f"(target <= 1.03)")
        if r["uniform_vs_milp"] is not None:
            lines.append(f"- Best uniform ({r['best_uniform']}) / MILP plan, measured: "
                         f"{r['uniform_vs_milp']:.3f}x; predicted: "
                         f"{r['predicted_uniform_vs_milp']:.3f}x"
                         + (" (target >= 1.3 on the half-speed cluster)"
                            if "halfspeed" in r["cluster"] else ""))
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n" + driver.analysis(meta))
    return plot(results, out.with_suffix(".png"), lambda name: name in ("milp", "amp"))


def refresh(data: dict, work=None) -> dict:
    """A results JSON's summaries recomputed, e.g. after a change to how they are
    summarised; with the run's ``--workdir`` every candidate is priced again from the
    profiles it measured (the report says so)."""
    from oases.planner.cluster import load_cluster

    for r in data["clusters"]:
        for p in r["plans"]:  # a repeated random draw is "random draw" (as candidates names it)
            p["also"] = ["random draw" if a.startswith("random") else a for a in p.get("also", [])]
        if work is not None:
            cluster = load_cluster(REPO / r["file"])
            prof = read_profile(Path(work) / cluster.name)[0]
            cfg = job_config(argparse.Namespace(**data["meta"]["model"]))
            job = job_from_config(cfg)
            base = profile_run(job, WORLD, cfg.train.micro_batch_size)
            for p, v in zip(r["plans"], reprice(r["plans"], job, cluster, prof, base)):
                p["predicted_s"] = v
            data["meta"]["repriced"] = f"predictions re-priced from the profiles in {work}"
        summarise(r)
    return data


BENCH = Validation("planner-layouts", "benchmarks.planner_layouts", "clusters",
                   {"d_model": 256, "n_layer": 8, "n_head": 4, "seq_len": 64, "batch": 16},
                   DEFAULT_CLUSTERS, topology, render, refresh, quick=True)


def main(argv=None) -> int:
    return validation_main(BENCH, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
