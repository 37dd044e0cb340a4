"""Why oases' ZeRO-3 is its own and not torch's FSDP2 (docs/zero.md, "Why not torch's
FSDP2"), checked on the torch installed: each block of gpt-tiny and then the model wrapped
by ``fully_shard`` on a DP mesh of 2 (gloo, tp 1).

1. A plain ``model(ids, targets)`` fails: ``fully_shard`` makes the model an
   ``FSDPModule``, whose ``reshard()`` replaces the model's ``reshard(x, t_from, t_to)``.
2. The oases engine calls ``block.partial``/``block.combine``, not ``block(...)``, so
   FSDP2's forward hooks never fire and the parameters stay sharded DTensors.
3. With ``unshard()`` called by hand the engine runs, but no gradient is
   reduce-scattered: FSDP2 registers that reduction from the same forward hooks.

A torch release that changes any of these fails here, and the docs' reasoning with it.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed


def _body(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from oases.config import load_config
    from oases.models import build_model
    from oases.overlap.engines import build_engine

    torch.manual_seed(0)
    cfg = load_config(None, ["model.name=gpt-tiny", "model.dropout=0", "model.seq_len=32",
                             "data.kind=synthetic", "data.val_path="]).validate(2)
    mesh = init_device_mesh("cpu", (2,))
    ids = torch.randint(0, cfg.model.vocab_size, (4, 33),
                        generator=torch.Generator().manual_seed(rank))  # DP: its own rows
    x, y = ids[:, :-1], ids[:, 1:]

    def wrapped():
        model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=1)
        for blk in model.blocks():
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.train()
        return model

    with pytest.raises(TypeError, match=r"FSDPModule\.reshard\(\) takes 1 positional"):
        wrapped()(x, y).backward()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        build_engine("oases", None, 2, "fine").forward_backward(wrapped(), x, y)
    model = wrapped()
    model.unshard()
    for blk in model.blocks():
        blk.unshard()
    build_engine("oases", None, 2, "fine").forward_backward(model, x, y)
    params = list(model.parameters())
    assert all(p.grad is not None for p in params if p.requires_grad)
    assert not any(isinstance(p.grad, DTensor) for p in params), \
        "a gradient was reduce-scattered: FSDP2 now composes with the engine's calls"


def test_fsdp2_does_not_compose_with_the_oases_engine():
    # gloo's own point-to-point matching: FSDP2's collectives are not oases' schedule
    run_distributed(_body, world=2, tp=None, nccl_p2p=False)
