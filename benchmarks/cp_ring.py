"""Context parallelism on a slow link: the ring's transfers hidden behind attention, or
waited for.

    sudo .venv/bin/python -m benchmarks.cp_ring                 # needs root (network namespaces)
    sudo .venv/bin/python -m benchmarks.cp_ring --rounds 1 --steps 4 --warmup 1   # a smoke run

The 2-node emulated cluster (default configs/cluster/two-nodes-500m.yaml, one process
per node) runs cp = 2 (tp = 1, dp = 1): each rank holds half of every sequence, and
every ring exchange, as every gradient byte, crosses the shaped link. In ``--rounds``
rounds every mode runs once, round-robin, in fresh processes; a mode's figure is the
median over rounds of the median step time after ``--warmup`` steps (the zero
benchmark's driver).

Modes, each engine with the ring overlapped and waited:

* ``cp2`` (``megatron``): the receive of each ring step's next kv block posted before the
  current block's attention, waited after it;
* ``cp2-waited``: ``parallel.cp_overlap=false``, each transfer waited at once, before the
  attention;
* ``cp2-oases`` (``oases``, two sub-batches): as ``cp2``, and where a sub-batch would wait
  for a transfer it yields, the other sub-batch computing meanwhile;
* ``cp2-oases-waited``: the ``oases`` engine with ``parallel.cp_overlap=false``.

An engine's hidden share of the ring's time is 1 - wait(overlapped) / wait(waited),
where wait is rank 0's time blocked on ring transfers per step (``cp_ring_wait_s`` in
metrics.jsonl): waited at once, the whole transfer is exposed. Beside it, the transfer time the ring's
bytes take at the link's rate: per layer and micro-batch, cp - 1 kv blocks in forward,
cp - 1 kv blocks and cp fp32 dk/dv accumulators in backward (recompute=none), each
(2, B, H, T/cp, D) fp32 on this CPU cluster, one message per direction per exchange.

Writes benchmarks/results/cp_ring.{md,json}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from benchmarks.lib import driver, train_run

CP = 2
MODES = {"cp2": [f"parallel.cp={CP}", "parallel.schedule=megatron", "parallel.recompute=none"]}
MODES["cp2-waited"] = [*MODES["cp2"], "parallel.cp_overlap=false"]
MODES["cp2-oases"] = [f"parallel.cp={CP}", "parallel.schedule=oases", "parallel.sub_batches=2",
                      "parallel.recompute=none"]
MODES["cp2-oases-waited"] = [*MODES["cp2-oases"], "parallel.cp_overlap=false"]
PAIRS = (("cp2", "cp2-waited"), ("cp2-oases", "cp2-oases-waited"))  # (overlapped, waited)
# long enough that a ring step's attention is of the order of its transfer
DEFAULT_MODEL = {"d_model": 256, "n_layer": 2, "n_head": 4, "seq_len": 2048,
                 "micro_batch_size": 2, "grad_accum": 1}  # 2 rows: the oases sub-batches


def ring_seconds(model: dict, gbps: float, cp: int = CP) -> tuple[float, float]:
    """(bytes per direction per step, seconds at ``gbps``) of the ring's messages."""
    d, h, t = model["d_model"], model["n_head"], model["seq_len"]
    msg = 2 * model["micro_batch_size"] * h * (t // cp) * (d // h) * 4   # fp32 (2, B, H, Tl, D)
    per_layer = (cp - 1) + (cp - 1) + cp                                # fwd kv, bwd kv + acc
    total = msg * per_layer * model["n_layer"] * model["grad_accum"]
    return total, total * 8 / (gbps * 1e9)


def render(out: Path, data: dict) -> None:
    meta, per = data["meta"], {m: r for m, r in data["modes"].items() if r["ok"]}
    model = meta["model_shape"]
    rows = model["micro_batch_size"] * model["grad_accum"]  # dp = 1: cp ranks share rows
    lines = [*driver.report_head(f"# Context parallelism on {Path(meta['cluster']).stem} "
                                 f"(cp = {CP} across the link, tp = 1, dp = 1)", meta),
             f"Model GPT {model}, {meta['steps']} steps, median after {meta['warmup']}, "
             f"{meta['rounds']} rounds, modes interleaved.", "",
             "| mode | s/step | tokens/s | ring wait s/step |", "|---|---:|---:|---:|"]
    for mode, r in per.items():
        wait = r.get("cp_ring_wait_s")
        lines.append(f"| {mode} | {r['step_time_s']:.3f} | "
                     f"{rows * model['seq_len'] / r['step_time_s']:,.0f} | "
                     f"{'-' if wait is None else f'{wait:.3f}'} |")
    lines += driver.per_round_line(data, "ring wait s/step",
                                   lambda r: f"{r.get('cp_ring_wait_s') or 0:.3f}")
    gbps = meta.get("link_gbps")
    if gbps:
        nbytes, ring = ring_seconds(model, gbps)
        lines += ["", f"The ring's messages: {nbytes / 2**20:.1f} MiB per direction per step, "
                      f"{ring:.3f} s at {gbps * 1000:.0f} Mbit/s."]
    for a, b in PAIRS:
        on, off = per.get(a), per.get(b)
        if not (on and off):
            continue
        lines += ["", f"{a} against {b}: the overlap saves "
                      f"{off['step_time_s'] - on['step_time_s']:.3f} s per step "
                      f"({off['step_time_s'] / on['step_time_s']:.2f}x tokens/s)."]
        w_on, w_off = on.get("cp_ring_wait_s"), off.get("cp_ring_wait_s")
        if w_on is not None and w_off:
            lines[-1] += (f" Hidden share of the ring's time: {1 - w_on / w_off:.0%} (rank 0 "
                          f"waits {w_on:.3f} s per step overlapped, {w_off:.3f} s waiting at "
                          f"once).")
    lines += driver.failed_runs(data)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _meta(args, cluster) -> dict:
    spec = yaml.safe_load(Path(args.cluster).read_text())
    return {"link_gbps": float(spec["inter_node_bandwidth_gbps"])}


SUITE = driver.Suite(
    "cp_ring", "benchmarks.cp_ring", MODES, train_run.cluster_measure(MODES, ("cp_ring_wait_s",)),
    render, metrics=("step_time_s", "cp_ring_wait_s"), min_rounds=1, meta=_meta,
    flags=train_run.cluster_flags("configs/cluster/two-nodes-500m.yaml", DEFAULT_MODEL, tp=1,
                                  steps=8, warmup=3),
    setup=train_run.cluster_setup("cp_ring", DEFAULT_MODEL), fatal=train_run.FATAL)

if __name__ == "__main__":
    sys.exit(driver.run_suite(SUITE, __doc__))
