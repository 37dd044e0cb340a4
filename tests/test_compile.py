"""``parallel.compile``: each block's ``partial`` and ``combine`` through torch.compile.

With dropout on, every recompute mode must replay the forward's masks inside compiled
code: each recomputed segment's output is compared with the forward's output of the
same segment on the same input, within the run. Compiled runs are also compared with
eager ones. Tolerances: inductor fuses the elementwise work around the matmuls and
reorders a few float32 reductions (norms, softmax), which moves results by ~1e-7
relative here; a segment recomputed with another dropout mask differs by O(1) (a
dropped element against a kept one scaled by 1 / (1 - p)), so 1e-5 separates the two
by four orders of magnitude.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

from oases.models import build_model
from oases.config import load_config
from oases.errors import ConfigError
from oases.overlap.engines import MegatronEngine, OasesEngine
from oases.parallel.compile import CompiledSegment, CompileError, compile_blocks
from tests.support.distributed import run_distributed

TOL = 1e-5


class Replays:
    """Records what each compiled segment returned for each input it was given; a call
    with an input seen before (a recompute) must return what the first call did."""

    def __init__(self, model) -> None:
        self.first: dict = {}
        self.replayed = 0
        self.worst = 0.0
        for blk in model.blocks():
            for seg in ("partial", "combine"):
                setattr(blk, seg, self._watch(getattr(blk, seg)))

    def _watch(self, seg: CompiledSegment):
        def call(*args):
            out = seg(*args)
            x = args[0].detach()
            key = (seg.name, tuple(x.shape), x.double().sum().item(), x.double().abs().sum().item())
            if key in self.first:
                self.replayed += 1
                self.worst = max(self.worst, (out.detach() - self.first[key]).abs().max().item())
            else:
                self.first[key] = out.detach().clone()
            return out
        return call


def _model(extra=(), recompute="none", tp_group=None, tracker=None):
    cfg = load_config(None, ["model.name=llama-tiny", "model.n_layer=2", "model.seq_len=32",
                             "model.dropout=0.1", *extra]).validate(1)
    return build_model(cfg.model, cfg.padded_vocab_size, tp_group, tracker, recompute,
                       seed=1).train()


def _step(engine, recompute, compiled, tp_group=None, tracker=None, tp_rank=0):
    """One forward and backward; (loss, grads, replays or None)."""
    model = _model(recompute=recompute if engine == "megatron" else "none",
                   tp_group=tp_group, tracker=tracker)
    seen = None
    if compiled:
        compile_blocks(model, strict=True)
        seen = Replays(model)
    eng = MegatronEngine() if engine == "megatron" else OasesEngine(tp_group, 2, recompute,
                                                                        tracker)
    # megatron's batch is oases' sub-batch: the same shapes, so the compiled graphs are
    # shared and each kind compiles once (suite time)
    rows = 2 if engine == "megatron" else 4
    ids = torch.randint(0, 256, (rows, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    if tracker is not None:
        tracker.seed(7, tp_rank, 0)
    loss = eng.forward_backward(model, ids, ids).item()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}, seen


@functools.cache
def _compiled_without_recompute(engine):
    """(loss, grads) of ``engine``'s compiled run without recompute: the same reference
    for each recompute mode, computed once per process."""
    return _step(engine, "none", compiled=True)[:2]


def _compare(a, b) -> float:
    assert abs(a[0] - b[0]) <= TOL * abs(b[0]), (a[0], b[0])
    return max((a[1][k] - b[1][k]).abs().max().item() for k in b[1])


@pytest.mark.slow  # inductor compiles (~6 s each on 2 cores)
@pytest.mark.parametrize("engine, recompute", [("megatron", "full"), ("megatron", "selective"),
                                               ("oases", "fine"), ("oases", "full")])
def test_compiled_recompute_replays_the_forward(engine, recompute):
    """Dropout on: each recomputed segment equals the forward's within the run; the
    gradients equal the compiled run without recompute's, and eager's. (``selective``
    recomputes the attention core alone, which runs eagerly between compiled segments.)"""
    rec = _step(engine, recompute, compiled=True)
    seen = rec[2]
    assert (seen.replayed > 0) is (recompute != "selective"), seen.replayed
    assert seen.worst <= TOL, seen.worst
    assert _compare(rec, _compiled_without_recompute(engine)) <= TOL
    assert _compare(rec, _step(engine, recompute, compiled=False)) <= TOL


def _tp2_body(ctx):
    from oases.parallel.random import TPRNGTracker

    got = _step("oases", "fine", True, ctx.tp_group, TPRNGTracker(ctx.device), ctx.tp_rank)
    assert got[2].replayed > 0 and got[2].worst <= TOL, got[2].worst
    want = _step("oases", "fine", False, ctx.tp_group, TPRNGTracker(ctx.device), ctx.tp_rank)
    assert _compare(got, want) <= TOL


@pytest.mark.slow  # inductor compiles
def test_compiled_tp2_equals_eager_with_dropout():
    """At tp=2 the TP region's dropout (the tracker's stream) and the collectives run
    between compiled segments: oases+fine equals eager and replays exactly (megatron's
    path through the same segments is checked at tp=1)."""
    run_distributed(_tp2_body, world=2, tp=2)


@pytest.mark.slow  # inductor compiles
def test_a_user_block_compiles_with_no_code_of_its_own():
    """The block of docs/custom-blocks.md, built from the parallel layers: compiled as it
    is, it gives eager's output and gradients."""
    import copy

    from oases.parallel.compile import graphs_compiled
    from oases.parallel.sharding import init_parameters
    from tests.support.doc_examples import custom_block_example

    class Holder(torch.nn.Module):
        def __init__(self, blk):
            super().__init__()
            self.blk = blk

        def blocks(self):
            return [self.blk]

    eager = custom_block_example()["ParallelReluMLP"](16, 32, None)
    init_parameters(eager, seed=7, tp_rank=0, tp=1)
    comp = copy.deepcopy(eager)
    before = graphs_compiled()
    assert compile_blocks(Holder(comp), strict=True) == 2
    x = torch.randn(3, 5, 16)
    outs = []
    for blk in (eager, comp):
        xi = x.clone().requires_grad_(True)
        y = blk(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, [p.grad for p in blk.parameters()]))
    assert graphs_compiled() > before and isinstance(comp.partial, CompiledSegment)
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=TOL)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=TOL)
    for a, b in zip(outs[1][2], outs[0][2]):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


