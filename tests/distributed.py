"""Run a test body in several gloo processes on CPU.

    def body(ctx, arg):            # ctx: ParallelContext for (dp, tp)
        ...                        # asserts raise in the worker
    run_distributed(body, world=4, tp=2, args=(arg,))

Workers rendezvous through a FileStore in a temp dir (no ports), use a short
collective timeout so a bug fails instead of hanging, and a failure in any
worker fails the test with that worker's traceback.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def _worker(rank, world, tp, store_path, fn, args, err_dir):
    """``tp=None``: no context is built; ``fn(rank, *args)`` builds its own groups."""
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        if tp is None:
            fn(rank, *args)
        else:
            from oases.parallel.groups import build_context

            fn(build_context(tp, torch.device("cpu")), *args)
        dist.barrier()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world: int, tp: int | None = 1, args: tuple = ()) -> None:
    """Run ``fn(ctx, *args)`` on ``world`` processes; ``fn`` must be importable (module level).
    ``tp=None`` runs ``fn(rank, *args)`` on the bare default group (pipeline layouts build
    their own groups)."""
    with tempfile.TemporaryDirectory() as d:
        store_path = os.path.join(d, "store")
        try:
            mp.start_processes(_worker, args=(world, tp, store_path, fn, args, d), nprocs=world,
                               join=True, start_method="fork")
        except Exception as e:
            msgs = [open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))
                    if f.startswith("rank")]
            raise AssertionError("distributed worker failed:\n" + "\n".join(msgs)) from e
