"""Blocks of TP degree 1: the oases engine pays nothing for a split that hides nothing.

* A run whose collectives are all over one rank (tp = 1) and whose model draws no
  random numbers takes its micro-batch as one sub-batch (the engines of
  ``build_engine``), under every recompute mode, with the memory of the mode asked
  for: ``full`` < ``fine`` < ``none`` in saved activations.
* With dropout the split stays (each sub-batch's masks come from its own stream),
  but a sub-batch does not yield at a collective over one rank: the sub-batches run
  one after the other.
* At tp = 2 nothing changes: two sub-batches.

Gradients against the megatron engine (plain autograd; with dropout, on each
sub-batch from its own stream). Tolerance: fp32, the same terms summed in another
order (atol 1e-6, rtol 1e-5, as tests/test_tp_engine_parity.py).
"""

from __future__ import annotations

import pytest
import torch

from oases.models import build_model
from oases.overlap.engines import MegatronEngine, OasesEngine, build_engine
from oases.overlap.memory import SavedTensorMeter
from oases.parallel.random import TPRNGTracker
from tests.support.configs import tiny_config
from tests.support.distributed import run_distributed
from tests.support.parity import full_grads, sub_batch_reference
from tests.support.toy_models import RecordedParams, ToyModel

CPU = torch.device("cpu")


def _cfg(dropout, tp=1, world=1):
    return tiny_config(world=world, synthetic=False, tp=tp, n_layer=2, dropout=dropout)


def _model(cfg, sched, rc, group=None, tp_rank=0):
    tracker = TPRNGTracker(CPU)
    tracker.seed(11, tp_rank)
    # the model recomputes under megatron, and selective under either engine
    own = rc if sched == "megatron" or rc == "selective" else "none"
    model = build_model(cfg.model, cfg.padded_vocab_size, group, tracker, own, seed=3)
    return model.train(), tracker


def _batch(cfg):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g),
            torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g))


def _check(model, ref, loss, ref_loss, what):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, msg=what)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"{what} {n}")


@pytest.mark.parametrize("rc", ["none", "selective", "fine", "full"])
def test_tp1_without_dropout_runs_whole(rc):
    cfg = _cfg(0.0)
    ids, y = _batch(cfg)
    ref, _ = _model(cfg, "megatron", "none")
    ref_loss = MegatronEngine().forward_backward(ref, ids, y)
    model, tracker = _model(cfg, "oases", rc)
    eng = build_engine("oases", None, 2, rc, tracker)
    run = eng.forward(model, ids, y)
    assert len(run.state.subs) == 1  # the engine's run: one sub-batch, the whole batch
    eng.backward(run, None, 1.0)
    _check(model, ref, run.loss, ref_loss, rc)
    # forward_backward and a backward paired with the next forward take the same path
    model, tracker = _model(cfg, "oases", rc)
    eng = build_engine("oases", None, 2, rc, tracker)
    first = eng.forward(model, ids, y)
    _, nxt = eng.backward_forward(first, None, 0.5, model, ids, y)
    assert len(nxt.state.subs) == 1
    eng.backward(nxt, None, 0.5)
    _check(model, ref, first.loss, ref_loss, f"{rc} paired")


def test_tp1_keeps_the_memory_of_the_recompute_mode():
    """The whole batch as one sub-batch still recomputes as asked: full keeps the layer
    inputs only, fine each block's input and reduced output, none every graph."""
    cfg = _cfg(0.0)
    ids, y = _batch(cfg)
    kept = {}
    for rc in ("none", "fine", "full"):
        model, tracker = _model(cfg, "oases", rc)
        with SavedTensorMeter() as meter:
            build_engine("oases", None, 2, rc, tracker).forward_backward(model, ids, y)
        kept[rc] = meter.forward_bytes
    assert kept["full"] < kept["fine"] < 0.5 * kept["none"], kept


def test_tp1_with_dropout_keeps_the_split_and_its_masks():
    cfg = _cfg(0.1)
    ids, y = _batch(cfg)
    ref, tracker = _model(cfg, "megatron", "none")
    ref_loss = sub_batch_reference(ref, tracker, ids, y, 2)
    for rc in ("none", "fine", "full"):
        model, tracker = _model(cfg, "oases", rc)
        eng = build_engine("oases", None, 2, rc, tracker)
        run = eng.forward(model, ids, y)
        assert len(run.state.subs) == 2
        eng.backward(run, None, 1.0)
        _check(model, ref, run.loss, ref_loss, rc)


def test_no_switch_at_a_degree1_collective():
    """Two sub-batches over one rank (no group): sub-batch a's forward and backward both
    run before b starts; at a real collective a would yield after its first block."""
    torch.manual_seed(0)
    x, t = torch.randn(4, 5, 8), torch.randn(4, 5, 8)
    hook = RecordedParams()
    OasesEngine(None, 2, "none", params=hook).forward_backward(ToyModel(), x, t)
    first_b = [i for i, c in enumerate(hook.calls) if c == (0, 1)][1]  # b enters block 0
    assert hook.calls[:first_b].count((-1, None)) == 1  # a's loss backward came before
    assert hook.calls[:first_b].count((0, None)) == 2   # a's block 0: forward and backward


def _tp2_body(ctx):
    cfg = _cfg(0.0, tp=2, world=2)
    ids, y = _batch(cfg)
    ref, _ = _model(cfg, "megatron", "none", ctx.tp_group, ctx.tp_rank)
    ref_loss = MegatronEngine().forward_backward(ref, ids, y)
    model, tracker = _model(cfg, "oases", "fine", ctx.tp_group, ctx.tp_rank)
    eng = build_engine("oases", ctx.tp_group, 2, "fine", tracker)
    run = eng.forward(model, ids, y)
    assert len(run.state.subs) == 2  # something to hide: the split stays
    eng.backward(run, None, 1.0)
    torch.testing.assert_close(run.loss, ref_loss, rtol=1e-6, atol=1e-6)
    got, want = full_grads(model, ctx), full_grads(ref, ctx)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_tp2_keeps_two_sub_batches():
    run_distributed(_tp2_body, world=2, tp=2)
