"""The oases engine touches the RNG only where a model draws random numbers.

With dropout 0 a run snapshots and restores no generator (the sub-batches get no
streams of their own and recompute replays nothing); with dropout > 0 every switch
between sub-batches swaps their streams and recompute replays the forward's masks.
Both must give the gradients of the megatron engine (plain autograd): with dropout 0
on the whole micro-batch, with dropout on each sub-batch alone from that sub-batch's
stream (:func:`sub_batch_rng_streams`, as tests/test_tp_engine_parity.py). Tolerance as
there: the engines sum the same fp32 terms in another order (atol 1e-6, rtol 1e-5).
A block that draws behind the scan's back (``F.dropout`` with a literal rate) is
refused after its run, not replayed with other masks; declaring it fixes that.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import oases.overlap.runner as runner
from oases.models import build_model
from oases.config import load_config
from oases.overlap.engines import MegatronEngine, OasesEngine
from oases.overlap.rng_streams import draws_random
from oases.overlap.runner import UndeclaredRandomError
from oases.parallel import ColumnParallelLinear, RowParallelLinear, init_parameters
from oases.parallel.block import TPBlock
from oases.parallel.random import TPRNGTracker
from tests.support.distributed import run_distributed
from tests.support.parity import full_grads, sub_batch_reference
from tests.support.toy_models import BlockStack

CPU = torch.device("cpu")


class _Spy:
    """Counts the runner's generator snapshots and restores."""

    def __init__(self, monkeypatch):
        self.snaps = self.restores = 0
        snap, restore = runner.rng_snapshot, runner.rng_restore

        def counted_snap(*a):
            self.snaps += 1
            return snap(*a)

        def counted_restore(*a):
            self.restores += 1
            return restore(*a)
        monkeypatch.setattr(runner, "rng_snapshot", counted_snap)
        monkeypatch.setattr(runner, "rng_restore", counted_restore)


def _model(ctx, cfg, recompute="none"):
    tracker = TPRNGTracker(CPU)
    tracker.seed(11, ctx.tp_rank, ctx.dp_rank)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker, recompute,
                        seed=3)
    return model.train(), tracker


def _body(ctx, dropout):
    mp = pytest.MonkeyPatch()
    cfg = load_config(None, ["model.name=gpt-tiny", f"parallel.tp={ctx.tp}", "model.n_layer=2",
                             f"model.dropout={dropout}"]).validate(ctx.world_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g)
    ref, tracker = _model(ctx, cfg)
    if dropout == 0:
        ref_loss = MegatronEngine().forward_backward(ref, ids, y)
    else:  # plain autograd on each sub-batch from its own streams
        ref_loss = sub_batch_reference(ref, tracker, ids, y, 2)
    ref_grads = full_grads(ref, ctx)
    counts = {}
    for rc in ("none", "fine", "full"):
        model, tracker = _model(ctx, cfg)
        spy = _Spy(mp)
        loss = OasesEngine(ctx.tp_group, 2, rc, tracker).forward_backward(model, ids, y)
        mp.undo()
        counts[rc] = (spy.snaps, spy.restores)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, msg=rc)
        grads = full_grads(model, ctx)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6,
                                       msg=f"{rc} {k}")
    if dropout == 0:
        assert counts == {rc: (0, 0) for rc in ("none", "fine", "full")}, counts
    else:
        # at every switch the live state is kept and the sub-batch's streams swapped in,
        # then the other way round; recompute snapshots each block twice in forward and
        # replays from them in backward
        for rc, (snaps, restores) in counts.items():
            assert snaps >= 20 and restores >= 20, (rc, snaps, restores)
        assert counts["fine"][0] > counts["none"][0]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_snapshots_only_with_dropout_and_grads_match_megatron(dropout):
    run_distributed(_body, world=2, tp=2, args=(dropout,))


def test_what_draws():
    cfg = load_config(None, ["model.name=gpt-tiny", "model.dropout=0.1"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=None).train()
    assert draws_random(model)
    assert not draws_random(model.eval())  # dropout is the identity in eval mode
    model.train()
    for m in model.modules():  # only the attention's rate (a number, not a module) left
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    assert draws_random(model)
    for layer in model.layers:
        layer.attn.attn_dropout = 0.0
    assert not draws_random(model)
    quiet = load_config(None, ["model.name=gpt-tiny", "model.dropout=0"]).validate(1)
    assert not draws_random(build_model(quiet.model, quiet.padded_vocab_size, None,
                                        seed=None).train())


class _Literal(TPBlock):
    """Draws with a literal rate: no module and no attribute the scan could see."""

    def __init__(self, d, declared):
        super().__init__(None)
        self.a = ColumnParallelLinear(d, 2 * d, None)
        self.b = RowParallelLinear(2 * d, d, None, reduce_output=False)
        if declared:
            self.draws_random = True

    def partial(self, x):
        return self.b.partial(torch.tanh(self.a(x)))

    def combine(self, x, reduced):
        return x + F.dropout(self.b.add_bias(reduced), 0.3, self.training)


class _Stack(BlockStack):
    def __init__(self, declared):
        super().__init__([_Literal(8, declared) for _ in range(2)])
        init_parameters(self, 5, 0, 1)


def test_undeclared_draws_are_refused_declared_ones_replayed():
    torch.manual_seed(0)
    x, t = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    with pytest.raises(UndeclaredRandomError, match="draws_random = True"):
        OasesEngine(None, 2, "fine").forward_backward(_Stack(False).train(), x, t)
    # declared: the masks are each sub-batch's own stream's, replayed by recompute
    torch.manual_seed(1)
    model = _Stack(True).train()
    loss = OasesEngine(None, 2, "fine").forward_backward(model, x, t)
    torch.manual_seed(1)
    ref = _Stack(True).train()
    torch.testing.assert_close(loss, sub_batch_reference(ref, None, x, t, 2), rtol=1e-6, atol=1e-7)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)
    # and the masks matter: another stream gives other gradients
    torch.manual_seed(2)
    other = _Stack(True).train()
    OasesEngine(None, 2, "fine").forward_backward(other, x, t)
    assert max((p.grad - q.grad).abs().max() for p, q in
               zip(other.parameters(), ref.parameters())) > 1e-4
