"""What a rank holds in memory for training state: parameters, gradients, optimizer."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from oases.dp.ownership import ZeroOwnership


def held_memory(model: nn.Module, opt: torch.optim.Optimizer, grad_buffers: list,
                shards: Optional[ZeroOwnership]) -> dict[str, int]:
    """Bytes this rank holds right now for parameters, fp32 master weights (under bf16
    compute weights; else 0), gradients and optimizer state:
    the storages actually allocated (a freed ZeRO buffer counts 0). ``grad_buffers``:
    the reducer's flat gradient buffers."""
    seen: set[int] = set()

    def nbytes(ts) -> int:
        n = 0
        for t in ts:
            st = t.untyped_storage()
            if st.data_ptr() not in seen and st.size():
                seen.add(st.data_ptr())
                n += st.size()
        return n

    flats = shards.flats if shards is not None else []
    # bf16 compute weights (oases.dp.master): the fp32 masters, apart from the parameters
    masters = [c.master for c in shards.copies] if shards is not None else []
    masters += [fl.shard for fl in flats if fl.master]
    params = nbytes([p for p in model.parameters()] + [fl.shard for fl in flats
                                                        if not fl.master])
    master = nbytes(masters)
    grads = nbytes(list(grad_buffers) + [fl.grad_shard for fl in flats])
    optim = nbytes([v for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0])
    return {"params": params, "master": master, "grads": grads, "optim": optim}
