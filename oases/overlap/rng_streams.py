"""RNG streams of the oases engine: one per sub-batch, so that the dropout masks of a
sub-batch are those of plain autograd on it alone, whatever the interleaving.

They cost a snapshot and a restore of every generator (CPU, CUDA, the TP stream) each
time the runner switches sub-batches, and each block stashes two more under
recompute. A run whose model draws nothing (:func:`draws_random`: dropout 0, the
configs' default, or evaluation) needs none of it; the runner then only reads the
generators once before and once after the run (:func:`same_rng`), to refuse a
model that drew random numbers where the scan found no dropout.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from oases.parallel.random import TPRNGTracker


def rng_snapshot(tracker: Optional[TPRNGTracker], device: torch.device) -> dict:
    if tracker is not None:
        return tracker.get_states()
    st = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def rng_restore(tracker: Optional[TPRNGTracker], device: torch.device, st: dict) -> None:
    if tracker is not None:
        tracker.set_states(st)
        return
    torch.set_rng_state(st["cpu"])
    if "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"], device)


def sub_batch_rng_streams(tracker: Optional[TPRNGTracker], device: torch.device,
                          n: int) -> list[dict]:
    """Derive ``n`` independent RNG streams (default + TP) from the live generator.

    The seeds come from the default CPU generator, identical across the ranks of a
    TP group, so the derived default streams agree across TP ranks; the derived TP
    streams are offset by the TP rank, as in :meth:`TPRNGTracker.seed`.
    """
    seeds = torch.randint(0, 2**62, (n,)).tolist()
    live = rng_snapshot(tracker, device)
    streams = []
    for sd in seeds:
        if tracker is not None:
            tracker.seed(sd, tracker.tp_rank)
        else:
            torch.manual_seed(sd)
        streams.append(rng_snapshot(tracker, device))
    rng_restore(tracker, device, live)
    return streams


# torch's dropout modules (their common base class is private to torch)
DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
            nn.FeatureAlphaDropout)


def _module_draws(m: nn.Module) -> bool:
    if not m.training:  # dropout is the identity in eval mode
        return False
    if getattr(m, "draws_random", False):  # the block says so (see draws_random)
        return True
    if isinstance(m, DROPOUTS):
        return m.p > 0
    # a rate kept as a number and passed to a functional call, as the attention's
    # ``attn_dropout`` (F.scaled_dot_product_attention(dropout_p=...))
    return any("dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool)
               and v > 0 for k, v in vars(m).items())


def draws_random(model: nn.Module) -> bool:
    """Whether running ``model`` draws random numbers: some module in training mode is
    an ``nn.Dropout`` (or another of :data:`DROPOUTS`) with p > 0, holds a number > 0 under a
    name with ``dropout`` in it (a rate handed to a functional call), or sets
    ``draws_random = True`` (a block that draws in another way: ``F.dropout`` with a
    literal rate, ``torch.rand``). A module that draws and is found by none of these is
    refused by the runner's check (:func:`same_rng`), not silently mis-replayed.
    Costs a walk over the modules (~1 ms for 32 layers): the engine keeps the answer per
    model and mode."""
    return any(_module_draws(m) for m in model.modules())


def rng_fingerprint(tracker: Optional[TPRNGTracker], device: torch.device) -> dict:
    """The generators' states, to compare with :func:`same_rng` (not to restore): the
    runner's check reads them apart from the snapshots it swaps."""
    return rng_snapshot(tracker, device)


def same_rng(a: dict, b: dict) -> bool:
    """Whether two :func:`rng_snapshot` s hold the same states: equal before and after a
    stretch of work = nothing in it drew a random number."""
    return a.keys() == b.keys() and all(
        (a[k] is None and b[k] is None) or (a[k] is not None and b[k] is not None
                                            and torch.equal(a[k], b[k])) for k in a)
