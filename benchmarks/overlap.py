"""Overlapped TP on a slow link: megatron vs oases schedules on an emulated 2-node cluster.

    sudo .venv/bin/python -m benchmarks.overlap                  # the full benchmark
    sudo .venv/bin/python -m benchmarks.overlap --quick          # smoke run, 1 repeat
    sudo .venv/bin/python -m benchmarks.overlap --modes megatron+full nocomm --repeats 3

Every mode (train.py overrides in ``TRAIN_MODES``, or a peer) runs once per round on
each cluster, round-robin, tp=2 across the two nodes. The modes, the figures and why
this shape and these link rates: benchmarks/README.md, section overlap.py. Writes
``benchmarks/results/overlap.{md,json,png}`` (``--quick``: overlap-quick.*).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Optional

from benchmarks.lib import driver
from emucluster import ClusterError, ClusterSpec, EmulatedCluster, load_specs
from benchmarks.lib.machine import fmt_mbit, machine_info
from benchmarks.lib.train_run import model_flag, timed_run


DEFAULT_CLUSTERS = ["configs/cluster/two-nodes-500m.yaml", "configs/cluster/two-nodes-300m.yaml"]

# mode -> train.py overrides (or a peer module)
TRAIN_MODES = {
    "megatron+full": ["parallel.schedule=megatron", "parallel.recompute=full"],
    "megatron+none": ["parallel.schedule=megatron", "parallel.recompute=none"],
    "oases+none": ["parallel.schedule=oases", "parallel.recompute=none"],
    "oases+full": ["parallel.schedule=oases", "parallel.recompute=full"],
    "oases+fine": ["parallel.schedule=oases", "parallel.recompute=fine"],
    "nocomm": ["parallel.schedule=oases", "parallel.recompute=fine", "parallel.tp_comm_noop=true"],
    "megatron+full+nocomm": ["parallel.schedule=megatron", "parallel.recompute=full",
                             "parallel.tp_comm_noop=true"],
    # need grad_accum >= 2 (--model grad_accum=2): each backward paired with the next
    # micro-batch's forward, two sub-batches inside each (fb) or one (fb1)
    "oases+fine+fb": ["parallel.schedule=oases", "parallel.recompute=fine",
                      "parallel.overlap_fb=true"],
    "oases+fine+fb1": ["parallel.schedule=oases", "parallel.recompute=fine",
                       "parallel.overlap_fb=true", "parallel.sub_batches=1"],
    "oases+selective": ["parallel.schedule=oases", "parallel.recompute=selective"],
}
# parallel.compile: each block's partial and combine through torch.compile
for _m in ("megatron+full", "oases+fine", "nocomm"):
    TRAIN_MODES[f"{_m}+compile"] = [*TRAIN_MODES[_m], "parallel.compile=true"]
# parallel.sequence_parallel: all-gather + reduce-scatter per block, activations 1/tp
for _m in ("megatron+full", "oases+fine", "nocomm"):
    TRAIN_MODES[f"{_m}+sp"] = [*TRAIN_MODES[_m], "parallel.sequence_parallel=true"]
# oases+fine+sp runs 4 sub-batches (parallel.sub_batches=auto), staggered; these two
# separate the sub-batch count from SP: +sb4 without SP, +sb2 with SP in step
TRAIN_MODES["oases+fine+sb4"] = [*TRAIN_MODES["oases+fine"], "parallel.sub_batches=4"]
# oases+fine runs parallel.sub_batches=auto (timed at start-up); +sb2 fixes the two
TRAIN_MODES["oases+fine+sb2"] = [*TRAIN_MODES["oases+fine"], "parallel.sub_batches=2"]
TRAIN_MODES["oases+fine+sp+sb2"] = [*TRAIN_MODES["oases+fine+sp"], "parallel.sub_batches=2"]
PEER_MODES = {"dtensor": "benchmarks.peers.dtensor_gpt",
              "megatron-core": "benchmarks.peers.megatron_core_gpt"}
ALL_MODES = [*TRAIN_MODES, *PEER_MODES]
PAIRED_MODES = {"oases+fine+fb", "oases+fine+fb1"}  # need grad_accum >= 2
BASELINE = "megatron+full"

# (description, numerator mode, denominator mode, minimum ratio)
TARGETS = [
    ("oases+fine >= 1.5x megatron+full", "oases+fine", "megatron+full", 1.5),
    ("oases+fine >= 0.85x nocomm", "oases+fine", "nocomm", 0.85),
    ("oases+full >= 1.2x megatron+full", "oases+full", "megatron+full", 1.2),
    ("oases+fine >= 1.3x dtensor", "oases+fine", "dtensor", 1.3),
    ("oases+fine >= 1.3x megatron-core", "oases+fine", "megatron-core", 1.3),
    ("oases+fine+fb >= 0.85x nocomm", "oases+fine+fb", "nocomm", 0.85),
    ("oases+fine+fb >= 1.7x megatron+full", "oases+fine+fb", "megatron+full", 1.7),
    ("oases+fine+fb1 >= 0.85x nocomm", "oases+fine+fb1", "nocomm", 0.85),
    ("oases+fine+fb1 >= 1.7x megatron+full", "oases+fine+fb1", "megatron+full", 1.7),
    ("oases+fine+sp >= 1.0x oases+fine", "oases+fine+sp", "oases+fine", 1.0),
    ("oases+fine+sp >= 1.5x megatron+full+sp", "oases+fine+sp", "megatron+full+sp", 1.5),
]

# The shape: chosen so that megatron+full spends >= 50% of its step in TP
# communication at both default link rates on a quiet 2-core machine (~55% at
# 500 Mbit/s, ~70% at 300 Mbit/s; measurements in benchmarks/README.md).
DEFAULT_MODEL = {"d_model": 512, "n_layer": 2, "n_head": 8, "seq_len": 128,
                 "micro_batch_size": 8, "grad_accum": 1}


# ---------------------------------------------------------------------------
# One run


def run_one(cluster: EmulatedCluster, mode: str, model: dict, args, out_dir: Path) -> dict:
    return timed_run(cluster, mode, TRAIN_MODES.get(mode), model, args, out_dir,
                     peer=PEER_MODES.get(mode))


# ---------------------------------------------------------------------------
# Summary and report


def summarize(runs: list[dict], clusters: list[ClusterSpec], modes: list[str]) -> dict:
    out = {}
    for spec in clusters:
        per = driver.mode_medians([r for r in runs if r["cluster"] == spec.name], modes)
        ref = "nocomm" if per.get("nocomm", {}).get("ok") else (
            "megatron+full+nocomm" if per.get("megatron+full+nocomm", {}).get("ok") else None)
        base = per.get(BASELINE, {})
        for mode, m in per.items():
            if not m["ok"]:
                continue
            m["ratio_vs_baseline"] = (m["tokens_per_s"] / base["tokens_per_s"]
                                      if base.get("ok") else None)
            m["exposed_comm_fraction"] = ((m["step_time_s"] - per[ref]["step_time_s"])
                                          / m["step_time_s"] if ref else None)
        out[spec.name] = {"gbps": spec.inter_node_bandwidth_gbps, "modes": per,
                          "exposed_reference": ref,
                          "megatron_full_comm_share": driver.comm_share(
                              per, "megatron+full", "megatron+full+nocomm"),
                          "targets": driver.ratio_targets(per, TARGETS)}
    return out


def _exposed(r: dict) -> str:
    e = r["exposed_comm_fraction"]
    return f"{100 * e:.0f}%" if e is not None else "n/a"


def write_markdown(path: Path, meta: dict, summary: dict, modes: list[str]) -> None:
    m = meta["model"]
    ga = f" x {m['grad_accum']} per step" if "grad_accum" in m else ""  # older results: none
    L = [*driver.report_head(f"# Overlapped TP on a slow link ({meta['tag']})", meta),
         f"Emulated cluster: 2 nodes (network namespaces) x 1 CPU process, tp=2 across the link "
         f"(gloo, OMP_NUM_THREADS=1), link shaped with tc tbf (emucluster). "
         f"Model: GPT d_model {m['d_model']}, {m['n_layer']} layers, {m['n_head']} heads, "
         f"ffn {4 * m['d_model']}, vocab {meta['vocab_size']}, seq {m['seq_len']}, micro batch "
         f"{m['micro_batch_size']}{ga}, fp32. Each figure: median over {meta['repeats']} repeats "
         f"(fresh processes, modes interleaved round-robin) of the median step time of steps "
         f"{meta['warmup'] + 1}..{meta['steps']}. tokens/s = tokens per step / that time. "
         f"Absolute times on a shared 2-core machine are noisy; compare ratios within a table.",
         ""]
    for name, s in summary.items():
        share = s["megatron_full_comm_share"]
        ref = s["exposed_reference"]
        L += [f"## {name}: {fmt_mbit(s['gbps'])}", ""]
        if share is not None:
            L += [f"TP communication share of megatron+full's step "
                  f"(vs megatron+full+nocomm): **{100 * share:.0f}%**.", ""]
        note = "" if ref == "nocomm" else (f" (reference: {ref}; nocomm not run or failed)"
                                           if ref else " (n/a: no no-comm mode ran)")
        L += [f"| mode | step (s) | repeats (s) | tokens/s | vs megatron+full | exposed comm{note} |",
              "|---|---|---|---|---|---|"]
        L += [driver.mode_row(mode, s["modes"][mode], _exposed)
              for mode in modes if mode in s["modes"]]
        if s["targets"]:
            L += ["", *driver.target_rows(s["targets"])]
        L.append("")
    loads = [r["loadavg_1min_before"] for r in meta.get("runs", []) if "loadavg_1min_before" in r]
    L += driver.load_line(loads, "Machine load (1-min load average before each run; the "
                                 "benchmark itself adds ~2):")
    if loads:
        L[-1] += (". Other tenants' CPU load slows compute but not the shaped link, so it "
                  "lowers the communication share; trust runs on a quiet machine.")
        L.append("")
    L += ["Raw numbers (every run's step times, errors, node-0 commands): "
          f"`{Path(meta['json']).name}`; chart: `{Path(meta['png']).name}`.", ""]
    if driver.analysis(meta):  # hand-written notes on the timelines
        L.append(driver.analysis(meta))
    path.write_text("\n".join(L))


def write_plot(path: Path, summary: dict, modes: list[str]) -> Optional[str]:
    plt = driver.matplotlib_pyplot()
    if plt is None:
        return "matplotlib is not installed (pip install -e '.[bench]'): no chart"
    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(1, len(modes))
    for k, mode in enumerate(modes):
        xs, tps, exp = [], [], []
        for i, n in enumerate(names):
            r = summary[n]["modes"].get(mode, {})
            xs.append(i + (k - (len(modes) - 1) / 2) * width)
            tps.append(r.get("tokens_per_s", 0.0) if r.get("ok") else 0.0)
            e = r.get("exposed_comm_fraction") if r.get("ok") else None
            exp.append(100 * e if e is not None else 0.0)
        axes[0].bar(xs, tps, width, label=mode)
        axes[1].bar(xs, exp, width, label=mode)
    labels = [f"{n}\n{fmt_mbit(summary[n]['gbps'])}" for n in names]
    for ax, title, yl in ((axes[0], "throughput (a failed mode shows as 0)", "tokens/s"),
                          (axes[1], "exposed communication (t - t_nocomm) / t", "% of step")):
        ax.set_xticks(range(len(names)), labels)
        ax.set_title(title)
        ax.set_ylabel(yl)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("tp=2 over an emulated link (2 nodes, gloo, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def render(out: Path, data: dict) -> Optional[str]:
    """``<out>.md`` and ``<out>.png`` from the results JSON."""
    meta, summary = data["meta"], data["summary"]
    write_markdown(out.with_suffix(".md"), {**meta, "runs": data["runs"]}, summary, meta["modes"])
    return write_plot(out.with_suffix(".png"), summary, meta["modes"])


# ---------------------------------------------------------------------------


def parse_args(argv=None):
    p = driver.parser(__doc__)
    p.add_argument("--clusters", nargs="+", default=DEFAULT_CLUSTERS, help="cluster files")
    p.add_argument("--modes", nargs="+", default=None, choices=ALL_MODES, metavar="MODE",
                   help=f"subset of: {' '.join(ALL_MODES)} (default: every mode that runs at "
                        f"the shape's grad_accum: the peers at 1, the paired modes at >= 2)")
    driver.run_flags(p, steps=10, warmup=3)
    model_flag(p, DEFAULT_MODEL)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 repeat, 4 steps (1 warmup); writes overlap-quick.*")
    driver.report_flags(p, "overlap")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 4, 1
    driver.check_run_flags(p, args)
    model = driver.parse_shape(p, args.model, DEFAULT_MODEL, "--model")
    if model["d_model"] % model["n_head"] or model["n_head"] % args.tp:
        p.error(f"--model: n_head {model['n_head']} must divide d_model {model['d_model']} "
                f"and be divisible by tp {args.tp}")
    args.model_shape = model
    if args.modes is None:
        skip = PAIRED_MODES if model["grad_accum"] < 2 else set(PEER_MODES)
        args.modes = [m for m in ALL_MODES if m not in skip]
    args.modes = list(dict.fromkeys(args.modes))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    specs = load_specs(args.clusters)
    if specs is None:
        return 2
    for s in specs:
        if (s.nodes * s.devices_per_node) % args.tp:
            print(f"error: cluster {s.name}: tp={args.tp} does not divide its "
                  f"{s.nodes * s.devices_per_node} devices", file=sys.stderr)
            return 2
    if len({s.name for s in specs}) != len(specs):
        print("error: two cluster files have the same name", file=sys.stderr)
        return 2
    model = args.model_shape
    out, workdir = driver.out_prefix(args, "overlap"), driver.workdir(args, "overlap")
    n_total = len(specs) * args.repeats * len(args.modes)
    print(f"overlap: {len(specs)} cluster(s) x {args.repeats} repeats x {len(args.modes)} modes "
          f"= {n_total} runs; model {model}; work dir {workdir}", flush=True)

    def one(cluster, mode, rnd):
        rdir = workdir / cluster.spec.name / mode.replace("+", "-") / f"r{rnd}"
        return run_one(cluster, mode, model, args, rdir)

    def line(rec, minutes):
        return driver.run_line(f"{rec['cluster']} r{rec['round']}", rec, minutes, 22)

    try:
        runs, interrupted, elapsed = driver.run_rounds(
            [(partial(EmulatedCluster, spec), args.modes) for spec in specs],
            args.repeats, one, line)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"tag": "quick" if args.quick else "full",
            "command": driver.command("benchmarks.overlap", argv),
            "machine": machine_info(), "model": model, "vocab_size": args.vocab_size,
            "tp": args.tp, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "modes": args.modes, "clusters": args.clusters, "elapsed_min": elapsed,
            "interrupted": interrupted, "json": str(out.with_suffix(".json")),
            "png": str(out.with_suffix(".png"))}
    driver.save(out, {"meta": meta, "summary": summarize(runs, specs, args.modes), "runs": runs},
                render)
    print(f"wrote {out.with_suffix('.md')}, .json, .png in {elapsed:.1f} min")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
