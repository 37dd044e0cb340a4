"""The logged exposed-communication figure against step times, on the emulated cluster.

    sudo .venv/bin/python -m benchmarks.comm_exposed                 # 3 repeats, 500 Mbit/s
    sudo .venv/bin/python -m benchmarks.comm_exposed --cluster configs/cluster/two-nodes-300m.yaml
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

import sys
from pathlib import Path

from benchmarks import overlap
from benchmarks.lib import driver, train_run

MODES = {m: overlap.TRAIN_MODES[m] for m in ("megatron+full", "oases+fine", "nocomm")}
FIGURES = ("tp_comm_exposed_s", "tp_comm_s", "tp_comm_hidden_frac")


def summarize(per: dict) -> dict:
    """The orders and the checks, from the modes' medians."""
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
    meta = data["meta"]
    s = data.get("summary") or summarize(data["modes"])  # older results kept the summary

    def cell(v, pct=False):
        return "n/a" if v is None else (f"{100 * v:.0f}%" if pct else f"{v:.3f}")

    L = [*driver.report_head("# Exposed TP communication, as the run logs it", meta),
         f"Emulated cluster {Path(meta['cluster']).stem}: 2 nodes x 1 CPU process, tp=2 across "
         f"the shaped link (benchmarks.overlap's shape {meta.get('model_shape', meta['model'])})."
         f" Per mode: median over {meta.get('rounds', meta.get('repeats'))} repeats of each "
         f"run's median of steps {meta['warmup'] + 1}.."
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


SUITE = driver.Suite(
    "comm_exposed", "benchmarks.comm_exposed", MODES, train_run.cluster_measure(MODES, FIGURES),
    render, metrics=("step_time_s", *FIGURES), min_rounds=1, fatal=train_run.FATAL,
    flags=train_run.cluster_flags(overlap.DEFAULT_CLUSTERS[0], overlap.DEFAULT_MODEL, tp=2),
    setup=train_run.cluster_setup("comm-exposed", overlap.DEFAULT_MODEL),
    exit_code=lambda data: 0 if all(c["ok"] for c in summarize(data["modes"])["checks"]) else 1)

if __name__ == "__main__":
    sys.exit(driver.run_suite(SUITE, __doc__))
