"""Under the ``oases`` engine a sub-batch's ring steps are yield points
(oases/overlap/block_programs.py, oases/parallel/program.py): while one sub-batch waits
for its next kv block (forward) or its next kv block and gradient accumulator
(backward), the other sub-batch computes.

Observed through the ring's own trace (``ring_attention_steps(trace=...)``), one list per
ring call, tagged with the call's number, in the order the events happen: a call's
``post_recv``/``wait`` pair of step 1 (forward) and its ``bwd_post_recv``/``bwd_wait``
pair (backward) enclose events of another call (the other sub-batch) exactly when the
sub-batch yielded there. Driven alone (plain autograd: ``finish``), or with
``overlap=False``, no pair encloses another call's event.

Gradients: the engine's (yields, deferred ring backward) against plain autograd on the
same cp ranks and tokens (the ring's backward inside autograd). The two differ only by
the engine's split of the rows into sub-batches, whose gradients sum in another order:
fp32 sums of 2 terms per element, so 1e-6 of each gradient's largest entry bounds it
(the largest seen is about 1e-7); on CUDA, whose kernels pick their reduction order by
shape, 1e-5, as the other CUDA ring tests allow. Every case runs under NCCL's point-to-point semantics
(run_distributed's default): two sub-batches' exchanges on one cp group, posted out of
their peers' order, would raise there.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import oases.models.attention as attention_module
from oases.models import arch_class
from oases.models.parallelize import Parallelism, build
from oases.overlap.engines import build_engine
from oases.parallel.comm import group_rank
from oases.parallel.cp_chunks import shard_sequence
from tests.support.configs import tiny_config
from tests.support.distributed import run_distributed

B, T, SEED = 4, 32, 3
GRAD_RTOL = 1e-6  # see the module doc


class _Tagged:
    """A ring call's trace: appends (call, what, step) to the shared event list."""

    def __init__(self, call: int, events: list) -> None:
        self.call, self.events = call, events

    def append(self, item) -> None:
        self.events.append((self.call, *item))


class _Traced:
    """Patches the attention's ring with one that traces every call."""

    def __init__(self, overlap: bool = True) -> None:
        self.events, self.calls, self.overlap = [], 0, overlap

    def __enter__(self):
        self.orig = attention_module.ring_attention_steps

        def traced(*args, **kw):
            self.calls += 1
            kw.update(trace=_Tagged(self.calls, self.events), overlap=self.overlap)
            return self.orig(*args, **kw)
        attention_module.ring_attention_steps = traced
        return self

    def __exit__(self, *exc):
        attention_module.ring_attention_steps = self.orig

    def enclosed(self, post: str, wait: str) -> dict:
        """call -> whether another call's event lies between its ``post`` and ``wait``
        of step 1."""
        out = {}
        for call in {c for c, *_ in self.events}:
            idx = [i for i, (c, what, s) in enumerate(self.events)
                   if c == call and s == 1 and what in (post, wait)]
            if len(idx) == 2:
                out[call] = any(c != call for c, *_ in self.events[idx[0]:idx[1]])
        return out


def _model(name: str, group, device: str):
    cfg = tiny_config(world=1, synthetic=False, name=name, dropout=0, seq_len=T)
    model = build(arch_class(cfg.model.arch), cfg.model, cfg.padded_vocab(1),
                  Parallelism(cp_group=group, recompute="none"), seed=SEED, device=device)
    return cfg, model


def _batch(cfg, group, device: str):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    r = group_rank(group)
    return shard_sequence(ids, 2, r).to(device), shard_sequence(y, 2, r).to(device)


def _engine_body(rank: int, device: str = "cpu") -> None:
    torch.set_float32_matmul_precision("highest")
    device = f"cuda:{rank}" if device == "cuda" else device
    group = dist.new_group([0, 1])
    for name, recompute in (("gpt-tiny", "none"), ("llama-tiny", "fine"),
                            ("llama-tiny", "full")):
        what = f"{name} recompute={recompute}"
        cfg, model = _model(name, group, device)
        ids, y = _batch(cfg, group, device)
        # plain autograd on the same rank's tokens: nothing yields
        with _Traced() as plain:
            model(ids, y).backward()
        assert plain.enclosed("post_recv", "wait") and not any(
            plain.enclosed("post_recv", "wait").values()), what
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        # the engine: two sub-batches (tp 1, no dropout: a ring is what there is to hide)
        engine = build_engine("oases", None, 2, recompute)
        with _Traced() as run:
            engine.forward_backward(model, ids, y)
        fwd, bwd = run.enclosed("post_recv", "wait"), run.enclosed("bwd_post_recv", "bwd_wait")
        n_att = cfg.model.n_layer
        recomputed = n_att if recompute != "none" else 0
        assert len(fwd) == 2 * (n_att + recomputed) and all(fwd.values()), (what, fwd)
        assert len(bwd) == 2 * n_att and all(bwd.values()), (what, bwd)
        for n, p in model.named_parameters():
            err = (p.grad - want[n]).abs().max().item()
            tol = GRAD_RTOL if device == "cpu" else 1e-5
            assert err <= tol * want[n].abs().max().item(), f"{what}: {n} off by {err:.2e}"
        model.zero_grad(set_to_none=True)
        # the reference for how much hides: each transfer waited when posted, no yields
        with _Traced(overlap=False) as waited:
            engine.forward_backward(model, ids, y)
        assert not any(waited.enclosed("post_recv", "wait").values()), what


def test_the_engines_sub_batches_take_turns_at_ring_steps():
    """GPT, LLaMA (GQA) under recompute none, fine and full: every ring call's waits in
    forward (recomputes included) and backward enclose the other sub-batch's work, and
    the gradients equal plain autograd's."""
    run_distributed(_engine_body, world=2, tp=None)


@pytest.mark.cuda(gpus=2)
def test_the_engines_ring_steps_yield_over_nccl():
    """The same on two GPUs over NCCL (gloo carries no CUDA tensors point to point): each
    wait makes the current stream wait for the transfer, after the other sub-batch's
    kernels were queued."""
    run_distributed(_engine_body, world=2, tp=None, args=("cuda",), device="cuda")


@pytest.mark.parametrize("overlap", [True, False])
def test_finish_waits_where_the_program_yields(overlap):
    """One rank: the program yields nothing (no transfer), and :func:`finish` returns what
    the plain call returns."""
    from oases.parallel.program import finish
    from oases.parallel.ring_attention import ring_attention, ring_attention_steps

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    prog = ring_attention_steps(q, k, v, None, overlap=overlap)
    assert torch.equal(finish(prog), ring_attention(q, k, v, None, overlap=overlap))
