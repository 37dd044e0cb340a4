"""The custom-block example of docs/custom-blocks.md, run as written, at tp=2 against tp=1."""

from __future__ import annotations

import torch
import torch.distributed as dist

from oases.parallel import init_parameters, unshard
from tests.support.distributed import run_distributed
from tests.support.doc_examples import custom_block_example


def _body(ctx):
    Block = custom_block_example()["ParallelReluMLP"]
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16)
    out = {}
    for name, group, rank, tp in (("ref", None, 0, 1), ("tp", ctx.tp_group, ctx.tp_rank, ctx.tp)):
        block = Block(16, 32, group)
        init_parameters(block, seed=7, tp_rank=rank, tp=tp)
        with torch.no_grad():  # non-zero biases, so add_bias is exercised too
            for n, p in block.named_parameters():
                if n.endswith("bias"):
                    full = torch.arange(p.tp_spec.full_shape[0] if p.tp_spec else p.numel(),
                                        dtype=torch.float32) / 10
                    p.copy_(full if p.tp_spec is None else full.chunk(tp)[rank])
        xi = x.clone().requires_grad_(True)
        y = block(xi)
        y.square().sum().backward()
        grads = {}
        for n, p in block.named_parameters():
            g = p.grad.contiguous()
            if p.tp_spec is not None and tp > 1:
                gs = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(gs, g, group=group)
                g = unshard(gs, p.tp_spec)
            grads[n] = g
        out[name] = (y.detach(), xi.grad, grads)
    (y_ref, gx_ref, g_ref), (y_tp, gx_tp, g_tp) = out["ref"], out["tp"]
    # fp32: the sharded sums differ from the unsharded ones only in summation order
    torch.testing.assert_close(y_tp, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_tp, gx_ref, rtol=1e-5, atol=1e-5)
    assert g_ref.keys() == g_tp.keys()
    for n in g_ref:
        torch.testing.assert_close(g_tp[n], g_ref[n], rtol=1e-5, atol=1e-5, msg=n)
    assert y_ref.abs().sum() > 0 and g_ref["up.weight"].abs().sum() > 0


def test_readme_custom_block_matches_unsharded():
    run_distributed(_body, world=2, tp=2)
