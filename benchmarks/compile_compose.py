"""``parallel.compile`` with the other parallel paths: compiled against eager losses.

    .venv/bin/python -m benchmarks.compile_compose           # ~5 min on 2 cores, no root

Each layout trains gpt-tiny for 4 steps with dropout 0.1 through ``torchrun
--nproc_per_node=2 train.py``, eager and then compiled, and compares the 4 losses:
pipelines (pp = 2, 1F1B), ZeRO-3 (dp = 2), ``overlap_fb``, bf16 autocast, per-block TP
degrees (a plan file) and sequence parallelism under both engines. Dropout draws eager's masks in compiled code, so the losses agree
to float rounding (fused float32 kernels: ~1e-7 relative; bf16: ~1e-5). Writes
``benchmarks/results/compile_compose.{md,json}``; ``--from-json`` writes the .md again from
the .json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.machine import machine_info
from benchmarks.lib.train_run import metrics

BASE = ["--config", "configs/gpt-tiny.yaml", "train.steps=4", "train.log_interval=1",
        "eval.interval=0", "checkpoint.save_final=false", "wandb.mode=disabled", "resume=none",
        "model.dropout=0.1"]
OASES = ["parallel.tp=2", "parallel.schedule=oases"]
LAYOUTS = {
    "pp=2, 1F1B, 4 micro-batches": ["parallel.tp=1", "parallel.pp=2", "train.grad_accum=4"],
    "dp=2, ZeRO-3": ["parallel.tp=1", "parallel.zero=3"],
    "tp=2, oases+fine, overlap_fb": [*OASES, "parallel.recompute=fine",
                                     "parallel.overlap_fb=true", "train.grad_accum=2"],
    "tp=2, oases+full, bf16": [*OASES, "parallel.recompute=full", "train.precision=bf16"],
    "tp=2, oases+fine, plan [2,1,2,1,2,1,2,1]": [*OASES, "parallel.recompute=fine",
                                                 "parallel.plan={plan}"],
    "tp=2, oases+fine, sequence parallel": [*OASES, "parallel.recompute=fine",
                                            "parallel.sequence_parallel=true"],
    "tp=2, megatron+full, sequence parallel": ["parallel.tp=2", "parallel.recompute=full",
                                               "parallel.sequence_parallel=true"],
}


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out) if "loss" in r]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(driver.RESULTS / "compile_compose"))
    p.add_argument("--from-json", help="re-render the report from a result's .json")
    args = p.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render)
    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        plan = Path(d) / "plan.yaml"
        plan.write_text("degrees: [2, 1, 2, 1, 2, 1, 2, 1]\n")
        for name, extra in LAYOUTS.items():
            got = {}
            for compiled in ("false", "true"):
                out = Path(d) / f"{len(rows)}-{compiled}"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=2", "train.py", *BASE, f"out_dir={out}",
                       f"parallel.compile={compiled}", *(e.format(plan=plan) for e in extra)]
                proc = subprocess.run(cmd, cwd=driver.REPO, capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"{name} (compile={compiled}) failed:\n{proc.stderr[-2000:]}")
                got[compiled] = losses(out)
            e, c = got["false"], got["true"]
            diff = max(abs(a - b) / abs(a) for a, b in zip(e, c))
            rows.append({"layout": name, "eager": e, "compiled": c, "max_rel_diff": diff})
            print(f"{name}: max relative loss difference {diff:.2e}", flush=True)
    meta = {"command": driver.command("benchmarks.compile_compose", argv),
            "machine": machine_info(), "elapsed_min": (time.monotonic() - t0) / 60}
    driver.save(Path(args.out), {"meta": meta, "rows": rows}, render)
    return 0


def render(out: Path, data: dict) -> None:
    lines = [*driver.report_head("# `parallel.compile` with the other parallel paths",
                                 data["meta"]),
             "gpt-tiny, dropout 0.1, 4 steps, 2 processes, eager then compiled.", "",
             "| layout | eager losses | compiled losses | max relative difference |",
             "|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['layout']} | {', '.join(f'{x:.6f}' for x in r['eager'])} | "
                     f"{', '.join(f'{x:.6f}' for x in r['compiled'])} | "
                     f"{r['max_rel_diff']:.1e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
