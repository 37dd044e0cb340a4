"""Overlapped TP on a slow link: megatron vs oases schedules on an emulated 2-node cluster.

    sudo .venv/bin/python benchmarks/overlap.py                  # the full benchmark
    sudo .venv/bin/python benchmarks/overlap.py --quick          # smoke run, 1 repeat
    sudo .venv/bin/python benchmarks/overlap.py --modes megatron+full nocomm --repeats 3

For every cluster file (default: a 500 Mbit/s and a 300 Mbit/s 2-node cluster) this
brings the emulated cluster up (benchmarks/cluster.py; needs root and iproute2),
then runs, in ``--repeats`` rounds, every mode once per round in round-robin order
(so machine noise hits all modes alike), each run in fresh processes: tp=2 across
the two nodes (one process per node, gloo over the shaped link).

Modes (``--modes``):

    megatron+full          baseline: blocking all-reduces, full per-layer recompute
    megatron+none          blocking all-reduces, no recompute
    oases+none             two sub-batches, comm overlapped, no recompute (the peers'
                           memory regime: they keep every activation too)
    oases+full             two sub-batches, comm overlapped, full recompute
    oases+fine             two sub-batches, fine-grained recompute
    nocomm                 oases+fine with parallel.tp_comm_noop=true: no TP communication
                           at all (timing only, the upper bound)
    megatron+full+nocomm   megatron+full without TP communication: its comm share
    dtensor                benchmarks/peers/dtensor_gpt.py (torch DTensor TP)
    megatron-core          benchmarks/peers/megatron_core_gpt.py (Megatron-Core TP)

train.py runs read ``step_time_s`` from ``<out_dir>/metrics.jsonl``; peers write
``{"step_times_s": [...], "tokens_per_step": n}`` to ``--out-json``. A run's figure
is the median step time after ``--warmup`` steps; a mode's figure the median over
its repeats. A mode that fails (e.g. the oases schedule not implemented yet, a peer
script missing) is recorded with its error and not retried on that cluster; the
others go on. Exposed-communication fraction = (t_mode - t_nocomm) / t_mode.

Writes ``benchmarks/results/overlap.{md,json,png}`` (``--quick``: overlap-quick.*).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import fmt_mbit, machine_info  # noqa: E402,F401  (pipeline.py, reshard.py too)
from cluster import (ClusterError, ClusterSpec, EmulatedCluster,  # noqa: E402
                     check_prerequisites, free_port)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PEERS = REPO / "benchmarks" / "peers"

DEFAULT_CLUSTERS = ["configs/cluster/two-nodes-500m.yaml", "configs/cluster/two-nodes-300m.yaml"]

# mode -> train.py overrides (or a peer script)
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
PEER_MODES = {"dtensor": "dtensor_gpt.py", "megatron-core": "megatron_core_gpt.py"}
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
]

# The shape: chosen so that megatron+full spends >= 50% of its step in TP
# communication at both default link rates on a quiet 2-core machine (~55% at
# 500 Mbit/s, ~70% at 300 Mbit/s; measurements in benchmarks/README.md).
DEFAULT_MODEL = {"d_model": 512, "n_layer": 2, "n_head": 8, "seq_len": 128,
                 "micro_batch_size": 8, "grad_accum": 1}


# ---------------------------------------------------------------------------
# One run


def train_overrides(mode: str, model: dict, args, out_dir: Path, tp: int) -> list[str]:
    d = model["d_model"]
    return [
        "model.name=gpt-tiny", "model.arch=gpt", f"model.d_model={d}",
        f"model.n_layer={model['n_layer']}", f"model.n_head={model['n_head']}",
        f"model.n_kv_heads={model['n_head']}", f"model.ffn_hidden={4 * d}",
        f"model.seq_len={model['seq_len']}", f"model.vocab_size={args.vocab_size}",
        f"parallel.tp={tp}", "parallel.device=cpu", "parallel.backend=gloo",
        f"parallel.timeout_s={args.run_timeout}",
        *TRAIN_MODES[mode],
        f"train.steps={args.steps}", f"train.micro_batch_size={model['micro_batch_size']}",
        f"train.grad_accum={model['grad_accum']}",
        "train.log_interval=1", "wandb.mode=disabled", "data.kind=synthetic",
        "checkpoint.save_final=false", "checkpoint.interval=0", "eval.interval=0",
        f"out_dir={out_dir}",
    ]


def peer_args(model: dict, args, out_json: Path) -> list[str]:
    return ["--d-model", str(model["d_model"]), "--n-layer", str(model["n_layer"]),
            "--n-head", str(model["n_head"]), "--seq-len", str(model["seq_len"]),
            "--micro-batch-size", str(model["micro_batch_size"]), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--out-json", str(out_json)]


def error_summary(outputs: list[str], limit: int = 300) -> str:
    """The most telling line of failed runs' output (an ``error:`` line, an exception)."""
    pat = re.compile(r"(^error: |Error\b|Exception\b|Traceback|Killed|Timeout|timed out)")
    noise = re.compile(r"(ChildFailedError|torch/distributed/elastic|elastic/multiprocessing|"
                       r"^\s*(File|raise|return|\^)|^=+$|^-+$|error_file|traceback :|"
                       r"To enable traceback)")
    best = ""
    for out in outputs:
        for ln in out.splitlines():
            ln = ln.strip()
            if ln and pat.search(ln) and not noise.search(ln) and ln != "Traceback (most recent call last):":
                best = ln  # the last such line is usually the cause
        if best:
            break
    if not best:
        tails = [ln.strip() for out in outputs for ln in out.splitlines() if ln.strip()]
        best = tails[-1] if tails else "no output"
    return best[:limit]


