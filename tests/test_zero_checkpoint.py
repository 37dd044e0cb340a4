"""Sharded checkpoints across ZeRO levels and layouts: what is loaded is what was saved.

Each case builds a layout (ZeRO level, dp, tp, pp, stages) through the trainer's own
builders, loads a checkpoint that another layout wrote, and compares every parameter
and both Adam moments, gathered whole (``reducer.ownership.unsharded`` and the TP
shards), with the checkpoint's full tensors read by one process
(``full_model_state``). Loading copies values, so they must be *equal*: no
tolerance. The vocabulary rows past ``vocab_size`` must be zero. Then one training
step runs on the loaded state (finite loss); two layouts save in their turn, which
DCP refuses if the chunks of a key overlap or leave a gap (the level-2 layout and the
tied-embedding stages).

Cases (world 4): level 0 -> 3 at dp 4; dp 4 -> 2 at level 2 (tp 1 -> 2 on the same 4
ranks); a tp change at level 3 (tp 1 -> tp 2 x dp 2); pp 1 -> pp 2 x dp 2 at level 3;
the stage plan whose tied embedding lies on stages of different tp (tp 1 x dp 2 |
tp 2), written and read back at pp 1. (Level 3 -> 0 through the training loop:
``tests/test_zero.py::test_checkpoint_across_zero_levels``.) A save and a load at
level 3 issue no all-gather, and each rank writes exactly its owned ranges of the Adam
state.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oases.config import load_config
from oases.parallel.groups import build_context, build_pipeline_context
from oases.parallel.layout import stages_layout, uniform_layout
from oases.runtime import checkpoint as ckpt
from oases.runtime.checkpoint import full_model_state
from oases.runtime.ckpt_format import state_pieces
from oases.runtime.resume import layout_meta, model_shape
from oases.runtime.step import train_step
from tests.support.distributed import run_distributed
from tests.support.configs import MIXED_STAGES
from tests.support.zero_levels import build_rank, full_params

VOCAB = 300  # padded to 320 rows at tp 1, 384 at tp 2: the table's shape changes


def _cfg(world: int, zero: int, tp: int = 1, pp: int = 1):
    return load_config(None, [
        "model.name=gpt-tiny", f"model.vocab_size={VOCAB}", "model.seq_len=16",
        "model.dropout=0", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.zero={zero}",
        "data.kind=synthetic", "data.val_path=", "train.micro_batch_size=2",
        f"train.grad_accum={2 if pp > 1 else 1}", "train.warmup_steps=0",
        "parallel.dp_bucket_mb=0.05"]).validate(world)


class _Run:
    """One layout's model, optimizer and reducer on this rank."""

    def __init__(self, zero: int, tp: int = 1, pp: int = 1, stages=None) -> None:
        world = dist.get_world_size()
        self.cfg = cfg = _cfg(world, zero, tp, pp if stages is None else len(stages))
        if stages is not None:
            layout = stages_layout(stages, world, cfg.model.n_layer, "test", cfg.pipeline_batch)
        elif pp > 1:
            layout = uniform_layout(world, pp, tp, cfg.model.n_layer)
        if stages is not None or pp > 1:
            self.ctx = build_pipeline_context(layout, torch.device("cpu"), True)
            rows = cfg.pipeline_batch // self.ctx.dp
        else:
            self.ctx = build_context(tp, torch.device("cpu"))
            rows = None  # the micro-batch
        self.ts, self.model, *_, self.batches = build_rank(cfg, self.ctx, rows)
        self.shards = self.ts.reducer.ownership

    def step(self) -> float:
        loss, _ = train_step(self.ts, self.batches, 1e-2)
        return loss

    def save(self, out: Path, step: int) -> Path:
        meta = {"step": step, "data": self.batches.state_dict(),
                "model_shape": model_shape(self.cfg), **layout_meta(self.ctx)}
        return ckpt.save(str(out), step, self.model, self.ts.opt, self.ctx, meta, {},
                         shards=self.shards)

    def load(self, path: Path) -> None:
        ckpt.load(path, self.model, self.ts.opt, self.ctx, model_shape(self.cfg),
                  layout_meta(self.ctx), self.shards)

    def check(self, path: Path, what: str) -> None:
        """Every parameter and Adam moment this rank holds, made whole, equals the
        checkpoint's full tensor."""
        saved = _saved(path)
        with self.shards.unsharded(self.ts.opt, self.model) as o:
            for key, tensor in (("model", lambda p: p.data),
                                ("optim.exp_avg", lambda p: o.state[p]["exp_avg"]),
                                ("optim.exp_avg_sq", lambda p: o.state[p]["exp_avg_sq"])):
                for name, full in full_params(self.model, self.ctx, tensor).items():
                    want = saved[key][name]
                    rows = want.shape[0]
                    assert torch.equal(full[:rows], want), f"{what}: {key}/{name}"
                    assert not full[rows:].any(), f"{what}: {key}/{name} padding"


