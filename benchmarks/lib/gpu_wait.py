"""The GPU check's wait part: what a host that blocks in ``work.wait()`` costs, on one GPU.

    python -m benchmarks.lib.gpu_wait --out FILE.json

NCCL reads its wait mode when the process group is created, so the GPU check runs this
once with ``TORCH_NCCL_BLOCKING_WAIT=1`` (the old default) and once with oases' settings
(``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, waits that only make the stream wait), each in its
own process. A one-rank NCCL group on GPU 0 stands in for a TP group: its all-reduce
still runs through ProcessGroupNCCL (a work, an end event, the wait), so a blocking wait
still polls the host until the GPU got there. Each iteration is the ``oases`` engine's
turn at a collective: sub-batch a's segment (``--matmuls`` bf16 products of
``--dim``-square matrices), its all-reduce launched, sub-batch b's segment, then a's
wait. The figures: seconds per iteration over ``--iters`` (the device synchronised at
both ends: what the GPU delivers) and the host's seconds per wait.
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


def measure(iters: int, dim: int, matmuls: int) -> dict:
    import torch
    import torch.distributed as dist

    a = torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16)
    buf = torch.ones(dim, device="cuda", dtype=torch.bfloat16)

    def segment():
        y = a
        for _ in range(matmuls):
            y = y @ a
        return y

    def turn(waits: list) -> None:
        segment()
        work = dist.all_reduce(buf, async_op=True)
        segment()  # the other sub-batch computes while the collective runs
        t0 = time.perf_counter()
        work.wait()
        waits.append(time.perf_counter() - t0)

    waits: list = []
    for _ in range(20):  # warm-up: kernels, the communicator
        turn(waits)
    torch.cuda.synchronize()
    waits.clear()
    t0 = time.perf_counter()
    for _ in range(iters):
        turn(waits)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / iters
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    segment()
    segment()
    ev[1].record()
    torch.cuda.synchronize()
    return {"iter_s": per, "wait_host_s": statistics.median(waits),
            "compute_s": ev[0].elapsed_time(ev[1]) / 1e3,
            "blocking_wait": os.environ.get("TORCH_NCCL_BLOCKING_WAIT"),
            "async_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--matmuls", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("nccl", store=dist.FileStore(os.path.join(d, "store"), 1),
                                rank=0, world_size=1, device_id=torch.device("cuda", 0),
                                timeout=datetime.timedelta(seconds=120))
        res = measure(args.iters, args.dim, args.matmuls)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(f"gpu_wait: {res}", flush=True)
        os._exit(0)  # skip the process group's teardown


if __name__ == "__main__":
    sys.exit(main())