def run_one(cluster: EmulatedCluster, mode: str, model: dict, args, out_dir: Path) -> dict:
    spec = cluster.spec
    world = spec.nodes * spec.devices_per_node
    dp = world // args.tp
    rec: dict = {"cluster": spec.name, "mode": mode, "ok": False, "error": None}
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if mode in PEER_MODES and model["grad_accum"] != 1:
        rec["error"] = "the peer scripts run one micro-batch per step (grad_accum=1)"
        rec["skip_retries"] = True
        return rec
    if mode in PEER_MODES:
        script = PEERS / PEER_MODES[mode]
        if not script.is_file():
            rec["error"] = f"{script.relative_to(REPO)} does not exist"
            rec["skip_retries"] = True
            return rec
        out_json = out_dir / "peer.json"
        script_args = peer_args(model, args, out_json)
        cmd = lambda i: cluster.torchrun_command(i, script_args, str(script), port)  # noqa: E731
    else:
        script_args = train_overrides(mode, model, args, out_dir, args.tp)
        cmd = lambda i: cluster.torchrun_command(i, script_args, "train.py", port)  # noqa: E731
    rec["command_node0"] = shlex.join(cmd(0))
    rec["loadavg_1min_before"] = round(os.getloadavg()[0], 2)  # other tenants skew timings
    t0 = time.monotonic()
    results = cluster.run(cmd, timeout=args.run_timeout)
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    (out_dir / "node0.log").write_text(results[0].output)
    if len(results) > 1:
        (out_dir / "node1.log").write_text(results[1].output)
    failed = [r for r in results if not r.ok]
    if failed:
        if any(r.timed_out for r in failed):
            rec["error"] = f"timed out after {args.run_timeout:.0f} s"
        else:
            rec["error"] = error_summary([r.output for r in failed if r.returncode]
                                         + [r.output for r in results])
        return rec
    try:
        if mode in PEER_MODES:
            data = json.loads(out_json.read_text())
            times = [float(t) for t in data["step_times_s"]]
            tokens = int(data["tokens_per_step"])
            # a peer reports every step, or only the timed ones (after its --warmup)
            times = times[args.warmup:] if len(times) >= args.steps else times
        else:
            recs = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines()
                    if ln.strip()]
            times = [r["step_time_s"] for r in recs if "step_time_s" in r and r["step"] > args.warmup]
            tokens = model["micro_batch_size"] * model["grad_accum"] * model["seq_len"] * dp
    except (OSError, ValueError, KeyError, TypeError) as e:
        rec["error"] = f"could not read the step times: {type(e).__name__}: {e}"
        return rec
    if not times:
        rec["error"] = "no timed steps (is --steps larger than --warmup?)"
        return rec
    rec.update(ok=True, step_times_s=times, step_time_s=statistics.median(times),
               tokens_per_step=tokens)
    return rec


# ---------------------------------------------------------------------------
# Summary


