"""Weight gradients deferred from B to W (oases/parallel/wgrad.py): a backward run
inside ``deferring()`` leaves the blocks' linear dW to ``apply``, and B then W gives
bit for bit the gradients of the plain backward (the same matmuls, summed per weight
over the sub-batches), under both engines and every recompute mode; the weights'
post-accumulate hooks (the DP reducer's) fire in W."""

from __future__ import annotations

import copy

import pytest
import torch

from oases.config import load_config
from oases.models import build_model
from oases.overlap.engines import MegatronEngine, OasesEngine
from oases.parallel.layers import ColumnParallelLinear, RowParallelLinear
from oases.parallel.wgrad import WeightGradStore


def _pair(arch: str, recompute: str = "none", dropout: float = 0.0):
    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    cfg = load_config(None, [f"model.name={name}", "model.seq_len=16",
                             f"model.dropout={dropout}"]).validate()
    plain = build_model(cfg.model, cfg.padded_vocab_size, None, seed=0,
                        recompute="full" if recompute == "model-full" else "none")
    split = copy.deepcopy(plain)
    split.wgrad = WeightGradStore()
    linears = [m for b in split.blocks() for m in b.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for m in linears:
        m.wgrad = split.wgrad
    return plain, split, linears


def _engine(name: str, recompute: str):
    if name == "megatron":
        return MegatronEngine()
    return OasesEngine(None, 2, recompute)


@pytest.mark.parametrize("arch,engine,recompute", [
    ("gpt", "megatron", "none"), ("llama", "megatron", "model-full"),
    ("llama", "oases", "fine"), ("gpt", "oases", "full"), ("llama", "oases", "none")])
def test_b_then_w_is_the_plain_backward(arch, engine, recompute):
    plain, split, linears = _pair(arch, recompute, dropout=0.1)
    eng = _engine(engine, "none" if recompute == "model-full" else recompute)
    gen = torch.Generator().manual_seed(3)
    ids, y = torch.randint(0, 100, (4, 16), generator=gen), torch.randint(0, 100, (4, 16), generator=gen)
    torch.manual_seed(5)
    loss = eng.forward_backward(plain, ids, y, 0.5)
    torch.manual_seed(5)
    run = eng.forward(split, ids, y)
    hits: list = []
    for m in linears:
        m.weight.register_post_accumulate_grad_hook(lambda p: hits.append(p))
    with split.wgrad.deferring() as records:
        eng.backward(run, None, 0.5)
    assert run.loss.item() == loss.item()
    assert all(m.weight.grad is None for m in linears) and not hits  # dW waits for W
    assert len(records) == len(linears) * (1 if engine == "megatron" else 2)
    assert WeightGradStore.apply(records) == len(linears) and not records
    assert len(hits) == len(linears)  # one accumulation per weight, through autograd
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_backward_outside_deferring_is_refused():
    """A model whose dW waits for W refuses a backward that no W follows."""
    _, split, _ = _pair("gpt")
    ids = torch.randint(0, 100, (2, 16))
    with pytest.raises(RuntimeError, match="outside WeightGradStore.deferring"):
        MegatronEngine().forward_backward(split, ids, ids)
    with split.wgrad.deferring():
        with pytest.raises(RuntimeError, match="already deferring"):
            with split.wgrad.deferring():
                pass