_SAVED: dict = {}  # per worker process: a checkpoint's full tensors, read once


def _saved(path: Path) -> dict:
    if path not in _SAVED:
        _SAVED[path] = {k: full_model_state(path, k)
                        for k in ("model", "optim.exp_avg", "optim.exp_avg_sq")}
    return _SAVED[path]


def _no_gathers():
    """A counter of ``all_gather_into_tensor`` calls (ZeRO's gathers)."""
    calls = [0]
    real = dist.all_gather_into_tensor

    def counted(*a, **k):
        calls[0] += 1
        return real(*a, **k)
    dist.all_gather_into_tensor = counted
    return calls, lambda: setattr(dist, "all_gather_into_tensor", real)


def _body4(rank: int, out: str) -> None:
    out = Path(out)
    a = _Run(0)
    a.step()
    ck0 = a.save(out / "z0", 1)

    b = _Run(3)
    calls, undo = _no_gathers()
    try:
        b.load(ck0)
        assert calls[0] == 0, "a level-3 load gathered"
        b.check(ck0, "0 -> 3")
        assert math.isfinite(b.step())
        calls[0] = 0
        ck3 = b.save(out / "z3", 3)
        assert calls[0] == 0, "a level-3 save gathered"
    finally:
        undo()
    # each rank wrote its owned ranges of both Adam moments: sizes add up to the state
    owned = sum(min(o + p.numel(), fl.hi) - max(o, fl.lo) for fl in b.shards.flats
                for p, o in zip(fl.params, fl.offsets) if max(o, fl.lo) < min(o + p.numel(),
                                                                              fl.hi))
    written = sum(q.local.numel() for q in state_pieces(b.model, b.ts.opt, b.ctx, b.shards)
                  if q.key.startswith("optim.exp_avg/"))
    assert written == owned > 0, (written, owned)

    c = _Run(2)
    c.load(ck3)
    ck2 = c.save(out / "z2", 4)
    for what, run, back in (("dp 4 -> 2 (tp 1 -> 2) at level 2", _Run(2, tp=2), False),
                            ("tp 1 -> 2 at level 3", _Run(3, tp=2), False),
                            ("pp 1 -> 2 at level 3", _Run(3, pp=2), False),
                            ("tied across tp 1 | tp 2", _Run(3, stages=MIXED_STAGES),
                             True)):
        src = ck2 if "level 2" in what else ck3
        run.load(src)
        run.check(src, what)
        assert math.isfinite(run.step()), what
        if back:  # that layout writes (its tied table once), and it loads at pp 1, level 3
            again = run.save(out / "tied", 5)
            b = _Run(3)
            b.load(again)
            b.check(again, f"{what}, back")


@pytest.mark.slow  # many layouts and levels: make test runs it, make test-fast does not
def test_checkpoints_across_levels_and_layouts(tmp_path):
    run_distributed(_body4, world=4, tp=None, args=(str(tmp_path),))


def test_flat_runs_cut_into_boxes():
    """``flat_boxes`` covers a flat run of a row-major tensor exactly, box by box in
    order, for every run of a few shapes (1-3 dims)."""
    from oases.runtime.ckpt_format import flat_boxes

    for shape in ((7,), (4, 6), (3, 4, 5), (1, 5), (5, 1)):
        n = math.prod(shape)
        index = torch.arange(n).view(shape)
        for x in range(n):
            for y in range(x, n + 1):
                got = []
                for start, size in flat_boxes(shape, x, y):
                    v = index
                    for d, (s, k) in enumerate(zip(start, size)):
                        v = v.narrow(d, s, k)
                    got += v.reshape(-1).tolist()
                assert got == list(range(x, y)), (shape, x, y)
