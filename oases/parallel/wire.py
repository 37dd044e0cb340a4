"""The wire dtype: the dtype an activation, or its gradient, crosses a link in.

Under ``train.precision=bf16`` the weights are fp32 and the matmuls run under autocast
in bf16, so the residual stream and the norms' outputs are fp32. Sent as they are,
they would cross the links in fp32: twice Megatron's bytes between pipeline stages
(the slowest link: between nodes), and under sequence parallelism an all-gather of
the norm's output of twice the bytes of a bf16 one. Where the receiver computes in
the compute dtype anyway, they cross in it:

* **Sequence parallelism** (:mod:`oases.parallel.sequence`, :mod:`oases.overlap.sequence`):
  the all-gathered norm output is read only by the region's column-parallel linears,
  which autocast casts to bf16 first. Cast before the gather, the forward computes the
  same values bit for bit (rounding to bf16 commutes with moving the bytes), and the
  conjugate reduce-scatter then sums bf16 gradients, as Megatron-LM's does.
* **Pipeline boundaries** (:mod:`oases.pipeline.runner`): activations and their
  gradients cross in the compute dtype and the receiver casts them back to its own
  dtype (the parameters', fp32), because its code adds to the residual stream in
  fp32: a stage boundary rounds the residual stream to bf16 once (relative error
  2^-9), where Megatron-LM's bf16 model keeps the whole stream in bf16.

fp32 runs (no autocast) send every tensor in its own dtype: byte for byte as before.
A dtype is only ever narrowed, never widened.
"""

from __future__ import annotations

from typing import Optional

import torch

from oases.parallel.engine import AmpFactory


def compute_dtype(device) -> Optional[torch.dtype]:
    """The autocast dtype of ``device``'s type where autocast is on, else None."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _narrower(want: Optional[torch.dtype], local: torch.dtype) -> bool:
    return (want is not None and want != local and local.is_floating_point
            and want.itemsize < local.itemsize)


def to_wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the compute dtype where autocast is on for its device and that dtype is
    narrower (a differentiable cast: its backward casts the gradient back); else ``x``
    itself."""
    want = compute_dtype(x.device)
    return x.to(want) if _narrower(want, x.dtype) else x


def wire_dtype(amp: AmpFactory, device, local: torch.dtype) -> torch.dtype:
    """The dtype a run whose forward segments run under ``amp()`` sends tensors of dtype
    ``local`` in: the compute dtype ``amp`` sets on ``device`` where it is narrower,
    else ``local``. Chosen once per call (a pipeline step), so both ends of every
    transfer agree: each derives it from the same run config."""
    with amp():
        want = compute_dtype(device)
    return want if _narrower(want, local) else local
