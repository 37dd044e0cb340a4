"""A run's ZeRO ownership: which ranges of the sharded buckets this rank owns, and what
the optimizer, clipping and checkpoints see of them.

The gradient reducer (:mod:`oases.dp.reducer`) decides the buckets and reduces their
gradients; each bucket at a level >= 1 carries its :class:`~oases.dp.zero.ShardedFlat`.
:class:`ZeroOwnership` holds those flats together with the parameter store
(:class:`~oases.dp.store.ParamStore`, levels 1-3) and answers every question about
owned ranges: the optimizer's tensors (segments of the owned ranges) and the gradient
terms of the norm. Checkpoints read and write the owned ranges in place
(:mod:`oases.runtime.ckpt_format`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from oases.dp.master import MasterCopy, grad_of
from oases.dp.store import ParamStore
from oases.dp.zero import ShardedFlat, gather_flat, weak_hook
from oases.parallel.engine import WHOLE, BlockParams


class ZeroOwnership:
    """``flats``: every sharded bucket's state, in bucket order. ``block_of``: parameter
    id -> its block in ``model.blocks()`` (absent: outside every block). ``tied_head``:
    the head uses the embedding block's table (level 3 gathers it for the head too).
    ``copies``: the fp32 masters of level-0 buckets under bf16 compute weights
    (:mod:`oases.dp.master`); at levels 1-3 the owned ranges are the masters."""

    def __init__(self, model: nn.Module, flats: list[ShardedFlat], block_of: dict[int, int],
                 tied_head: bool = False, prefetch: bool = True,
                 copies: Optional[list[MasterCopy]] = None) -> None:
        self.flats = flats
        self.copies = copies or []
        self.handles: list = []
        for fl in flats:
            if fl.level >= 2:  # the full gradient buffer gets storage before the first grad
                hook = weak_hook(fl.ensure_grads, with_arg=False)
                self.handles += [p.register_hook(hook) for p in fl.params]
        units: dict[int, list[ShardedFlat]] = {}    # level 3: gathered for each use
        pending: dict[int, list[ShardedFlat]] = {}  # levels 1, 2: gathered after the step
        head = len(model.blocks())
        for fl in flats:
            blk = block_of.get(id(fl.params[0]), -1)
            (units if fl.level >= 3 else pending).setdefault(
                head if blk < 0 else blk, []).append(fl)
        self.store = (ParamStore(units, head, tied_head, prefetch=prefetch, pending=pending)
                      if units or pending else None)
        if self.store is not None:
            self.handles += self.store.install_hooks(model)

    @property
    def sharded(self) -> bool:
        return bool(self.flats)

    @property
    def params(self) -> BlockParams:
        """The engine's parameter hook: the store, or nothing to gather."""
        return WHOLE if self.store is None else self.store

    def _segment_ids(self) -> set[int]:
        return {id(s) for fl in self.flats for s, _ in fl.segments}

    def release(self) -> None:
        """End of a step's backward passes: the optimizer is about to change the owned
        ranges, so nothing stays gathered."""
        if self.store is not None:
            self.store.release()

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # -- the optimizer ----------------------------------------------------------------
    def optimizer_params(self, model: nn.Module) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(tensor the optimizer steps, the model parameter it belongs to): the parameter
        itself at level 0 (its fp32 master under bf16 compute weights), its segments of
        the owned range at levels 1-3."""
        out = [seg for fl in self.flats for seg in fl.segments]
        out += [pair for c in self.copies for pair in c.pairs]
        zeroed = {id(p) for fl in self.flats for p in fl.params}
        zeroed.update(id(p) for c in self.copies for _, p in c.pairs)
        out += [(p, p) for p in model.parameters() if p.requires_grad and id(p) not in zeroed]
        return out

    def seed_optimizer(self, opt: torch.optim.Optimizer) -> None:
        for fl in self.flats:
            fl.seed_state(opt)

    @torch.no_grad()
    def after_step(self) -> None:
        """The optimizer updated the owned ranges (and masters): bf16 compute weights of
        level 0 become the masters' rounding; levels 1 and 2 start all-gathering the
        owned ranges (the store waits for each block's before its next use)."""
        for c in self.copies:
            c.publish()
        if self.store is not None:
            self.store.sync_params()

    @torch.no_grad()
    def after_load(self) -> None:
        """A checkpoint was read into the masters (bf16 compute weights): the parameters
        follow (level 0 at once, levels 1 and 2 gathered now; level 3 gathers on use)."""
        for c in self.copies:
            c.publish()
        for fl in self.flats:
            if fl.master and fl.level < 3:
                fl.sync_params()
                fl.settle()

    def master_of(self) -> dict[int, torch.Tensor]:
        """Parameter id -> its level-0 fp32 master (bf16 compute weights), which the
        optimizer steps and checkpoints hold in its place."""
        return {id(p): m for c in self.copies for m, p in c.pairs}

    @torch.no_grad()
    def master_values(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every parameter's whole value as the optimizer holds it (name -> tensor): the
        fp32 master under bf16 compute weights, else the parameter. Collective over the
        sharded buckets' groups; for inspection (tests)."""
        out, masters = {}, self.master_of()
        whole: dict[int, torch.Tensor] = {}
        for fl in self.flats:
            full = torch.empty(fl.G * fl.s, device=fl.shard.device, dtype=fl.shard.dtype)
            gather_flat(full, fl.shard, fl.group)
            for p, o in zip(fl.params, fl.offsets):
                whole[id(p)] = full[o: o + p.numel()].view_as(p)
        for name, p in model.named_parameters():
            out[name] = whole.get(id(p), masters.get(id(p), p.detach())).clone()
        return out

    def grad_terms(self, model: nn.Module) -> list[tuple[torch.Tensor, nn.Parameter, int]]:
        """(gradient tensor this rank holds, its parameter, how many ranks split it):
        the whole ``.grad`` at levels 0 and 1, the owned segment at levels 2 and 3."""
        out, zeroed = [], set()
        for fl in self.flats:
            if fl.level >= 2:
                out += [(seg.grad, p, fl.G) for seg, p in fl.segments]
                zeroed.update(id(p) for p in fl.params)
        out += [(grad_of(p), p, 1) for p in model.parameters()
                if grad_of(p) is not None and id(p) not in zeroed]
        return out

    # -- inspection -------------------------------------------------------------------
    def full_optimizer_state(self, opt: torch.optim.Optimizer) -> dict:
        """Adam state keyed by model parameter, whole (collective: sharded buckets
        all-gather theirs), as a level-0 optimizer would hold it. For inspection (tests):
        it costs a whole copy of the state; checkpoints write the owned ranges
        (:mod:`oases.runtime.ckpt_format`)."""
        segs = self._segment_ids()
        param_of = {id(m): p for c in self.copies for m, p in c.pairs}
        state = {param_of.get(id(t), t): opt.state[t] for g in opt.param_groups
                 for t in g["params"] if id(t) not in segs and t in opt.state}
        for fl in self.flats:
            full = fl.full_state()
            step = next((opt.state[s]["step"] for s, _ in fl.segments
                         if s in opt.state and "step" in opt.state[s]), None)
            for p, st in full.items():
                state[p] = {**st, "step": step if step is not None
                            else torch.zeros((), dtype=torch.float32)}
        return state

    @contextlib.contextmanager
    def unsharded(self, opt: torch.optim.Optimizer, model: nn.Module):
        """Whole parameters and an optimizer stand-in whose ``state`` is keyed by model
        parameter, as at level 0, for inspection (tests compare levels with it); read
        only, a whole copy of the state. Collective."""
        if not self.sharded and not self.copies:
            yield opt
            return
        if self.store is not None:
            self.store.gather_all()
        view = _OptimizerView(model, opt, self.full_optimizer_state(opt))
        try:
            yield view
        finally:
            self.release()


class _OptimizerView:
    """An optimizer as a level-0 run holds it: ``state`` keyed by model parameter and
    ``param_groups`` listing the model's parameters."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
        fused = any(g.get("fused") for g in opt.param_groups)
        self.state = state
        self.param_groups = [{"params": [p for p in model.parameters() if p.requires_grad],
                              "fused": fused}]

