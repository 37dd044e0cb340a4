"""Run a test body in several processes: gloo on CPU, or NCCL on GPUs.

    def body(ctx, arg):            # ctx: ParallelContext for (dp, tp)
        ...                        # asserts raise in the worker
    run_distributed(body, world=4, tp=2, args=(arg,))

Workers rendezvous through a FileStore in a temp dir (no ports), use a short
collective timeout so a bug fails instead of hanging, and a failure in any
worker fails the test with that worker's traceback. A worker that is still running
after ``HANG_S`` dumps every thread's stack (faulthandler) and exits, and the parent
gives up on a run a little later still: a hang fails the test with those stacks
instead of stalling the suite.

What gloo forgives must not pass, so on gloo every worker runs with

* NCCL's point-to-point semantics (:mod:`tests.support.nccl_semantics`): one FIFO channel
  per process group, tags ignored, a send done only when its receive runs; a
  schedule that would hang on GPUs raises ``NcclDeadlock`` naming rank, peer and op;
* the collective-order recorder (:mod:`tests.support.collective_order`): after the body,
  every group's members must have issued the same collectives in the same order,
  hooks and other threads included.

``device="cuda"`` runs the body on NCCL, one GPU per rank (the caller skips when
there are fewer GPUs: see :func:`cuda_world`); there the real NCCL semantics apply.
``device="cuda-shared"`` runs every rank on GPU 0 over gloo with CUDA tensors (the
emulation and the recorder as on CPU): one GPU is enough to check that the overlapped
schedule orders its kernels and its asynchronous collectives correctly.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile
import time
import traceback

import pytest
import torch
# imported here, once per test process, so that each forked worker inherits it: imported in
# the workers it cost every rank of every run ~1.5 s of CPU (a world of 2: 1.6 s wall, 4: 3.1 s)
import torch._inductor.config as inductor_config
import torch.distributed as dist
import torch.multiprocessing as mp

from oases.parallel.groups import build_context
from tests.support import collective_order, nccl_semantics

TIMEOUT_S = 60
HANG_S = 240   # one run's bodies, every worker: the slowest takes under a minute on 2 cores


def cuda_world(world: int) -> None:
    """Skip the calling test unless ``world`` GPUs are present."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < world:
        pytest.skip(f"needs {world} CUDA device{'s' * (world > 1)}, found {n}")


def _worker(rank, world, tp, store_path, fn, args, err_dir, device, nccl_p2p, nccl_timeout_s):
    """``tp=None``: no context is built; ``fn(rank, *args)`` builds its own groups."""
    stacks = open(os.path.join(err_dir, f"stacks{rank}.txt"), "w")
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=stacks)
    try:
        torch.set_num_threads(1)
        if device == "cpu":
            # A forked worker cannot use the inductor compile workers its parent may have
            # started (their futures never complete in the child): with a cold inductor
            # cache a compile there waits forever. Compile in this process instead.
            inductor_config.compile_threads = 1
        store = dist.FileStore(store_path, world)
        kw = {}
        if device == "cuda":
            torch.cuda.set_device(rank)
            kw["device_id"] = torch.device("cuda", rank)
        elif device == "cuda-shared":
            torch.cuda.set_device(0)
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S),
                                **kw)
        gloo = device != "cuda"
        if gloo:
            collective_order.install()
            if nccl_p2p:
                nccl_semantics.install(**({} if nccl_timeout_s is None
                                           else {"timeout_s": nccl_timeout_s}))
        if tp is None:
            fn(rank, *args)
        else:
            dev = {"cuda": torch.device("cuda", rank), "cuda-shared": torch.device("cuda", 0),
                   "cpu": torch.device("cpu")}[device]
            fn(build_context(tp, dev), *args)
        if gloo:
            collective_order.dump(os.path.join(err_dir, f"order{rank}.json"))
        dist.barrier()
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        nccl_semantics.uninstall()
        collective_order.uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def _join(procs, err_dir: str) -> None:
    """Join ``procs`` (a ProcessContext); past ``HANG_S`` and a grace, kill them and raise
    with the stacks the workers' watchdogs wrote."""
    deadline = time.monotonic() + HANG_S + 30
    while not procs.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in procs.processes:
                if p.is_alive():
                    p.kill()
            stacks = [open(os.path.join(err_dir, f)).read() for f in sorted(os.listdir(err_dir))
                      if f.startswith("stacks")]
            raise AssertionError(f"distributed workers still running after {HANG_S + 30} s "
                                 "(killed); their stacks:\n" + "\n".join(stacks))


# gloo's full-mesh connect between two local processes, closed by the peer under load (a
# group's creation, before the body's first collective): the whole run is tried once more
SETUP_FLAKE = "Gloo connectFullMesh failed"


def run_distributed(fn, world: int, tp: int | None = 1, args: tuple = (), *,
                    device: str = "cpu", nccl_p2p: bool = True,
                    nccl_timeout_s: float | None = None) -> None:
    """Run ``fn(ctx, *args)`` on ``world`` processes; ``fn`` must be importable (module level).
    ``tp=None`` runs ``fn(rank, *args)`` on the bare default group (pipeline layouts build
    their own groups). ``nccl_p2p=False`` keeps gloo's own point-to-point matching;
    ``nccl_timeout_s``: how long an emulated point-to-point op may wait before it is a
    deadlock (None: ``nccl_semantics.install``'s default)."""
    if device not in ("cpu", "cuda", "cuda-shared"):
        raise ValueError(f"device={device!r}")
    if device != "cpu":
        cuda_world(world if device == "cuda" else 1)
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as d:
            store_path = os.path.join(d, "store")
            try:
                _join(mp.start_processes(_worker, args=(world, tp, store_path, fn, args, d,
                                                        device, nccl_p2p, nccl_timeout_s),
                                         nprocs=world, join=False,
                                         start_method="fork" if device == "cpu" else "spawn"), d)
            except Exception as e:
                msgs = [open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))
                        if f.startswith("rank") or (f.startswith("stacks")
                                                    and os.path.getsize(os.path.join(d, f)))]
                text = "\n".join(msgs) + str(e)
                if attempt == 0 and SETUP_FLAKE in text:
                    continue  # gloo's TCP set-up between local processes, not the body
                raise AssertionError("distributed worker failed:\n" + "\n".join(msgs)) from e
            if device != "cuda":
                collective_order.compare([os.path.join(d, f"order{r}.json")
                                          for r in range(world)])
            return
