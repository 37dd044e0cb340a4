"""The GPU check's results file: ``<out>.json`` (everything) and ``<out>.md`` (tables)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.lib.gpu_env import launch_line


def _pct(x) -> str:
    return f"{100 * x:.1f}%" if x is not None else "n/a"


def _gib(x) -> str:
    return f"{x:.1f}" if x is not None else "n/a"


def lines(res: dict) -> list[str]:
    env = res["environment"]
    gpu = env["gpus"][0]
    peak = env.get("peak_bf16_flops")
    out = [f"# GPU check: {gpu['name']}", "",
           f"`{res['command']}`, {res['date']}, {res['seconds'] / 60:.1f} min in all"
           f" (budget {res.get('budget_s', 0) / 60:.1f} min). "
           f"{env.get('kernel_order', '')}.", "",
           f"{len(env['gpus'])} x {gpu['name']} ({gpu['memory_gib']:.0f} GiB), driver "
           f"{env.get('driver') or '?'}, CUDA {env['cuda']}, NCCL {env.get('nccl') or '?'}, "
           f"torch {env['torch']}; MFU against a dense bf16 peak of "
           + (f"{peak / 1e12:.0f} TFLOP/s." if peak else "(unknown: no MFU)."), ""]
    if env.get("launch_us"):  # the host's cost per op (older results lack it)
        out += [launch_line(env["launch_us"]).capitalize() + ".", ""]
    out += _waits(res.get("waits")) + _host(res.get("host"))
    tests = res.get("tests")
    if tests:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(tests["counts"].items()))
        out += ["## Correctness", "", f"`{tests['command']}`: {counts or 'no summary'} "
                f"({tests['seconds']:.0f} s).", ""]
        out += [f"- {ln}" for ln in tests["failures"]] + ([""] if tests["failures"] else [])
    out += ["## Speed, one GPU (bf16)", "",
            "Each model at one micro-batch for every mode (`--mbs`, or `--probe`: the "
            "largest power-of-two every mode fits); median step of interleaved rounds. "
            "Peak memory: `max_memory_allocated`; predicted: the planner's, from a profile "
            "measured on this GPU.", "",
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


def _waits(w) -> list[str]:
    if not w:
        return []
    out = ["## Waits: blocking against oases'", "",
           "The oases engine's turn at a collective on a one-rank NCCL group (segment a, "
           "its all-reduce launched, segment b, a's wait; `benchmarks/lib/gpu_wait.py`).", "",
           "| wait mode | ms per turn | host ms per wait | GPU ms of compute per turn |",
           "|---|---|---|---|"]
    for name, r in w.items():
        out.append(f"| {name} | " + (f"{1e3 * r['iter_s']:.3f} | {1e3 * r['wait_host_s']:.3f} | "
                                     f"{1e3 * r['compute_s']:.3f} |" if "error" not in r
                                     else f"{r['error']} | | |"))
    return out + [""]


def _host(h) -> list[str]:
    if not h:
        return []
    out = ["## Host against GPU", "",
           "One forward-backward of a tp rank's shard of gpt-1.3b (bf16, micro-batch 2, TP "
           "collectives skipped, the other ranks idle; `benchmarks/lib/gpu_host.py`): the "
           "host's time to issue it, its time on the GPU's timeline, and how long kernels "
           "ran in it; per block per sub-batch, host against kernels.", "",
           "| run | mode | host ms | GPU ms | kernels ms | kernels | host us / block / sub-batch "
           "| kernel us / block / sub-batch | host-bound |", "|" + "---|" * 9]
    for key, r in h.items():
        if "error" in r:
            out.append(f"| {key} | {r['error']} |" + " |" * 7)
            continue
        for mode, m in r["modes"].items():
            if "error" in m:
                out.append(f"| {key} | {mode} | {m['error']} |" + " |" * 6)
                continue
            out.append(f"| {key} | {mode} | {1e3 * m['host_s']:.2f} | {1e3 * m['gpu_s']:.2f} | "
                       f"{1e3 * m['busy_s']:.2f} | {m['kernels']} | "
                       f"{m['host_us_per_block_sub_batch']:.0f} | "
                       f"{m['busy_us_per_block_sub_batch']:.0f} | "
                       f"{'yes' if m['host_bound'] else 'no'} |")
    return out + [""]


def write_report(res: dict, out: Path, json_too: bool = True) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if json_too:
        out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    out.with_suffix(".md").write_text("\n".join(lines(res)) + "\n")
