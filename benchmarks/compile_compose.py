"""``parallel.compile`` with the other parallel paths: compiled against eager losses.

    .venv/bin/python -m benchmarks.compile_compose           # ~5 min on 2 cores, no root

Each layout trains gpt-tiny for 4 steps with dropout 0.1 through ``torchrun
--nproc_per_node=2 train.py``, eager and then compiled, and compares the 4 losses:
pipelines (pp = 2, 1F1B), ZeRO-3 (dp = 2), ``overlap_fb``, bf16 autocast and per-block TP
degrees (a plan file). Dropout draws eager's masks in compiled code, so the losses agree
to float rounding (fused float32 kernels: ~1e-7 relative; bf16: ~1e-5). Writes
``benchmarks/results/compile_compose.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.machine import machine_info

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
}


def losses(out: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in ln]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(driver.RESULTS / "compile_compose"))
    args = p.parse_args(argv)
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
    info = ", ".join(f"{k} {v}" for k, v in machine_info().items())
    lines = ["# `parallel.compile` with the other parallel paths", "",
             "`python -m benchmarks.compile_compose`: gpt-tiny, dropout 0.1, 4 steps, "
             f"2 processes, eager then compiled. Machine: {info}.", "",
             "| layout | eager losses | compiled losses | max relative difference |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {', '.join(f'{x:.6f}' for x in r['eager'])} | "
                     f"{', '.join(f'{x:.6f}' for x in r['compiled'])} | "
                     f"{r['max_rel_diff']:.1e} |")
    out = Path(args.out)
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
