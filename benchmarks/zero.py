"""ZeRO levels on a slow link: tokens/s at parallel.zero 0-3, megatron and oases engines.

    sudo .venv/bin/python -m benchmarks.zero                 # needs root (network namespaces)
    sudo .venv/bin/python -m benchmarks.zero --quick         # smoke run, 1 repeat

The 2-node emulated cluster (default configs/cluster/two-nodes-500m.yaml, one process
per node) runs dp = 2 (tp = 1): every data-parallel byte crosses the shaped link. In
``--repeats`` rounds every mode runs once, round-robin, in fresh processes (so noise
hits all modes alike); a mode's figure is the median over rounds of the median step
time after ``--warmup`` steps (benchmarks.lib.driver's rounds, benchmarks.lib.train_run's
runs, as the overlap benchmark's).

Modes: ``<engine>+z<level>`` for engine megatron (recompute none) and oases (recompute
fine), level 0-3; and ``oases+z3-noprefetch`` (parallel.zero_prefetch=false: each
block's all-gather waited where it is needed). The hidden fraction of ZeRO-3's
all-gather time is 1 - wait(oases+z3) / wait(oases+z3-noprefetch), where wait is
rank 0's time blocked on all-gathers per step (``zero_gather_wait_s`` in
metrics.jsonl): without prefetch the whole gather time is exposed.

Target: oases+z3 within 10% of oases+z0's tokens/s.
Writes benchmarks/results/zero.{md,json} (``--quick``: zero-quick.*).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import sys
from functools import partial
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.cluster import ClusterError, ClusterSpec, EmulatedCluster, check_prerequisites
from benchmarks.lib.train_run import timed_run

REPO = driver.REPO
ENGINES = {"megatron": ["parallel.schedule=megatron", "parallel.recompute=none"],
           "oases": ["parallel.schedule=oases", "parallel.recompute=fine"]}
MODES = {f"{e}+z{z}": [*ov, f"parallel.zero={z}"] for e, ov in ENGINES.items() for z in range(4)}
MODES["oases+z3-noprefetch"] = [*MODES["oases+z3"], "parallel.zero_prefetch=false"]
# deeper than the overlap benchmark's default, so a block's gather has a block's compute to hide behind
DEFAULT_MODEL = {"d_model": 512, "n_layer": 4, "n_head": 8, "seq_len": 128, "micro_batch_size": 8}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", default="configs/cluster/two-nodes-500m.yaml")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--run-timeout", type=float, default=300.0)
    p.add_argument("--micro-batch-size", type=int, default=DEFAULT_MODEL["micro_batch_size"],
                   help="more tokens per step: more compute for the same parameter traffic")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/zero)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.repeats, a.steps, a.warmup = 1, 4, 1
    a.tp, a.model_shape = 1, {**DEFAULT_MODEL, "micro_batch_size": a.micro_batch_size}
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        check_prerequisites()
        spec = ClusterSpec.load(args.cluster)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else driver.RESULTS / ("zero-quick" if args.quick else "zero")
    workdir = REPO / "runs" / "bench-zero" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    model = {**args.model_shape, "grad_accum": 1}

    def one(cluster, mode, rnd):
        rdir = workdir / mode.replace("+", "-") / f"r{rnd}"
        rec = timed_run(cluster, mode, MODES[mode], model, args, rdir,
                        fields=("zero_gather_wait_s",))
        rec["wait_s"] = rec.pop("zero_gather_wait_s", None)
        return rec

    def line(rec, minutes):
        msg = (f"{rec['step_time_s']:.3f} s/step, gather wait {rec['wait_s']}"
               if rec["ok"] else f"FAILED: {rec['error']}")
        return f"[{minutes:5.1f} min] r{rec['round']} {rec['mode']:22s} {msg}"

    runs, _, minutes = driver.run_rounds([(partial(EmulatedCluster, spec), args.modes)],
                                         args.repeats, one, line, skip_failed=False,
                                         catch_interrupt=False)

    def waits(mode: str, ok: list[dict]) -> dict:
        w = [r["wait_s"] for r in ok if r["wait_s"] is not None]
        return {"wait_s": statistics.median(w) if w else None}

    per = driver.mode_medians(runs, args.modes, waits)
    summary = {mode: {"step_time_s": r["step_time_s"], "tokens_per_s": r["tokens_per_s"],
                      "runs": r["repeats"], "wait_s": r["wait_s"]}
               for mode, r in per.items() if r["ok"]}
    write(out, args, spec, summary, runs, minutes)
    print(out.with_suffix(".md").read_text())
    return 0


def write(out: Path, args, spec, summary: dict, runs: list, minutes: float) -> None:
    cmd = shlex.join([".venv/bin/python", "-m", "benchmarks.zero", *sys.argv[1:]])
    lines = [f"# ZeRO levels on {spec.name} (dp = 2 across the link, tp = 1)", "",
             f"`{cmd}` (root); model {args.model_shape}, {args.steps} steps, median after "
             f"{args.warmup}, {args.repeats} rounds, modes interleaved; {minutes:.0f} min.", "",
             "| mode | s/step | tokens/s | vs z0 (same engine) | gather wait s/step |",
             "|---|---:|---:|---:|---:|"]
    for mode, r in summary.items():
        base = summary.get(mode.split("+")[0] + "+z0")
        ratio = f"{base['step_time_s'] / r['step_time_s']:.2f}x" if base else "-"
        wait = f"{r['wait_s']:.3f}" if r["wait_s"] is not None else "-"
        lines.append(f"| {mode} | {r['step_time_s']:.3f} | {r['tokens_per_s']:,.0f} | {ratio} "
                     f"| {wait} |")
    z3, nopf = summary.get("oases+z3"), summary.get("oases+z3-noprefetch")
    if z3 and nopf and z3["wait_s"] is not None and nopf["wait_s"]:
        hidden = 1 - z3["wait_s"] / nopf["wait_s"]
        lines += ["", f"Hidden fraction of ZeRO-3 all-gather time (oases): {hidden:.0%} "
                      f"(wait {z3['wait_s']:.3f} s/step with prefetch, {nopf['wait_s']:.3f} "
                      f"without)."]
        summary["hidden_fraction"] = hidden
    z0 = summary.get("oases+z0")
    if z3 and z0:
        r = z0["step_time_s"] / z3["step_time_s"]
        lines += ["", f"Target oases+z3 >= 0.90x oases+z0 tokens/s: {r:.2f}x "
                      f"({'met' if r >= 0.9 else 'missed'})."]
    failed = [r for r in runs if not r["ok"]]
    if failed:
        lines += ["", "Failed runs:"] + [f"- {r['mode']} r{r['round']}: {r['error']}"
                                          for r in failed]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"command": cmd, "model": args.model_shape, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