def summarize(runs: list[dict], clusters: list[ClusterSpec], modes: list[str]) -> dict:
    out = {}
    for spec in clusters:
        per = {}
        for mode in modes:
            rs = [r for r in runs if r["cluster"] == spec.name and r["mode"] == mode]
            ok = [r for r in rs if r["ok"]]
            if not ok:
                errs = [r["error"] for r in rs if r.get("error")]
                per[mode] = {"ok": False, "error": errs[0] if errs else "not run",
                             "repeats": 0}
                continue
            t = statistics.median(r["step_time_s"] for r in ok)
            per[mode] = {"ok": True, "step_time_s": t,
                         "step_time_s_repeats": [r["step_time_s"] for r in ok],
                         "tokens_per_step": ok[0]["tokens_per_step"],
                         "tokens_per_s": ok[0]["tokens_per_step"] / t, "repeats": len(ok),
                         "failed_repeats": len(rs) - len(ok)}
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
        mf, mfn = per.get("megatron+full", {}), per.get("megatron+full+nocomm", {})
        comm_share = ((mf["step_time_s"] - mfn["step_time_s"]) / mf["step_time_s"]
                      if mf.get("ok") and mfn.get("ok") else None)
        targets = []
        for desc, num, den, need in TARGETS:
            a, b = per.get(num), per.get(den)
            if a is None or b is None:
                continue
            if a["ok"] and b["ok"]:
                ratio = a["tokens_per_s"] / b["tokens_per_s"]
                targets.append({"target": desc, "ratio": ratio, "need": need,
                                "status": "PASS" if ratio >= need else "FAIL",
                                "figures": f"{a['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f} tok/s"})
            else:
                missing = [m for m, x in ((num, a), (den, b)) if not x["ok"]]
                targets.append({"target": desc, "ratio": None, "need": need, "status": "N/A",
                                "figures": f"{', '.join(missing)} failed"})
        out[spec.name] = {"gbps": spec.inter_node_bandwidth_gbps, "modes": per,
                          "exposed_reference": ref, "megatron_full_comm_share": comm_share,
                          "targets": targets}
    return out


def write_markdown(path: Path, meta: dict, summary: dict, modes: list[str]) -> None:
    m, mi = meta["model"], meta["machine"]
    L = [f"# Overlapped TP on a slow link ({meta['tag']})", "",
         f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['mem_gib']} GiB, Linux {mi['kernel']}, "
         f"Python {mi['python']}, torch {mi['torch']}, oases {mi['git']}, {mi['date']}.", "",
         f"Command: `{meta['command']}` ({meta['elapsed_min']:.1f} min)"
         + (" -- **interrupted**: partial results." if meta.get("interrupted") else "."), "",
         f"Emulated cluster: 2 nodes (network namespaces) x 1 CPU process, tp=2 across the link "
         f"(gloo, OMP_NUM_THREADS=1), link shaped with tc tbf (benchmarks/cluster.py). "
         f"Model: GPT d_model {m['d_model']}, {m['n_layer']} layers, {m['n_head']} heads, "
         f"ffn {4 * m['d_model']}, vocab {meta['vocab_size']}, seq {m['seq_len']}, micro batch "
         f"{m['micro_batch_size']} x {m.get('grad_accum', 1)} per step, fp32. Each figure: median over {meta['repeats']} repeats "
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
        for mode in modes:
            r = s["modes"].get(mode)
            if r is None:
                continue
            if not r["ok"]:
                L.append(f"| {mode} | failed | | | | {r['error'].replace('|', '/')} |")
                continue
            reps = ", ".join(f"{t:.3f}" for t in r["step_time_s_repeats"])
            ratio = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] else "n/a"
            exp = (f"{100 * r['exposed_comm_fraction']:.0f}%"
                   if r["exposed_comm_fraction"] is not None else "n/a")
            L.append(f"| {mode} | {r['step_time_s']:.3f} | {reps} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio} | {exp} |")
        if s["targets"]:
            L += ["", "| target | measured | result |", "|---|---|---|"]
            for t in s["targets"]:
                got = f"{t['ratio']:.3f}x ({t['figures']})" if t["ratio"] else t["figures"]
                L.append(f"| {t['target']} | {got} | **{t['status']}** |")
        L.append("")
    loads = [r["loadavg_1min_before"] for r in meta.get("runs", []) if "loadavg_1min_before" in r]
    if loads:
        L += [f"Machine load (1-min load average before each run; the benchmark itself adds "
              f"~2): min {min(loads):.1f}, median {statistics.median(loads):.1f}, max "
              f"{max(loads):.1f}. Other tenants' CPU load slows compute but not the shaped "
              f"link, so it lowers the communication share; trust runs on a quiet machine.", ""]
    L += ["Raw numbers (every run's step times, errors, node-0 commands): "
          f"`{Path(meta['json']).name}`; chart: `{Path(meta['png']).name}`.", ""]
    path.write_text("\n".join(L))


def write_plot(path: Path, summary: dict, modes: list[str]) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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


