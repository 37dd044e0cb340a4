"""The engine protocol and the hooks around it.

* both engines have every method and attribute of :class:`oases.parallel.engine.Engine`,
  with its signatures, and say by ``pairs`` whether ``backward_forward`` interleaves;
  the megatron engine's ``backward_forward`` is its backward followed by its forward;
* the ``oases`` engine reaches parameters through its ``BlockParams`` hook only: every
  block is entered before it computes, the head's parameters before the loss's backward;
  the ZeRO parameter store is such a hook;
* a column-parallel layer enters its TP region through whatever entry is entered, and
  asks nothing of a schedule;
* a reducer's ``close()`` leaves a thrown-away model free to be collected.
"""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch
import torch.nn.functional as F

from oases.dp.store import ParamStore
from oases.overlap.engines import MegatronEngine, OasesEngine
from oases.parallel import ColumnParallelLinear, layers
from oases.parallel.comm import copy_to_tp
from oases.parallel.engine import HEAD, WHOLE, BlockParams, Engine, StageRun
from oases.parallel.region import CutRecorder, entered_region, entering
from tests.support.distributed import run_distributed
from tests.support.toy_models import RecordedParams, ToyModel

ENGINES = [MegatronEngine(), OasesEngine(None, 2, "fine")]


def _protocol_members(proto) -> tuple[list[str], list[str]]:
    methods = [n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")]
    attrs = list(proto.__annotations__)
    return methods, attrs


@pytest.mark.parametrize("engine", ENGINES, ids=lambda e: e.name)
def test_engines_have_the_protocol(engine):
    methods, attrs = _protocol_members(Engine)
    assert sorted(methods) == ["backward", "backward_forward", "forward", "forward_backward"]
    assert sorted(attrs) == ["name", "pairs"]
    for name in methods:
        want = list(inspect.signature(getattr(Engine, name)).parameters)[1:]
        got = list(inspect.signature(getattr(engine, name)).parameters)
        assert got == want, (engine.name, name, got, want)
    for name in attrs:
        assert hasattr(engine, name), (engine.name, name)
    assert engine.pairs is (engine.name == "oases")


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_megatron_backward_forward_is_backward_then_forward():
    torch.manual_seed(0)
    x0, x1, y = torch.randn(4, 5, 8), torch.randn(4, 5, 8), torch.randn(4, 5, 8)
    eng = MegatronEngine()
    runs = {}
    for fused in (False, True):
        model = ToyModel()
        run = eng.forward(model, x0, y)
        if fused:
            gin, nxt = eng.backward_forward(run, None, 0.5, model, x1, y)
        else:
            gin, nxt = eng.backward(run, None, 0.5), eng.forward(model, x1, y)
        assert isinstance(nxt, StageRun)
        runs[fused] = [nxt.loss, gin] + _grads(model)  # float input: an activation's grad
    for a, b in zip(runs[True], runs[False]):
        assert torch.equal(a, b)


def test_oases_engine_reaches_parameters_through_its_hook():
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, 8), torch.randn(4, 5, 8)
    ref = ToyModel()
    want = MegatronEngine().forward_backward(ref, x, y)
    hook = RecordedParams()
    model = ToyModel()
    got = OasesEngine(None, 2, "fine", params=hook).forward_backward(model, x, y)
    torch.testing.assert_close(got, want)
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a, b)
    n = len(model.blocks())
    assert hook.calls[0] == (0, 1)  # the first block, prefetching the next
    for i in range(n):  # each sub-batch enters each block forward, then backward
        assert hook.calls.count((i, i + 1)) == 2
        assert hook.calls.count((i, i - 1 if i else None)) >= 2  # (0, None): re-entries too
        assert hook.calls.index((i, i + 1)) < hook.calls.index((i, None))  # then resumed
    assert hook.calls.count((HEAD, None)) == 2
    first_back = hook.calls.index((n - 1, n - 2))
    assert (HEAD, None) in hook.calls[:first_back]  # the loss's backward comes first
    eng = OasesEngine(None, 2, "fine", params=hook)
    eng.backward_forward(eng.forward(model, x, y), None, 1.0, model, x, y)
    assert hook.passes == 1  # the paired passes are announced to the hook


def test_param_store_and_nothing_are_block_params():
    for hook in (WHOLE, ParamStore({}, 0, False)):
        for name in ("use", "two_passes"):
            want = list(inspect.signature(getattr(BlockParams, name)).parameters)[1:]
            assert list(inspect.signature(getattr(hook, name)).parameters) == want
    assert OasesEngine(None).params is WHOLE


class _Entry:
    """A TP region entry that records the layers asking it."""

    def __init__(self):
        self.asked: list[str] = []

    def copy(self, x, group):
        self.asked.append("copy")
        return x

    def linear(self, x, weight, bias, group):
        self.asked.append("linear")
        return F.linear(x, weight, bias)


def _entry_body(ctx):
    g = ctx.tp_group
    col = ColumnParallelLinear(4, 4, g)
    x = torch.randn(2, 4, requires_grad=True)
    assert entered_region() is None
    entry = _Entry()
    with entering(entry):
        assert entered_region() is entry and CutRecorder.current() is None
        col(x)
        copy_to_tp(x, g)
    assert entry.asked == ["linear", "copy"]
    with CutRecorder() as rec:  # the oases engine's entry: the graph is cut at the layer
        col(x)
    assert len(rec.cuts) == 1 and rec.cuts[0].source is x and rec.cuts[0].group is g


def test_layers_enter_the_region_they_are_given():
    assert not any("Cut" in n or "Recorder" in n for n in vars(layers))
    run_distributed(_entry_body, world=2, tp=2)


def _close_body(ctx):
    from oases.models import build_model
    from oases.config import load_config
    from oases.dp.reducer import GradReducer

    cfg = load_config(None, ["model.name=gpt-tiny", "model.seq_len=16",
                             "data.kind=synthetic"]).validate(2)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=3)
    reducer = GradReducer(model, ctx.dp_group, bucket_mb=0.05, level_of=lambda p: 3,
                          tied_head=bool(cfg.model.tie_embeddings), zero=True)
    assert reducer.ownership.store is not None and reducer._handles
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16))
    reducer.zero_grad()
    reducer.arm()
    model(ids, ids).backward()
    reducer.finish()
    refs = [weakref.ref(p) for p in model.parameters()]
    reducer.close()
    del model, reducer
    gc.collect()
    assert all(r() is None for r in refs), sum(r() is not None for r in refs)


def test_closed_reducer_frees_its_model():
    run_distributed(_close_body, world=2, tp=1)
