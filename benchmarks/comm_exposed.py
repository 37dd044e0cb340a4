"""The logged exposed-communication figure against step times, on the emulated cluster.

    sudo .venv/bin/python -m benchmarks.comm_exposed                 # 3 repeats, 500 Mbit/s
    sudo .venv/bin/python -m benchmarks.comm_exposed --repeats 3 --clusters configs/cluster/two-nodes-300m.yaml
    .venv/bin/python -m benchmarks.comm_exposed --from-json benchmarks/results/comm_exposed.json

Runs megatron+full, oases+fine and nocomm (oases+fine with ``parallel.tp_comm_noop``)
as :mod:`benchmarks.overlap` does (same shape, tp=2 across two network namespaces over a
shaped link, fresh processes, modes round-robin), and reads each run's own
``tp_comm_exposed_s``, ``tp_comm_s`` and ``tp_comm_hidden_frac`` from its
``metrics.jsonl`` (median of the steps after ``--warmup``). Checks: the exposed seconds
order as the step times do, every hidden fraction lies in [0, 1], and oases+fine hides
more than megatron+full. Writes ``benchmarks/results/comm_exposed.{md,json}``.
"""

from __future__ import annotations

import datetime
import statistics
import sys
from functools import partial
from pathlib import Path

from benchmarks import overlap
from benchmarks.lib import driver
from benchmarks.lib.cluster import ClusterError, ClusterSpec, EmulatedCluster, check_prerequisites
from benchmarks.lib.machine import machine_info
from benchmarks.lib.train_run import timed_run

MODES = ["megatron+full", "oases+fine", "nocomm"]
FIGURES = ("tp_comm_exposed_s", "tp_comm_s", "tp_comm_hidden_frac")


def summarize(runs: list[dict]) -> dict:
    def extra(mode, ok):
        return {k: (statistics.median(r[k] for r in ok) if all(r.get(k) is not None for r in ok)
                    else None) for k in FIGURES}

    per = driver.mode_medians(runs, MODES, extra)
    ok = {m: r for m, r in per.items() if r["ok"]}
    by_time = sorted(ok, key=lambda m: ok[m]["step_time_s"])
    by_exposed = sorted(ok, key=lambda m: ok[m]["tp_comm_exposed_s"] or 0.0)
    fracs = {m: r["tp_comm_hidden_frac"] for m, r in ok.items()
             if r["tp_comm_hidden_frac"] is not None}
    checks = [("every mode ran", len(ok) == len(MODES)),
              ("exposed seconds order as the step times", by_time == by_exposed),
              ("every hidden fraction in [0, 1]", all(0.0 <= f <= 1.0 for f in fracs.values())),
              ("oases+fine hides more than megatron+full",
               fracs.get("oases+fine", 0.0) > fracs.get("megatron+full", 1.0))]
    return {"modes": per, "order_by_step_time": by_time, "order_by_exposed": by_exposed,
            "checks": [{"what": w, "ok": bool(v)} for w, v in checks]}


def render(out: Path, data: dict):
    meta, s = data["meta"], data["summary"]

    def cell(v, pct=False):
        return "n/a" if v is None else (f"{100 * v:.0f}%" if pct else f"{v:.3f}")

    L = [*driver.report_head("# Exposed TP communication, as the run logs it", meta),
         f"Emulated cluster {meta['cluster']}: 2 nodes x 1 CPU process, tp=2 across the shaped "
         f"link (benchmarks.overlap's shape {meta['model']}). Per mode: median over "
         f"{meta['repeats']} repeats of each run's median of steps {meta['warmup'] + 1}.."
         f"{meta['steps']}. The figures are the run's own `metrics.jsonl` fields "
         f"(oases.overlap.comm_clock). Absolute times depend on the machine's load (below): "
         f"compare within the table.", "",
         "| mode | step (s) | exposed TP comm (s/step) | TP comm (s/step) | hidden |",
         "|---|---|---|---|---|"]
    for mode in MODES:
        r = s["modes"].get(mode, {})
        if not r.get("ok"):
            L.append(f"| {mode} | failed: {r.get('error')} | | | |")
            continue
        L.append(f"| {mode} | {r['step_time_s']:.3f} | {cell(r['tp_comm_exposed_s'])} | "
                 f"{cell(r['tp_comm_s'])} | {cell(r['tp_comm_hidden_frac'], True)} |")
    L += ["", f"Order by step time: {', '.join(s['order_by_step_time'])}; by exposed "
              f"seconds: {', '.join(s['order_by_exposed'])}.", ""]
    L += [f"- {'PASS' if c['ok'] else 'FAIL'}: {c['what']}" for c in s["checks"]]
    loads = [r["loadavg_1min_before"] for r in data["runs"] if "loadavg_1min_before" in r]
    L += ["", *driver.load_line(loads, "Machine load (1-min load average before each run):"), ""]
    out.with_suffix(".md").write_text("\n".join(L))
    return None


def main(argv=None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    args = overlap.parse_args(["--modes", *MODES, "--repeats", "3", "--clusters",
                               overlap.DEFAULT_CLUSTERS[0], *argv])
    if args.from_json:
        return driver.rerender(Path(args.from_json), render)
    try:
        check_prerequisites()
        spec = ClusterSpec.load(args.clusters[0])
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = (Path(args.workdir) if args.workdir
               else driver.REPO / "runs" / "bench-comm-exposed" / stamp)

    def one(cluster, mode, rnd):
        rdir = workdir / mode.replace("+", "-") / f"r{rnd}"
        return timed_run(cluster, mode, overlap.TRAIN_MODES[mode], args.model_shape, args, rdir,
                         fields=FIGURES)

    def line(rec, minutes):
        return driver.run_line(f"r{rec['round']}", rec, minutes, 16)

    runs, interrupted, elapsed = driver.run_rounds(
        [(partial(EmulatedCluster, spec), MODES)], args.repeats, one, line)
    out = Path(args.out) if args.out else driver.RESULTS / "comm_exposed"
    meta = {"command": driver.command("benchmarks.comm_exposed", argv), "machine": machine_info(),
            "model": args.model_shape, "cluster": spec.name, "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats, "elapsed_min": elapsed}
    summary = summarize(runs)
    driver.save(out, {"meta": meta, "summary": summary, "runs": runs}, render)
    if interrupted:
        return 130
    return 0 if all(c["ok"] for c in summary["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