# ---------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", nargs="+", default=DEFAULT_CLUSTERS, help="cluster files")
    p.add_argument("--modes", nargs="+", default=None, choices=ALL_MODES, metavar="MODE",
                   help=f"subset of: {' '.join(ALL_MODES)} (default: every mode that runs at "
                        f"the shape's grad_accum: the peers at 1, the paired modes at >= 2)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (fresh processes each run)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped before the median")
    p.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                   help="shape overrides: d_model, n_layer, n_head, seq_len, micro_batch_size, grad_accum "
                        f"(default {' '.join(f'{k}={v}' for k, v in DEFAULT_MODEL.items())})")
    p.add_argument("--vocab-size", type=int, default=256, help="train.py vocabulary (peers choose their own)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds before a run is killed")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 repeat, 4 steps (1 warmup); writes overlap-quick.*")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/overlap)")
    p.add_argument("--workdir", default=None, help="run directories (default runs/bench-overlap/<time>)")
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="only re-write the .md and .png of a saved overlap .json (no runs, no root)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 4, 1
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    model = dict(DEFAULT_MODEL)
    for kv in args.model:
        k, _, v = kv.partition("=")
        k = k.replace("-", "_")
        if k == "mbs":
            k = "micro_batch_size"
        if k not in model or not v.isdigit():
            p.error(f"--model {kv}: expected one of {', '.join(model)} = a positive integer")
        model[k] = int(v)
    if model["d_model"] % model["n_head"] or model["n_head"] % args.tp:
        p.error(f"--model: n_head {model['n_head']} must divide d_model {model['d_model']} "
                f"and be divisible by tp {args.tp}")
    args.model_shape = model
    if args.modes is None:
        skip = PAIRED_MODES if model["grad_accum"] < 2 else set(PEER_MODES)
        args.modes = [m for m in ALL_MODES if m not in skip]
    args.modes = list(dict.fromkeys(args.modes))
    return args


def rerender(path: Path) -> int:
    data = json.loads(path.read_text())
    meta, summary, runs = data["meta"], data["summary"], data["runs"]
    write_markdown(path.with_suffix(".md"), {**meta, "runs": runs}, summary, meta["modes"])
    warn = write_plot(path.with_suffix(".png"), summary, meta["modes"])
    if warn:
        print(f"warning: {warn}", file=sys.stderr)
    print(f"re-wrote {path.with_suffix('.md')} and .png from {path}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return rerender(Path(args.from_json))
    try:
        check_prerequisites()
        specs = [ClusterSpec.load(c) for c in args.clusters]
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
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
    out = Path(args.out) if args.out else RESULTS / ("overlap-quick" if args.quick else "overlap")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = Path(args.workdir) if args.workdir else REPO / "runs" / "bench-overlap" / stamp
    exe = sys.executable
    if Path(exe).resolve().is_relative_to(REPO) or exe.startswith(str(REPO)):
        exe = os.path.relpath(exe, REPO)
    command = " ".join(shlex.quote(a) for a in
                       [exe, os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    t_start = time.monotonic()
    runs: list[dict] = []
    n_total = len(specs) * args.repeats * len(args.modes)
    print(f"overlap: {len(specs)} cluster(s) x {args.repeats} repeats x {len(args.modes)} modes "
          f"= {n_total} runs; model {model}; work dir {workdir}", flush=True)
    interrupted = False
    try:
        for spec in specs:
            dead: set[str] = set()
            with EmulatedCluster(spec) as cluster:
                for rnd in range(args.repeats):
                    for mode in args.modes:
                        if mode in dead:
                            continue
                        rdir = workdir / spec.name / mode.replace("+", "-") / f"r{rnd}"
                        rec = run_one(cluster, mode, model, args, rdir)
                        rec["round"] = rnd
                        runs.append(rec)
                        el = (time.monotonic() - t_start) / 60
                        if rec["ok"]:
                            print(f"[{el:5.1f} min] {spec.name} r{rnd} {mode:22s} "
                                  f"{rec['step_time_s']:.3f} s/step "
                                  f"({rec['tokens_per_step'] / rec['step_time_s']:,.0f} tok/s, "
                                  f"run {rec['wall_s']:.0f} s)", flush=True)
                        else:
                            dead.add(mode)  # not retried on this cluster
                            print(f"[{el:5.1f} min] {spec.name} r{rnd} {mode:22s} FAILED: "
                                  f"{rec['error']}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: writing the results so far", file=sys.stderr)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = (time.monotonic() - t_start) / 60
    summary = summarize(runs, specs, args.modes)
    meta = {"tag": "quick" if args.quick else "full", "command": command,
            "machine": machine_info(), "model": model, "vocab_size": args.vocab_size,
            "tp": args.tp, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
            "modes": args.modes, "clusters": args.clusters, "elapsed_min": elapsed,
            "interrupted": interrupted, "json": str(out.with_suffix(".json")),
            "png": str(out.with_suffix(".png"))}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "runs": runs}, indent=1))
    write_markdown(out.with_suffix(".md"), {**meta, "runs": runs}, summary, args.modes)
    warn = write_plot(out.with_suffix(".png"), summary, args.modes)
    if warn:
        print(f"warning: {warn}", file=sys.stderr)
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.with_suffix('.md')}, .json, .png in {elapsed:.1f} min")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
