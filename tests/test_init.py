"""Initialisation draws only the rank's shard, and the weights are the same at any layout.

Every normal-initialised parameter is a stack of slices along its sharded dimension,
each slice drawn from its own generator seeded by (seed, name, slice index)
(:mod:`oases.parallel.sharding`). So a rank that holds some slices draws exactly what
the full tensor holds there: the checks below are bit-exact (``torch.equal``), for
every sharding a parameter can have (column and row parallel, fused parts, GQA kv
heads replicated over more ranks than heads, padded vocabulary), for whole models at
tp 1, 2 and 4, per-block degrees and a pipeline stage, and for a parameter that is not
a float32 CPU tensor (drawn through a buffer, then cast).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from oases.models import build_model
from oases.config import load_config
from oases.parallel.sharding import TPSpec, init_parameters, shard, unshard
from tests.support.distributed import run_distributed

SPECS = {
    "column": TPSpec(0, (24, 6)),
    "row": TPSpec(1, (5, 16)),
    "vocab": TPSpec(0, (16, 4), logical=10),
    "fused": TPSpec(0, (32, 4), parts=(16, 8, 8)),
    "gqa": TPSpec(0, (24, 4), parts=(16, 4, 4), units=(8, 2, 2)),  # kv heads: 2 of 2 rows
}


def _param(spec, rank, size, std=0.02, dtype=torch.float32):
    """A module holding one parameter: this rank's shard of ``spec``."""
    m = nn.Module()
    shape = spec.full_shape if size == 1 else shard(torch.empty(spec.full_shape), spec, rank,
                                                    size).shape
    m.w = nn.Parameter(torch.empty(shape, dtype=dtype))
    m.w.tp_spec, m.w.init_rule, m.w.tp_coords = spec, ("normal", std), (rank, size)
    return m


@pytest.mark.parametrize("kind", list(SPECS))
def test_each_shard_is_the_full_tensors_slice(kind):
    spec = SPECS[kind]
    full = _param(spec, 0, 1)
    init_parameters(full, 7, 0, 1)
    w = full.w.detach()
    for size in (2, 4, 8):
        for rank in range(size):
            m = _param(spec, rank, size)
            init_parameters(m, 7, 0, 1)  # tp_coords win over (0, 1)
            assert torch.equal(m.w.detach(), shard(w, spec, rank, size)), (size, rank)
    if spec.logical is not None:  # padded vocab rows start at zero, the real ones do not
        assert torch.count_nonzero(w[spec.logical:]) == 0
        assert bool((w[:spec.logical] != 0).all())


def test_values():
    spec = TPSpec(0, (512, 256))
    a = _param(spec, 0, 1, std=0.5)
    init_parameters(a, 1, 0, 1)
    w = a.w.detach().clone()
    assert abs(w.std().item() - 0.5) < 0.01 and abs(w.mean().item()) < 0.005
    assert len(torch.unique(w, dim=0)) == 512  # no two slices alike
    c = torch.corrcoef(w[:64])
    assert (c - torch.eye(64)).abs().max() < 0.3  # independent rows: |r| ~ 1/sqrt(256)
    b = _param(spec, 0, 1, std=0.5)
    init_parameters(b, 2, 0, 1)  # another seed: other values
    assert not torch.equal(b.w, a.w)
    renamed = nn.Module()
    renamed.v = a.w  # the same parameter under another name: other values
    init_parameters(renamed, 1, 0, 1)
    assert not torch.equal(renamed.v.detach(), w)
    # not a float32 CPU tensor: through a buffer, then cast
    h = _param(SPECS["row"], 1, 2, dtype=torch.bfloat16)
    f = _param(SPECS["row"], 1, 2)
    init_parameters(h, 3, 0, 1)
    init_parameters(f, 3, 0, 1)
    assert torch.equal(h.w, f.w.to(torch.bfloat16))


def _full(model, ctx) -> dict:
    """Every parameter's full tensor, padded vocab rows dropped."""
    group_of = {id(p): blk.tp_group for blk in model.blocks() for p in blk.parameters()}
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        spec = p.tp_spec
        group = group_of.get(id(p), ctx.tp_group)
        size = dist.get_world_size(group) if group is not None else 1
        if spec is not None and size > 1:
            parts = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = unshard(parts, spec)
        if spec is not None and spec.logical is not None:
            t = t[:spec.logical]
        out[name] = t
    return out


def _layouts_body(ctx, name):
    cfg = load_config(None, [f"model.name={name}", "model.n_layer=2", "parallel.tp=4"]
                      ).validate(4)
    m = cfg.model
    ref = {n: p.detach()[:p.tp_spec.logical] if p.tp_spec and p.tp_spec.logical else p.detach()
           for n, p in build_model(m, cfg.padded_vocab(1), None, seed=5).named_parameters()}
    layouts = {
        "tp4": build_model(m, cfg.padded_vocab(4), ctx.tp_group, seed=5),
        "per-block 4/2/1/2": build_model(m, cfg.padded_vocab(4), ctx.tp_group, seed=5,
                                         degrees=[4, 2, 1, 2], degree_groups=ctx.degree_groups()),
        "per-block all 2": build_model(m, cfg.padded_vocab(4), ctx.tp_group, seed=5,
                                       degrees=[2, 2, 2, 2], degree_groups=ctx.degree_groups()),
        "stage [1, 2)": build_model(m, cfg.padded_vocab(4), ctx.tp_group, seed=5, stage=(1, 2)),
    }
    for what, model in layouts.items():
        got = _full(model, ctx)
        assert got, what
        for n, t in got.items():
            assert torch.equal(t, ref[n]), (what, n)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])  # llama-tiny: GQA, 2 kv heads
def test_same_weights_at_every_layout(name):
    run_distributed(_layouts_body, world=4, tp=4, args=(name,))
