"""ZeRO levels on a slow link: tokens/s at parallel.zero 0-3, megatron and oases engines.

    sudo .venv/bin/python -m benchmarks.zero                 # needs root (network namespaces)
    sudo .venv/bin/python -m benchmarks.zero --rounds 1 --steps 4 --warmup 1   # a smoke run

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
metrics.jsonl): without prefetch the whole gather time is exposed. The wire dtypes
(megatron engine, every level; each compared with z0 at the same dtypes):
``+reduce-bf16`` (``parallel.grad_reduce_dtype=bf16``: gradient sums in bf16),
``+autocast`` (``train.precision=bf16-autocast``: fp32 weights under autocast, level 3
gathers in bf16), ``+bf16`` (``train.precision=bf16``: bf16 weights over fp32 masters,
every gather in bf16) and ``+bf16+reduce-bf16``. Results written before bf16 weights
existed name the autocast mode ``+bf16``.

Target: oases+z3 within 10% of oases+z0's tokens/s.
Writes benchmarks/results/zero.{md,json}.
"""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.lib import driver, train_run

ENGINES = {"megatron": ["parallel.schedule=megatron", "parallel.recompute=none"],
           "oases": ["parallel.schedule=oases", "parallel.recompute=fine"]}
MODES = {f"{e}+z{z}": [*ov, f"parallel.zero={z}"] for e, ov in ENGINES.items() for z in range(4)}
MODES["oases+z3-noprefetch"] = [*MODES["oases+z3"], "parallel.zero_prefetch=false"]
# the wire dtypes (docs/zero.md): bf16 gradient sums; the two bf16 precisions
for z in range(4):
    MODES[f"megatron+z{z}+reduce-bf16"] = [*MODES[f"megatron+z{z}"],
                                           "parallel.grad_reduce_dtype=bf16"]
    MODES[f"megatron+z{z}+autocast"] = [*MODES[f"megatron+z{z}"],
                                        "train.precision=bf16-autocast"]
    MODES[f"megatron+z{z}+bf16"] = [*MODES[f"megatron+z{z}"], "train.precision=bf16"]
    MODES[f"megatron+z{z}+bf16+reduce-bf16"] = [*MODES[f"megatron+z{z}+bf16"],
                                                "parallel.grad_reduce_dtype=bf16"]
# deeper than the overlap benchmark's default, so a block's gather has a block's compute to hide behind
DEFAULT_MODEL = {"d_model": 512, "n_layer": 4, "n_head": 8, "seq_len": 128, "micro_batch_size": 8,
                 "grad_accum": 1}


def render(out: Path, data: dict) -> None:
    meta, per = data["meta"], {m: r for m, r in data["modes"].items() if r["ok"]}
    lines = [*driver.report_head(f"# ZeRO levels on {Path(meta['cluster']).stem} (dp = 2 "
                                 "across the link, tp = 1)", meta),
             f"Model {meta['model_shape']}, {meta['steps']} steps, median after "
             f"{meta['warmup']}, {meta['rounds']} rounds, modes interleaved.", "",
             "| mode | s/step | tokens/s | vs z0 (same engine) | gather wait s/step |",
             "|---|---:|---:|---:|---:|"]
    for mode, r in per.items():
        wire = mode.split("+")[2:]  # a wire-dtype mode: against z0 at the same dtypes
        base = per.get("+".join([mode.split("+")[0], "z0", *wire]))
        ratio = f"{base['step_time_s'] / r['step_time_s']:.2f}x" if base else "-"
        wait = r["zero_gather_wait_s"]
        lines.append(f"| {mode} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_step'] / r['step_time_s']:,.0f} | {ratio} "
                     f"| {'-' if wait is None else f'{wait:.3f}'} |")
    z3, nopf, z0 = (per.get(m) for m in ("oases+z3", "oases+z3-noprefetch", "oases+z0"))
    if z3 and nopf and z3["zero_gather_wait_s"] is not None and nopf["zero_gather_wait_s"]:
        a, b = z3["zero_gather_wait_s"], nopf["zero_gather_wait_s"]
        lines += ["", f"Hidden fraction of ZeRO-3 all-gather time (oases): {1 - a / b:.0%} "
                      f"(wait {a:.3f} s/step with prefetch, {b:.3f} without)."]
    if z3 and z0:
        r = z0["step_time_s"] / z3["step_time_s"]
        lines += ["", f"Target oases+z3 >= 0.90x oases+z0 tokens/s: {r:.2f}x "
                      f"({'met' if r >= 0.9 else 'missed'})."]
    lines += _against_fp32(per)
    lines += driver.failed_runs(data)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _against_fp32(per: dict) -> list[str]:
    """Runs with the ``+autocast`` modes (bf16 weights exist): each bf16 mode's tokens/s
    against the fp32 run at the same level (fp32 weights, fp32 gathers)."""
    if not any(m.endswith("+autocast") for m in per):
        return []
    out = ["", "Against fp32 at the same level (megatron engine), tokens/s:"]
    for z in range(4):
        base = per.get(f"megatron+z{z}")
        got = [(w, per.get(f"megatron+z{z}+{w}")) for w in
               ("autocast", "bf16", "bf16+reduce-bf16", "reduce-bf16")]
        if base:
            out.append(f"* z{z}: " + ", ".join(
                f"+{w} {base['step_time_s'] / r['step_time_s']:.2f}x" for w, r in got if r))
    return out


SUITE = driver.Suite(
    "zero", "benchmarks.zero", MODES, train_run.cluster_measure(MODES, ("zero_gather_wait_s",)),
    render, metrics=("step_time_s", "tokens_per_step", "zero_gather_wait_s"), min_rounds=1,
    flags=train_run.cluster_flags("configs/cluster/two-nodes-500m.yaml", DEFAULT_MODEL, tp=1),
    setup=train_run.cluster_setup("zero", DEFAULT_MODEL), fatal=train_run.FATAL)

if __name__ == "__main__":
    sys.exit(driver.run_suite(SUITE, __doc__))
