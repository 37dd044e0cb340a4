"""The pipeline benchmark's (``python -m benchmarks.pipeline``) resharding-case plan file
and its report: the Markdown tables and chart, written from the results JSON alone (so
``--from-json`` re-writes them)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

from benchmarks.lib import driver
from benchmarks.lib.machine import fmt_mbit

BASELINE = {"uniform": "megatron+full+1f1b", "reshard": "reshard:1f1b", "pp4": "pp4:1f1b"}
RESHARD_ORDERS = {  # name -> ((dp, tp) of stage 0, (dp, tp) of stage 1)
    "tp2-dp2": ((1, 2), (2, 1)),
    "dp2-tp2": ((2, 1), (1, 2)),
}
TRACED_STEP = 3  # train.py traces step min(3, steps) (oases.runtime.trainer)


def write_plan(path: Path, n_layer: int, order: str, split: int) -> Path:
    h = split
    (d0, t0), (d1, t1) = RESHARD_ORDERS[order]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# stage 0 on nodes {{0,1}} as dp {d0} x tp {t0}, stage 1 on nodes {{2,3}} "
                    f"as dp {d1} x tp {t1}\n"
                    "stages:\n"
                    f"  - {{layers: [0, {h}], dp: {d0}, tp: {t0}}}\n"
                    f"  - {{layers: [{h}, {n_layer}], dp: {d1}, tp: {t1}}}\n")
    return path


SPLIT_SCHEDULES = ("zb-h1", "eager-zb-h1")  # oases.pipeline.schedules.SPLIT_KINDS


def predicted_bubbles(rows: list[str], per: dict, case: str, meta: dict) -> list[str]:
    """The simulator's bubble of each mode's schedule beside the measured one: F = B = W
    = 1 (a schedule without W runs B for B + W), no transfer cost (``python -m
    oases.schedule``)."""
    from oases.pipeline.actions import simulate
    from oases.pipeline.schedules import pipeline_actions

    pp = 4 if case == "pp4" else 2
    m = meta["reshard_microbatches"] if case == "reshard" else meta["microbatches"]
    out = []
    for mode in rows:
        kind = mode.rsplit(":", 1)[-1].split("+")[-1]
        if kind not in ("1f1b", "eager-1f1b", *SPLIT_SCHEDULES, "interleaved-1f1b") \
                or not per[mode]["ok"]:
            continue
        virtual = 2 if kind == "interleaved-1f1b" else 1  # the benchmark's pp_virtual
        t = simulate(pipeline_actions(kind, pp, m, virtual=virtual), f_cost=1.0, b_cost=1.0,
                     w_cost=1.0)
        out.append(f"| {mode} | {100 * t.bubble_fraction:.0f}% | {_bubble(per[mode])} |")
    if not out:
        return []
    return [f"Bubble predicted by the simulator (pp {pp}, m = {m}; F = B = W = 1, no "
            f"transfer cost) and measured (`pipeline_bubble`, which also counts "
            f"transfer waits and the step's clipping):", "",
            "| mode | predicted | measured |", "|---|---|---|", *out, ""]


def _bubble(r: dict) -> str:
    return f"{100 * r['bubble']:.0f}%" if r["bubble"] is not None else "n/a"


def write_markdown(path: Path, meta: dict, summary: dict, runs: list[dict]) -> None:
    m, rm, mi = meta["model"], meta["reshard_model"], meta["machine"]
    q = meta["cpu_quota"]
    (d0, t0), (d1, t1) = RESHARD_ORDERS[meta["reshard_order"]]
    L = [*driver.report_head(f"# Pipeline parallelism across a slow link ({meta['tag']})", meta),
         "## Set-up", "",
         "4 emulated nodes (network namespaces, emucluster) x 1 CPU process, two "
         "pairs {0,1} and {2,3} with a fast link inside a pair and a slow one between the pairs "
         "(tc htb per destination), gloo, OMP_NUM_THREADS=1"
         + (f"; every node limited to **{q:g} core** (cgroup v1 cpu quota, period "
            f"{meta['cpu_period_ms']:g} ms), so each emulated device computes at one fixed "
            f"speed and 4 x {q:g} = {4 * q:g} cores = this machine (without it, a rank that "
            f"waits lends its core to the other ranks, which no real cluster does)"
            if q > 0 else "; no CPU limit (4 processes share the cores)") + ".", "",
         f"Resharding case: stage 0 = layers [0, {meta['reshard_split']}) as dp {d0} x tp {t0}, "
         f"stage 1 = the rest as dp {d1} x tp {t1} (a plan file with `stages:`), so every "
         f"activation and gradient crossing the slow link is a cross-mesh reshard; GPT d_model "
         f"{rm['d_model']}, {rm['n_layer']} layers, {rm['n_head']} heads, seq {rm['seq_len']}, "
         f"micro-batch {rm['micro_batch_size']} sequences ({meta['reshard_act_mib']:.2f} MiB of "
         f"activation), {meta['reshard_microbatches']} micro-batches. The layer split balances "
         f"the stages (stage 1 runs at tp 2, its TP all-reduces cross the pair link, and has "
         f"the head), so that a transfer delays the pipeline instead of hiding behind a slower "
         f"stage; the model is narrow so that a transfer is a sizeable part of a stage's "
         f"compute (a wider or longer model grows the compute faster than the activation).", "",
         f"Each figure: median over {meta['repeats']} repeats (fresh processes, modes "
         f"interleaved round-robin) of the median step time of steps {meta['warmup'] + 1}.."
         f"{meta['steps']} (round 0 without the traced step {TRACED_STEP}); tokens/s = tokens "
         f"per step / that time. Bubble = "
         f"`pipeline_bubble` of metrics.jsonl: mean over ranks of the fraction of the step "
         f"spent outside F/B compute (fill/drain, waits for transfers, gradient clipping), "
         f"median over the same steps and repeats. Absolute times on a shared 2-core machine "
         f"are noisy; compare ratios within a table.", ""]
    ran = {c["modes"][x]["case"] for c in summary.values() for x in c["modes"]}
    layout_txt = [
        "pp=2 x tp=2: oases puts stage s on ranks 2s, 2s+1 (oases.parallel.layout: a stage owns "
        "consecutive ranks, TP inside it), i.e. stage 0 = nodes {0,1}, stage 1 = nodes {2,3}: "
        "TP inside each fast pair, the pipeline across the slow link. train.py printed: "
        f"`{meta.get('uniform_layout') or meta.get('reshard_layout') or 'n/a'}`.", ""]
    same_txt = [
        f"Same-layout case: GPT d_model {m['d_model']}, {m['n_layer']} layers (4 per stage), "
        f"{m['n_head']} heads, ffn {4 * m['d_model']}, vocab {meta['vocab_size']}, seq "
        f"{m['seq_len']}, micro-batch {m['micro_batch_size']} sequences, "
        f"{meta['microbatches']} micro-batches per step (train.grad_accum), fp32, untied "
        f"embeddings (the torch peer cannot tie a weight across stages; all modes use the "
        f"same model).", ""]
    # the set-up paragraphs of the cases that ran, before the "Each figure" paragraph
    k = next(i for i, ln in enumerate(L) if ln.startswith("Each figure"))
    reshard_txt = L[k - 2:k]
    del L[k - 2:k]
    L[k - 2:k - 2] = (layout_txt + (same_txt if "uniform" in ran else [])
                      + (reshard_txt if "reshard" in ran else []))

    def table(name: str, s: dict, case: str) -> None:
        per = s["modes"]
        rows = [x for x in s["modes"] if per[x]["case"] == case]
        if not rows:
            return
        title = {"uniform": "same layouts, pp 2 x tp 2",
                 "pp4": "pp 4 x tp 1, one stage per node (megatron engine, no recompute)"}.get(
            case, f"stages of different layouts: dp {d0} x tp {t0} -> dp {d1} x tp {t1}")
        L.extend([f"### {name}: {title}", "",
                  f"| mode | step (s) | repeats (s) | tokens/s | vs {BASELINE[case]} | bubble |",
                  "|---|---|---|---|---|---|"])
        L.extend(driver.mode_row(mode, per[mode], _bubble) for mode in rows)
        L.append("")
        L.extend(predicted_bubbles(rows, per, case, meta))
        tp_ = per.get("torch-1f1b", {})
        if case == "uniform" and "max_loss_diff_vs_megatron" in tp_:
            L.append(f"The torch peer's losses match megatron+full+1f1b's over "
                     f"{tp_['loss_steps_compared']} steps within "
                     f"{tp_['max_loss_diff_vs_megatron']:.1e} (same model, data and optimizer; "
                     f"only the pipeline driver differs).")
            L.append("")
        share = s.get("megatron_full_comm_share")
        if case == "uniform" and share is not None:
            L.extend([f"TP-communication share of megatron+full+1f1b's step (vs "
                  f"megatron+full+nocomm+1f1b): **{100 * share:.0f}%**; perfect overlap at no "
                  f"other cost could give at most {1 / (1 - share):.2f}x.", ""])

    for name, s in summary.items():
        L += [f"## {name}: {fmt_mbit(s['fast_gbps'])} inside a pair, {fmt_mbit(s['slow_gbps'])} "
              f"between the pairs (`{s['file']}`)", ""]
        table(name, s, "uniform")
        table(name, s, "pp4")
        table(name, s, "reshard")
        if s["targets"]:
            L += [f"### {name}: targets", "", *driver.target_rows(s["targets"], per_round=True), ""]
    tl = meta.get("timelines") or {}
    if tl:
        L += ["## Timelines", "",
              "One traced step (step 3 of round 0; left out of the timing) per mode, drawn by "
              "benchmarks.timeline: per rank a pipeline row (F/B/W actions; red = waiting for a "
              "transfer, purple = waiting for the step's sends), the engine's compute row (blue "
              "/ orange: the oases engine's two sub-batches) and its collectives (green).", ""]
        for key, png in tl.items():
            L.append(f"- {key}: `{Path(png).name}`")
        L.append("")
    if driver.analysis(meta):
        L += ["## What the timelines show", "", *driver.analysis(meta).splitlines(), ""]
    loads = [r["loadavg_1min_before"] for r in runs if "loadavg_1min_before" in r]
    others = [r["others_cpu_cores"] for r in runs if "others_cpu_cores" in r]
    if loads:
        L += driver.load_line(loads, "Machine load: 1-min load average before each run (it "
                                     "includes the previous run's own 4 processes)")
        L[-1] += ((f"; CPU used by other tenants during a run (machine busy time minus this "
                   f"benchmark's cgroups): median {statistics.median(others):.2f} cores, max "
                   f"{max(others):.2f} of {mi['cores']}" if others else "") + ".")
        L.append("")
    L += ["Raw numbers (every run's step times, bubbles, losses, per-node CPU, errors, node-0 "
          f"commands, per-rank trace totals): `{Path(meta['json']).name}`; chart: "
          f"`{Path(meta['png']).name}`.", ""]
    path.write_text("\n".join(L))


def write_plot(path: Path, summary: dict) -> Optional[str]:
    plt = driver.matplotlib_pyplot()
    if plt is None:
        return "matplotlib is not installed: no chart"
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    labels, rel, tps, bub, colors = [], [], [], [], []
    palette = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
    for ci, (name, s) in enumerate(summary.items()):
        for mode, r in s["modes"].items():
            labels.append(f"{mode}\n{name}")
            tps.append(r.get("tokens_per_s", 0.0) if r["ok"] else 0.0)
            rel.append((r.get("ratio_vs_baseline") or 0.0) if r["ok"] else 0.0)
            bub.append(100 * (r.get("bubble") or 0.0) if r["ok"] else 0.0)
            colors.append(palette[ci % len(palette)] if r["case"] == "uniform"
                          else "tab:orange")
    x = list(range(len(labels)))
    axes[0].bar(x, rel, color=colors)
    for xi, (v, t) in enumerate(zip(rel, tps)):
        if v:
            axes[0].text(xi, v + 0.02, f"{t:,.0f}", ha="center", va="bottom", fontsize=6)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].axhline(1.25, color="tab:blue", linestyle="--", linewidth=0.8)
    axes[0].axhline(1.1, color="tab:orange", linestyle="--", linewidth=0.8)
    axes[1].bar(x, bub, color=colors)
    for ax, title, yl in ((axes[0], "throughput vs the case's 1F1B baseline on the same cluster "
                                    "(labels: tokens/s; dashed: targets 1.25x, 1.1x)",
                           "x megatron+full+1f1b  /  x reshard:1f1b"),
                          (axes[1], "pipeline bubble (fraction outside F/B)", "% of step")):
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(yl)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("pp=2 x tp=2 on 4 emulated nodes (one colour per cluster; orange: resharding "
                 "stages, another model shape)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def render(out: Path, data: dict) -> Optional[str]:
    """``<out>.md`` and ``<out>.png`` from the results JSON (with the hand-written notes
    of :func:`driver.analysis`)."""
    write_markdown(out.with_suffix(".md"), data["meta"], data["summary"], data["runs"])
    return write_plot(out.with_suffix(".png"), data["summary"])