def test_a_segment_that_does_not_compile(monkeypatch):
    model = _model(["model.dropout=0"])
    compile_blocks(model)
    blk = model.blocks()[1]

    def broken(*args):
        raise BackendCompilerFailed(lambda: None, RuntimeError("backend exploded\nmore"), None)

    monkeypatch.setattr(blk.partial, "compiled", broken)
    x = torch.randn(2, 32, 128)
    with pytest.warns(RuntimeWarning, match=r"block 1 \(ParallelAttention.partial\) runs "
                                            r"eagerly.*backend exploded"):
        y = blk.partial(x)
    assert blk.partial.failed and torch.equal(y, blk.partial.eager(x))
    strict = _model(["model.dropout=0"])
    compile_blocks(strict, strict=True)
    monkeypatch.setattr(strict.blocks()[1].partial, "compiled", broken)
    with pytest.raises(CompileError, match="parallel.compile=strict: block 1 .* did not compile"):
        strict.blocks()[1].partial(x)


@pytest.mark.parametrize("value, ok", [("true", True), ("false", False), ("strict", "strict"),
                                       ("maybe", None), ("1", None)])
def test_compile_setting(value, ok):
    if ok is None:
        with pytest.raises(ConfigError, match="parallel.compile=.* is not one of false, true"):
            load_config(None, [f"parallel.compile={value}"]).validate(1)
    else:
        assert load_config(None, [f"parallel.compile={value}"]).validate(1).parallel.compile == ok
