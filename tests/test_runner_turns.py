"""The oases runner's turn order: round-robin, and staggered under sequence parallelism
(oases.overlap.runner.run_joint, oases.overlap.sequence)."""

from __future__ import annotations

import torch
import torch.nn as nn

from oases.models import build_model
from oases.config import load_config
from oases.overlap.engines import OasesEngine
from oases.overlap.runner import MicroBatchRun, run_joint


def _turns(n: int, stagger: bool, segments: int = 3) -> list[str]:
    log: list[str] = []

    def program(name: str):
        for k in range(segments):
            log.append(f"{name}{k}")
            yield [("ar", torch.zeros(1), None)]  # a one-rank collective: handed back as is

    run = MicroBatchRun(nn.Module(), [], [], [None] * n, [None] * n, None, torch.device("cpu"),
                   rng=False, stagger=stagger)
    run_joint([(run, [program("abcd"[s]) for s in range(n)])])
    return log


def test_in_step_without_stagger():
    assert _turns(2, False) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_odd_sub_batches_run_a_segment_behind():
    # between two segments of any sub-batch, the others run one segment each, and at
    # least one of them is at the other parity (a long segment when a short one waits)
    assert _turns(4, True) == ["a0", "c0",
                               "a1", "b0", "c1", "d0",
                               "a2", "b1", "c2", "d1",
                               "b2", "d2"]
    assert _turns(3, True) == ["a0", "c0", "a1", "b0", "c1", "a2", "b1", "c2", "b2"]


def test_the_engine_staggers_sequence_parallel_runs_of_three_or_more():
    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layer=1"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size)
    ids = torch.zeros(4, 8, dtype=torch.long)
    for sp, n, staggered in [(True, 4, True), (True, 2, False), (False, 4, False)]:
        model.set_sequence_parallel(sp)
        run = OasesEngine(None, n)._start(model, ids, ids, None)
        assert run.stagger == staggered, (sp, n)


def test_auto_sub_batches():
    def n(*over):
        return load_config(None, ["model.name=gpt-tiny", "parallel.schedule=oases", "parallel.tp=2",
                                  *over]).validate(2).sub_batches

    assert n() == 2 and n("parallel.sequence_parallel=true") == 4
    assert n("parallel.sequence_parallel=true", "train.micro_batch_size=6") == 2
    assert n("parallel.sequence_parallel=true", "parallel.sub_batches=2") == 2


def test_a_partial_sum_is_reduced_where_it_lies_only_when_nothing_else_holds_it():
    """Without a graph kept (recompute) the fresh partial sum is the all-reduce's buffer;
    a partial kept in a graph, or one that is the block's input or a parameter's memory,
    is copied first (reducing it in place would change what they hold)."""
    from oases.overlap.runner import reduce_buffer

    blk = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    p = blk(x).detach()
    assert reduce_buffer(p, False, blk, x) is p
    for graph, partial in ((True, p), (False, x), (False, blk.weight.detach()),
                           (False, p.t())):  # kept, the input, a parameter, strided
        buf = reduce_buffer(partial, graph, blk, x)
        assert buf is not partial and buf.is_contiguous()
        assert buf.untyped_storage().data_ptr() != partial.untyped_storage().data_ptr()
        assert torch.equal(buf, partial)


def test_the_engines_backward_is_autograds():
    """oases.parallel.backprop.backward (the engines' backward from their own gradients,
    without torch.autograd.backward's per-call Python checks) accumulates the same
    gradients, frees the graph, and refuses what autograd refuses."""
    import pytest

    from oases.parallel.backprop import backward

    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    grads = []
    for run in (torch.autograd.backward, backward):
        w.grad = None
        y, z = x @ w, (x @ w).sum(0)
        run([y, z], [torch.ones_like(y), torch.full_like(z, 2.0)])
        grads.append(w.grad.clone())
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            run(y, torch.ones_like(y))
    assert torch.equal(grads[0], grads[1])
    with pytest.raises(RuntimeError, match="Mismatch in shape"):  # refused by autograd's checks
        backward(x @ w, torch.ones(3))
    with pytest.raises(RuntimeError, match="does not require grad"):
        backward(x, torch.ones_like(x))
