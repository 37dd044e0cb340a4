"""TP-aware RNG.

Two random streams per rank:

* the **default** generator, seeded identically on all ranks of a TP group,
  drives dropout in *replicated* regions (embedding output, residual branches
  after the all-reduce): every TP rank draws the same mask, as the activations
  are replicated;
* the **tp** stream, seeded with ``seed + 2718 + tp_rank``, drives dropout in
  *sharded* regions (attention probabilities of the local heads): each rank
  owns different heads, so its masks must differ.

``with tracker.fork():`` swaps the tp stream into the default generator for the
duration of the block (so ``F.dropout`` and SDPA's dropout use it) and swaps it
back out. States can be captured and restored, which activation recompute uses
to replay masks exactly.
"""

from __future__ import annotations

import contextlib

import torch

_TP_SEED_OFFSET = 2718
_DP_SEED_STRIDE = 100_003


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class TPRNGTracker:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._state: torch.Tensor | None = None
        self.tp_rank = 0

    def seed(self, seed: int, tp_rank: int, dp_rank: int = 0) -> None:
        """Seed the default generator (same across TP, different across DP) and
        the tp stream (different on every rank)."""
        self.tp_rank = tp_rank
        base = seed + _DP_SEED_STRIDE * dp_rank
        torch.manual_seed(base)
        saved = _get_state(self.device)
        torch.manual_seed(base + _TP_SEED_OFFSET + tp_rank)
        self._state = _get_state(self.device)
        torch.manual_seed(base)
        _set_state(saved, self.device)

    @contextlib.contextmanager
    def fork(self):
        if self._state is None:
            raise RuntimeError("TPRNGTracker.fork() before seed()")
        outer = _get_state(self.device)
        _set_state(self._state, self.device)
        try:
            yield
        finally:
            self._state = _get_state(self.device)
            _set_state(outer, self.device)

    # -- capture/restore, for recompute and checkpoints --
    @property
    def tp_state(self) -> torch.Tensor | None:
        """The tp stream's generator state (None before :meth:`seed`); assigning one
        makes the stream continue from it (a recompute replays its forward's)."""
        return self._state

    @tp_state.setter
    def tp_state(self, state: torch.Tensor | None) -> None:
        self._state = state

    def get_states(self) -> dict:
        return {"default": _get_state(self.device).clone(),
                "cpu": torch.get_rng_state().clone(),
                "tp": None if self._state is None else self._state.clone()}

    def set_states(self, states: dict) -> None:
        torch.set_rng_state(states["cpu"])
        _set_state(states["default"], self.device)
        self._state = None if states["tp"] is None else states["tp"].clone()


class ChunkRNG:
    """The random streams of a rank that runs several virtual stages (interleaved-1f1b):
    one :class:`TPRNGTracker` and one default-generator state per chunk, so each chunk
    draws its dropout masks as a stage of its layers would alone (at pp x pp_virtual,
    where each stage has its own seed and draws in micro-batch order), whichever
    order the schedule runs the chunks in.

    ``using(c)`` runs a chunk's compute on its default state and saves it back after;
    the tp stream is the chunk's tracker's own. ``get_states``/``set_states`` cover every
    chunk (checkpoints restore them under the same layout)."""

    def __init__(self, device: torch.device, seeds: list[int], tp_rank: int,
                 dp_rank: int = 0) -> None:
        self.device = device
        self.trackers, self.defaults = [], []
        for seed in reversed(seeds):  # chunk 0 last: the generators are left at its base
            t = TPRNGTracker(device)
            t.seed(seed, tp_rank, dp_rank)  # leaves the default generator at its base
            self.trackers.insert(0, t)
            self.defaults.insert(0, _get_state(device).clone())

    @contextlib.contextmanager
    def using(self, chunk: int):
        outer = _get_state(self.device)
        _set_state(self.defaults[chunk], self.device)
        try:
            yield
        finally:
            self.defaults[chunk] = _get_state(self.device)
            _set_state(outer, self.device)

    def get_states(self) -> dict:
        out = {"default": _get_state(self.device).clone(), "cpu": torch.get_rng_state().clone()}
        for c, (t, d) in enumerate(zip(self.trackers, self.defaults)):
            out[f"chunk{c}.default"] = d.clone()
            out[f"chunk{c}.tp"] = t.tp_state.clone()
        return out

    def set_states(self, states: dict) -> None:
        want = {f"chunk{c}.{k}" for c in range(len(self.trackers)) for k in ("default", "tp")}
        if not want <= set(states):
            raise ValueError(f"random states of {len(self.trackers)} chunks expected, got "
                             f"keys {sorted(states)}")
        torch.set_rng_state(states["cpu"])
        _set_state(states["default"], self.device)
        for c, t in enumerate(self.trackers):
            self.defaults[c] = states[f"chunk{c}.default"].clone()
            t.tp_state = states[f"chunk{c}.tp"].clone()
