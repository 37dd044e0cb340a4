"""Single-device training throughput and MFU (bf16 on CUDA).

    python -m benchmarks.throughput --models gpt-350m gpt-1.3b --steps 20 --repeats 3
    python -m benchmarks.throughput --models gpt-tiny --device cpu --precision fp32   # smoke run

For each model: build it at tp=1, train ``--steps`` optimizer steps on synthetic
tokens with the real ``train_step`` (AdamW, clipping, bf16 autocast), drop the
first ``--warmup`` steps, and time the rest with CUDA synchronisation. Each
repeat is a fresh model; the reported figure is the median over repeats.
MFU = (6 N + 12 L d T) x tokens/s / device peak (see oases.runtime.metrics).
Writes ``benchmarks/results/throughput.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from oases.models import build_model
from oases.config import load_config
from oases.dp.reducer import GradReducer
from oases.parallel.groups import init_distributed
from oases.parallel.random import TPRNGTracker
from oases.runtime.data import TrainBatches
from oases.runtime.metrics import peak_flops
from oases.runtime.optim import build_optimizer
from oases.runtime.step import TrainState, train_step


def bench_one(name: str, args, ctx) -> dict:
    cfg = load_config(None, [f"model.name={name}", f"train.micro_batch_size={args.mbs}",
                             f"train.precision={args.precision}", "data.kind=synthetic",
                             f"parallel.recompute={args.recompute}",
                             f"train.steps={args.steps}"]).validate(1)
    times = []
    for rep in range(args.repeats):
        tracker = TPRNGTracker(ctx.device)
        tracker.seed(rep, 0)
        model = build_model(cfg.model, cfg.padded_vocab_size, None, tracker,
                            cfg.parallel.recompute, seed=rep, device=ctx.device)
        opt = build_optimizer(model, cfg.train, ctx.device)
        reducer = GradReducer(model, None)
        batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                               cfg.train.micro_batch_size, 0, 1, rep)
        step_times = []
        for step in range(args.steps):
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(TrainState(cfg, ctx, model, opt, reducer), batches, cfg.train.lr)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - t0)
        times.append(statistics.median(step_times[args.warmup:]))
        flops_per_token = model.flops_per_token()
        n_params = model.num_params()
        del model, opt, reducer
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    tokens = cfg.train.micro_batch_size * cfg.model.seq_len
    step_s = statistics.median(times)
    tps = tokens / step_s
    peak = peak_flops(ctx.device, args.precision)
    res = {"model": name, "params": n_params, "micro_batch_size": args.mbs,
           "seq_len": cfg.model.seq_len, "precision": args.precision,
           "recompute": args.recompute, "step_time_s_median": step_s,
           "step_time_s_repeats": times, "tokens_per_s": tps,
           "tflops": flops_per_token * tps / 1e12,
           "mfu": flops_per_token * tps / peak if peak else None}
    if ctx.device.type == "cuda":
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt-350m", "gpt-1.3b"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mbs", type=int, default=8)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--recompute", default="none", choices=["none", "full"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "throughput"))
    args = p.parse_args()
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
    ctx = init_distributed(1, args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    results = [bench_one(m, args, ctx) for m in args.models]
    dev = torch.cuda.get_device_name() if ctx.device.type == "cuda" else platform.processor() or "cpu"
    meta = {"device": dev, "torch": torch.__version__,
            "date": datetime.date.today().isoformat(),
            "command": "python " + " ".join(sys.argv), "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    lines = [f"# Single-device throughput ({dev})", "",
             f"`{meta['command']}` — torch {torch.__version__}, {meta['date']}; median step time "
             f"over {args.repeats} fresh runs, each the median of steps {args.warmup + 1}..{args.steps}.",
             "", "| model | params | mbs x seq | precision | step (s) | tokens/s | TFLOP/s | MFU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.0f}M | {r['micro_batch_size']} x "
                     f"{r['seq_len']} | {r['precision']} | {r['step_time_s_median']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | {mfu} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json")
    os._exit(0)  # skip the slow process-group teardown


if __name__ == "__main__":
    main()
