"""A world of one process inside the test process: the default process group over gloo
(a FileStore, no port), so the trainer's own code (``oases.runtime.trainer.train``, the
checkpoint's collectives) runs in-process, without a subprocess or a spawn.

    with world_of_one(tmp_path) as ctx:     # ctx: ParallelContext at tp 1
        trainer.train(cfg, ctx)

The group is destroyed on the way out, and the garbage that could still hold it
collected, so a test that forks workers afterwards starts clean.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
from pathlib import Path

import torch
import torch.distributed as dist

from oases.parallel.groups import build_context


@contextlib.contextmanager
def world_of_one(tmp: Path):
    if dist.is_initialized():
        raise RuntimeError("a process group is already up in this process")
    store = dist.FileStore(str(tmp / "world_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield build_context(1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
        # Garbage left in reference cycles may hold process groups: collected here, where
        # their threads live. A forked child (tests.support.distributed) collecting them would
        # wait forever for threads that fork did not copy.
        gc.collect()
