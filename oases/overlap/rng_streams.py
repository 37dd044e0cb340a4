"""RNG streams of the oases engine: one per sub-batch, so that the dropout masks of a
sub-batch are those of plain autograd on it alone, whatever the interleaving."""

from __future__ import annotations

from typing import Optional

import torch

from oases.parallel.random import TPRNGTracker


def _rng_snapshot(tracker: Optional[TPRNGTracker], device: torch.device) -> dict:
    if tracker is not None:
        return tracker.get_states()
    st = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        st["cuda"] = torch.cuda.get_rng_state(device)
    return st


def _rng_restore(tracker: Optional[TPRNGTracker], device: torch.device, st: dict) -> None:
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
    live = _rng_snapshot(tracker, device)
    streams = []
    for sd in seeds:
        if tracker is not None:
            tracker.seed(sd, tracker.tp_rank)
        else:
            torch.manual_seed(sd)
        streams.append(_rng_snapshot(tracker, device))
    _rng_restore(tracker, device, live)
    return streams
