"""Does torch's FSDP2 (``fully_shard``) compose with the oases engine?

Runs on 2 CPU processes (gloo, dp = 2, tp = 1) with gpt-tiny, each block of the
block protocol wrapped by ``fully_shard`` on the DP mesh, then the model by
itself. It tries, and reports, three things:

1. a plain ``model(ids, targets)`` forward and backward (the megatron engine's path);
2. the oases engine's ``forward_backward``, which calls ``block.partial`` and
   ``block.combine`` itself (not ``block(...)``) and runs backward from cut tensors;
3. the same with ``unshard()`` called by hand before the engine runs.

    python -m benchmarks.peers.fsdp2_probe
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from oases.models import build_model
    from oases.config import load_config
    from oases.overlap.engines import build_engine

    cfg = load_config(None, ["model.name=gpt-tiny", "model.dropout=0", "model.seq_len=32",
                             "data.kind=synthetic", "data.val_path="]).validate(2)
    mesh = init_device_mesh("cpu", (2,))
    ids = torch.randint(0, cfg.model.vocab_size, (4, 33),
                        generator=torch.Generator().manual_seed(rank))  # DP: own data
    x, y = ids[:, :-1], ids[:, 1:]
    results = []

    def fresh():
        model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=1)
        for blk in model.blocks():
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    for name in ("plain model(ids) + backward", "oases engine", "oases engine after unshard()"):
        try:
            model = fresh()
            model.train()
            if name.startswith("plain"):
                model(x, y).backward()
            else:
                if "unshard" in name:
                    model.unshard()
                    for blk in model.blocks():
                        blk.unshard()
                eng = build_engine("oases", None, 2, "fine")
                eng.forward_backward(model, x, y)
            from torch.distributed.tensor import DTensor

            params = list(model.parameters())
            sharded = sum(isinstance(p, DTensor) for p in params)
            synced = sum(isinstance(p.grad, DTensor) for p in params)
            results.append((name, f"ran: {sharded}/{len(params)} parameters sharded, "
                                  f"{synced} with a reduce-scattered (sharded) gradient"))
        except Exception as e:  # noqa: BLE001 - the probe reports what failed
            results.append((name, "FAILED " + _first_line(e)))
            if os.environ.get("PROBE_TRACE"):
                traceback.print_exc()
    if rank == 0:
        for name, r in results:
            print(f"{name:<32} {r}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.start_processes(_worker, args=(29571,), nprocs=2, start_method="fork")
