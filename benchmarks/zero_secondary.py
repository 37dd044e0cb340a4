"""ZeRO-3 with and without its node-local secondary shard, dp = 4 on two nodes of two.

    sudo .venv/bin/python -m benchmarks.zero_secondary            # needs root (network namespaces)
    sudo .venv/bin/python -m benchmarks.zero_secondary --rounds 1 --steps 3 --warmup 1  # smoke

The emulated cluster (default configs/cluster/two-nodes-2dev-500m.yaml: 2 nodes x 2
processes, 500 Mbit/s between them, loopback inside a node) runs dp = 4 (tp = 1) at
``parallel.zero=3``: each DP group spans both nodes, two of its ranks on each. Modes,
``oases`` engine with ``recompute=fine``, interleaved in ``--rounds`` rounds of fresh
processes (the zero benchmark's driver):

* ``z3``: every all-gather of a block's parameters runs over the four ranks, so each
  forward, recompute and backward gather crosses the link;
* ``z3+node`` (``parallel.zero_secondary=node``): only the first gather of each bucket
  after a step crosses; the others run over the node's two ranks.

Besides tokens/s: the bytes that crossed the link, read from every node's veth
(``/sys/class/net/<if>/statistics/tx_bytes`` inside its namespace) before and after
each run, divided by the run's steps (start-up's rendezvous and first broadcasts
included, alike in both modes). Writes benchmarks/results/zero_secondary.{md,json}.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.lib import driver, train_run

BASE = ["parallel.schedule=oases", "parallel.recompute=fine", "parallel.zero=3"]
MODES = {"z3": BASE, "z3+node": [*BASE, "parallel.zero_secondary=node"]}
# 6 layers: 14 units, more than the parameter store keeps gathered (4 + 2 ahead), so the
# backward gathers blocks again; two micro-batches: the second forward gathers again too
DEFAULT_MODEL = {"d_model": 512, "n_layer": 6, "n_head": 8, "seq_len": 128,
                 "micro_batch_size": 2, "grad_accum": 2}


def tx_bytes(cluster) -> int:
    """Bytes sent so far by every node's link (its veth, inside its namespace)."""
    total = 0
    for i, ns in enumerate(cluster.node_ns):
        out = subprocess.run(["ip", "netns", "exec", ns, "cat",
                              f"/sys/class/net/{cluster.ifname(i)}/statistics/tx_bytes"],
                             capture_output=True, text=True, check=True).stdout
        total += int(out)
    return total


_timed = train_run.cluster_measure(MODES, ("zero_gather_wait_s",))


def measure(cluster, mode: str, args) -> dict:
    before = tx_bytes(cluster)
    rec = _timed(cluster, mode, args)
    rec["link_mb_per_step"] = (tx_bytes(cluster) - before) / args.steps / 1e6
    return rec


def render(out: Path, data: dict) -> None:
    meta, per = data["meta"], {m: r for m, r in data["modes"].items() if r["ok"]}
    lines = [*driver.report_head(f"# ZeRO-3's node-local secondary shard on "
                                 f"{Path(meta['cluster']).stem} (dp = 4 over 2 nodes x 2, "
                                 "tp = 1)", meta),
             f"Model GPT {meta['model_shape']}, oases engine, recompute fine, "
             f"{meta['steps']} steps, median after {meta['warmup']}, {meta['rounds']} "
             "rounds, modes interleaved.", "",
             "| mode | s/step | tokens/s | vs z3 | MB across the link per step | "
             "gather wait s/step |", "|---|---:|---:|---:|---:|---:|"]
    z3 = per.get("z3")
    for mode, r in per.items():
        ratio = f"{z3['step_time_s'] / r['step_time_s']:.2f}x" if z3 else "-"
        wait = r.get("zero_gather_wait_s")
        lines.append(f"| {mode} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_step'] / r['step_time_s']:,.0f} | {ratio} | "
                     f"{r['link_mb_per_step']:.1f} | {'-' if wait is None else f'{wait:.3f}'} |")
    lines += driver.per_round_line(data, "MB across the link per step",
                                   lambda r: f"{r['link_mb_per_step']:.1f}")
    lines += driver.failed_runs(data)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


SUITE = driver.Suite(
    "zero_secondary", "benchmarks.zero_secondary", MODES, measure, render,
    metrics=("step_time_s", "tokens_per_step", "link_mb_per_step", "zero_gather_wait_s"),
    min_rounds=1,
    flags=train_run.cluster_flags("configs/cluster/two-nodes-2dev-500m.yaml", DEFAULT_MODEL,
                                  tp=1, steps=6, warmup=2),
    setup=train_run.cluster_setup("zero_secondary", DEFAULT_MODEL), fatal=train_run.FATAL)

if __name__ == "__main__":
    sys.exit(driver.run_suite(SUITE, __doc__))
