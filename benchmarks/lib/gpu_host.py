"""The GPU check's host part: host time against GPU-busy time per step, per engine.

    python -m benchmarks.lib.gpu_host --tp 2 --out FILE.json [--model gpt-1.3b] [--mbs 2]

The GPU check runs it once per ``CUDA_DEVICE_MAX_CONNECTIONS`` setting (the driver reads
it when a process creates its CUDA context, so each setting needs its own processes).

``--tp`` processes share GPU 0 over gloo, each holding its rank's shard of the model: a
TP rank's shapes, so its segments are the ones a tp-way run's rank issues. The TP
collectives are skipped (``NoopCollectives``), so rank 0 computes alone while the other
ranks wait at a barrier, and nothing else runs on the GPU. Per mode
(``<engine>+<recompute>[+<sub-batches>]``), rank 0 times ``engine.forward_backward``:

* ``host_s``: what the host takes to issue one forward-backward (perf_counter, nothing
  synchronised: the GPU may still be working when the call returns);
* ``gpu_s``: the forward-backward on the GPU's timeline (CUDA events around it);
* ``busy_s``: how long some kernel ran in one profiled forward-backward (the union of
  the kernels' intervals in its ``torch.profiler`` trace:
  :func:`~benchmarks.lib.kernel_overlap.kernel_busy`), and ``kernels``, how many ran.

Where ``host_s`` exceeds ``busy_s`` the step is host-bound: the GPU waits for the host.
Per block per sub-batch: ``host_s`` / (blocks x sub-batches), against the same share of
``busy_s``. Medians of ``--steps`` steps after ``--warmup``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.kernel_overlap import kernel_busy, read_trace

MODES = ["megatron+full", "oases+fine+1", "oases+fine+2"]


def _config(model: str, mode: str, tp: int, mbs: int, device: str = "cuda"):
    from oases.config import load_config  # deferred: the parent process only spawns

    engine, recompute, *rest = mode.split("+")
    over = [f"model.name={model}", f"parallel.tp={tp}", f"parallel.schedule={engine}",
            f"parallel.recompute={recompute}", f"train.micro_batch_size={mbs}",
            "train.precision=bf16", f"parallel.device={device}", "data.kind=synthetic"]
    for r in rest:  # a sub-batch count, or "compile" (parallel.compile: fewer, fused kernels)
        over.append("parallel.compile=true" if r == "compile" else f"parallel.sub_batches={r}")
    return load_config(None, over).validate(tp)


def _measure(ctx, model_name: str, mode: str, tp: int, mbs: int, steps: int, warmup: int):
    """One mode's figures on rank 0 (on the CPU, ``--device cpu``, a dry run of this code:
    no kernels, and the "GPU" time is the host's)."""
    import torch

    from oases.parallel.timing import IntervalTimer

    from oases.overlap.engines import build_engine
    from oases.parallel.comm import NoopCollectives
    from oases.runtime.build import fast_init, build_rank_model, seed_tracker
    from oases.runtime.step import amp_factory

    cfg = _config(model_name, mode, tp, mbs, ctx.device.type)
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, None)
    fast_init(model)
    model.train()
    n = cfg.sub_batches if cfg.parallel.schedule == "oases" else 1
    engine = build_engine(cfg.parallel.schedule, ctx.tp_group, n, cfg.parallel.recompute,
                            tracker)
    ids = torch.randint(0, cfg.model.vocab_size, (mbs, cfg.model.seq_len + 1), device=ctx.device)
    x, y = ids[:, :-1], ids[:, 1:]
    amp = amp_factory(cfg, ctx)

    def step():
        engine.forward_backward(model, x, y, 1.0, amp)

    cuda = ctx.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host, gpu = [], []
    with NoopCollectives(ctx.tp_group):
        for i in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            sync()
            timer = IntervalTimer(ctx.device)  # CUDA events on CUDA
            a = timer.start()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            timer.stop(a)
            sync()
            if i >= warmup:
                host.append(t1 - t0)
                gpu.append(timer.take())
        model.zero_grad(set_to_none=True)
        acts = [torch.profiler.ProfilerActivity.CUDA if cuda else
                torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            step()
            sync()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(os.path.join(d, "trace.json"))
        kb = kernel_busy(read_trace(os.path.join(d, "trace.json")))
    busy, kernels = kb["busy_us"] / 1e6, kb["kernels"]
    blocks = len(model.blocks())
    res = {"host_s": statistics.median(host), "gpu_s": statistics.median(gpu), "busy_s": busy,
           "kernels": kernels, "blocks": blocks, "sub_batches": n,
           "host_us_per_block_sub_batch": statistics.median(host) / blocks / n * 1e6,
           "busy_us_per_block_sub_batch": busy / blocks / n * 1e6}
    res["host_bound"] = res["host_s"] > res["busy_s"]
    return res


def _worker(rank: int, world: int, store: str, args, result: str) -> None:
    import torch
    import torch.distributed as dist

    from oases.parallel.groups import build_context

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=1200))
    ctx = build_context(world, device)
    if rank == 0:
        out = {"tp": world, "model": args.model, "micro_batch_size": args.mbs,
               "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), "modes": {}}
        for mode in args.modes:
            try:
                out["modes"][mode] = _measure(ctx, args.model, mode, world, args.mbs,
                                              args.steps, args.warmup)
            except Exception as e:  # one mode's failure is reported, not fatal
                out["modes"][mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
            if device.type == "cuda":  # the mode's model is gone: its memory back
                torch.cuda.empty_cache()
            print(f"gpu_host tp={world} {mode}: {out['modes'][mode]}", flush=True)
        Path(result).write_text(json.dumps(out, indent=1))
    dist.barrier()  # the other ranks hold their groups until rank 0 is done
    os._exit(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="gpt-1.3b")
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=MODES)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a dry run of this code (tests/test_gpu_check.py)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp  # deferred: argument errors need no torch

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(args.tp, os.path.join(d, "store"), args, args.out),
                           nprocs=args.tp, join=True, start_method="spawn")
    return 0 if Path(args.out).exists() else 1


if __name__ == "__main__":
    sys.exit(main())
