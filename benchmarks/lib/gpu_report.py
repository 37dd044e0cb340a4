"""The GPU check's results file: ``<out>.json`` (everything) and ``<out>.md`` (tables)."""

from __future__ import annotations

import json
from pathlib import Path


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "n/a"


def _gib(x) -> str:
    return f"{x:.1f}" if x is not None else "n/a"


def lines(res: dict) -> list[str]:
    env = res["environment"]
    gpu = env["gpus"][0]
    peak = env.get("peak_bf16_flops")
    out = [f"# GPU check: {gpu['name']}", "",
           f"`{res['command']}`, {res['date']}, {res['seconds'] / 60:.1f} min in all.", "",
           f"{len(env['gpus'])} x {gpu['name']} ({gpu['memory_gib']:.0f} GiB), driver "
           f"{env.get('driver') or '?'}, CUDA {env['cuda']}, NCCL {env.get('nccl') or '?'}, "
           f"torch {env['torch']}; MFU against a dense bf16 peak of "
           + (f"{peak / 1e12:.0f} TFLOP/s." if peak else "(unknown: no MFU)."), ""]
    tests = res.get("tests")
    if tests:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(tests["counts"].items()))
        out += ["## Correctness", "", f"`{tests['command']}`: {counts or 'no summary'} "
                f"({tests['seconds']:.0f} s).", ""]
        out += [f"- {ln}" for ln in tests["failures"]] + ([""] if tests["failures"] else [])
    out += ["## Speed, one GPU (bf16)", "",
            "Each model at the largest power-of-two micro-batch every mode fits; median step "
            "of interleaved rounds. Peak memory: `max_memory_allocated`; predicted: the "
            "planner's, from a profile measured on this GPU.", "",
            "| model | mode | mbs | step (ms) | tokens/s | TFLOP/s | MFU | vs megatron | "
            "peak GiB | predicted GiB | largest mbs |", "|" + "---|" * 11]
    for r in res.get("one_gpu", []):
        if "error" in r:
            out.append(f"| {r['model']} | {r['error']} |" + " |" * 9)
            continue
        for mode, m in r["modes"].items():
            out.append(f"| {r['model']} | {mode} | {r['micro_batch_size']} | "
                       f"{1e3 * m['step_s']:.0f} | {m['tokens_per_s']:,.0f} | "
                       f"{m['tflops']:.0f} | {_pct(m['mfu'])} | {m.get('vs_megatron', 1):.3f}x | "
                       f"{_gib(m['peak_mem_gib'])} | {_gib(m['predicted_mem_gib'])} | "
                       f"{r['largest_micro_batch'][mode]} |")
    two = res.get("two_gpus")
    if two:
        out += ["", "## Overlap, two GPUs (gpt-1.3b, tp = 2)", "",
                f"micro-batch {two['micro_batch_size']}; tokens/s through `torchrun train.py`, "
                "median of interleaved rounds.", "", "| mode | tokens/s |", "|---|---|"]
        for mode, tps in two["tokens_per_s"].items():
            out.append(f"| {mode} | " + (f"{tps:,.0f}" if tps else
                                         two["errors"].get(mode, "n/a")) + " |")
        out += ["", "NCCL kernel time that runs under computation kernels, from a "
                "`torch.profiler` trace of one step (rank 0):", "",
                "| engine | NCCL kernel time (ms) | hidden |", "|---|---|---|"]
        for mode, t in two["traces"].items():
            out.append(f"| {mode} | " + (f"{t['comm_us'] / 1e3:.1f} | {_pct(t['hidden'])} |"
                                         if "error" not in t else f"{t['error']} | |"))
    return out


def write_report(res: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    out.with_suffix(".md").write_text("\n".join(lines(res)) + "\n")
