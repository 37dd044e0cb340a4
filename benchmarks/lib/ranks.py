"""Ranks as local CPU processes (no cluster, no root): a gloo world over a FileStore, its
ranks spawned and their results read back, and a process's peak resident set (``VmHWM``).

Nothing here imports torch at module level: a parent that only spawns stays light.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path
from typing import Callable


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmHWM``: the peak resident set; ``VmRSS``)."""
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith(key + ":"):
            return int(ln.split()[1])
    raise KeyError(key)


def reset_peak(strict: bool = True) -> bool:
    """Restart ``VmHWM`` from the current resident set (write 5 to ``/proc/self/clear_refs``);
    False where the kernel refuses, which raises the OSError with ``strict``."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        if strict:
            raise
        return False
    return True


def init_gloo(rank: int, world: int, store: str) -> None:
    """This process as ``rank`` of a ``world``-rank gloo group over the FileStore ``store``,
    with one intra-op thread."""
    import torch  # deferred: the parent process only spawns
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))


def spawn_ranks(worker: Callable, world: int, *args) -> list:
    """Run ``worker(rank, world, store, *args, result_dir)`` in ``world`` spawned processes
    (a fresh FileStore ``store``); returns what each rank wrote to
    ``<result_dir>/<rank>.json`` (:func:`write_result`), None for a rank that wrote nothing."""
    import torch.multiprocessing as mp  # deferred: as in init_gloo

    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(worker, args=(world, os.path.join(d, "store"), *args, d),
                           nprocs=world, join=True, start_method="spawn")
        files = [Path(d, f"{r}.json") for r in range(world)]
        return [json.loads(f.read_text()) if f.exists() else None for f in files]


def write_result(result_dir: str, rank: int, result) -> None:
    """A rank's result, read back by :func:`spawn_ranks`."""
    Path(result_dir, f"{rank}.json").write_text(json.dumps(result))
