"""ZeRO-3's node-local secondary shard (``parallel.zero_secondary=node``, ZeRO++'s hpZ).

Nodes are what the launcher says: ``LOCAL_WORLD_SIZE`` ranks each (set here as torchrun
would), so world 4 at ``LOCAL_WORLD_SIZE=2`` is two nodes of two ranks.

* **Parity, bit for bit.** The secondary shard holds exactly what a plain ZeRO-3 gather
  delivers (the owned fp32 master, cast to the compute dtype under bf16) and a gather
  only copies, so losses, gradient norms and parameters after 3 steps equal plain
  ZeRO-3's exactly: at dp 4 (a node group of two ranks), at dp 2 x tp 2 (each DP group
  has one rank per node: gathers are local copies), in fp32 and with bf16 gathers.
* **Memory.** The secondary shard holds 1/L of each bucket in the compute dtype, as the
  planner's ZeRO memory row (``zero_memory(..., secondary=L)``) says, within 2% (padding).
* **Bytes per group.** Every all-gather of a step is spied on with its group's ranks.
  With the secondary shard, the only gathers over the whole DP group (crossing nodes)
  are one per sharded bucket per step, the first use after the optimizer step; every
  other one runs over two ranks of one node. Without it, every gather crosses.
* **Resume.** The optimizer step and a checkpoint load both change the owned range in
  place; the shard's version counter makes the next gather refresh the secondary shard.
  A run resumed from its checkpoint gives the uninterrupted run's losses exactly.
* **Refusals.** Without ``parallel.zero=3``; with DP groups spread unevenly over nodes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from oases.errors import ConfigError
from oases.planner.zero_cost import zero_memory
from oases.runtime.step import train_step
from tests.support.distributed import run_distributed
from tests.support.zero_levels import STEPS, build_rank, full_params, zero_config


def _run(ctx, secondary: str, precision: str):
    cfg = zero_config(ctx.world_size, ctx.tp, 3, "oases", "fine",
                      (f"parallel.zero_secondary={secondary}", f"train.precision={precision}"))
    ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
    out = [train_step(ts, batches, 1e-3) for _ in range(STEPS)]
    with reducer.ownership.unsharded(opt, model):
        params = full_params(model, ctx)
    return out, params, reducer


def _parity_body(ctx):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    for precision in ("fp32", "bf16"):
        plain, p_plain, _ = _run(ctx, "none", precision)
        node, p_node, reducer = _run(ctx, "node", precision)
        flats = [b.zero for b in reducer.buckets if b.zero is not None]
        assert flats and all(fl.node is not None for fl in flats)
        L = 2 if ctx.tp == 1 else 1
        assert {fl.node.size for fl in flats} == {L}
        # its memory: 1/L of each bucket in the compute dtype, as the planner's memory row
        # says (oases/planner/zero_cost.py; the buckets' padding is a few elements each)
        elem = 2 if precision == "bf16" else 4
        held = sum(fl.sec.numel() * fl.sec.element_size() for fl in flats)
        n = sum(p.numel() for fl in flats for p in fl.params)
        row = zero_memory(n, 4, 3, ctx.dp, secondary=L, sec_elem=elem)["secondary"]
        assert abs(held - row) <= 0.02 * row, (held, row)
        assert node == plain, (precision, node, plain)
        for name, p in p_node.items():
            assert torch.equal(p, p_plain[name]), (precision, name)


# ~6 s each: test_only_the_refresh_crosses_nodes is the secondary shard's fast-tier check
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_secondary_shard_trains_as_plain_zero3(tp):
    run_distributed(_parity_body, world=4, tp=tp)


def _pp_body(rank):
    """pp 2 x dp 2, one rank per node: each stage's DP group spans two nodes with one
    rank on each (L = 1: the gathers are local copies), tied embeddings across stages."""
    from oases.parallel.groups import build_pipeline_context
    from oases.parallel.layout import uniform_layout

    os.environ["LOCAL_WORLD_SIZE"] = "1"
    res = {}
    for secondary in ("none", "node"):
        cfg = zero_config(4, 1, 3, "oases", "fine", (
            "parallel.pp=2", "train.grad_accum=3", "train.micro_batch_size=2",
            f"parallel.zero_secondary={secondary}"))
        layout = uniform_layout(4, 2, 1, cfg.model.n_layer)
        ctx = build_pipeline_context(layout, torch.device("cpu"), bool(cfg.model.tie_embeddings))
        ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx,
                                                                 cfg.pipeline_batch // ctx.dp)
        losses = [train_step(ts, batches, 1e-3) for _ in range(STEPS)]
        flats = [b.zero for b in reducer.buckets if b.zero is not None]
        assert flats and all((fl.node is not None) == (secondary == "node") for fl in flats)
        with reducer.ownership.unsharded(opt, model):
            res[secondary] = (losses, {k: p.detach().clone() for k, p in
                                       model.named_parameters()})
    assert res["node"][0] == res["none"][0]
    for k, p in res["node"][1].items():
        assert torch.equal(p, res["none"][1][k]), k


@pytest.mark.slow
def test_secondary_shard_in_a_pipeline():
    run_distributed(_pp_body, world=4, tp=None)


def _bytes_body(ctx):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    seen = []
    real = dist.all_gather_into_tensor

    def spy(out, inp, group=None, async_op=False):
        seen.append((tuple(dist.get_process_group_ranks(group)), inp.numel() * inp.element_size()))
        return real(out, inp, group=group, async_op=async_op)

    dist.all_gather_into_tensor = spy
    try:
        res = {}
        for secondary in ("none", "node"):
            # 4 layers: 10 units, more than the store keeps gathered (4 + 2 ahead), so
            # blocks are gathered again within the step
            cfg = zero_config(ctx.world_size, 1, 3, "oases", "fine",
                              (f"parallel.zero_secondary={secondary}", "model.n_layer=4"))
            ts, model, engine, opt, reducer, pipe, batches = build_rank(cfg, ctx)
            train_step(ts, batches, 1e-3)
            seen.clear()
            train_step(ts, batches, 1e-3)  # a step after a step: every shard stale once
            flats = [b.zero for b in reducer.buckets if b.zero is not None]
            res[secondary] = (list(seen), len(flats))
    finally:
        dist.all_gather_into_tensor = real
    world = tuple(range(ctx.world_size))
    plain, n_flats = res["none"]
    assert plain and all(ranks == world for ranks, _ in plain)  # every gather crosses
    node, n_flats = res["node"]
    crossing = [b for ranks, b in node if ranks == world]
    inside = [ranks for ranks, _ in node if ranks != world]
    assert len(crossing) == n_flats, (len(crossing), n_flats)  # one refresh per bucket
    assert inside and all(len(r) == 2 and r[0] // 2 == r[1] // 2 for r in inside), inside
    cross_plain, cross_node = sum(b for _, b in plain), sum(crossing)
    assert cross_node < cross_plain, (cross_node, cross_plain)
    if ctx.rank == 0:
        print(f"bytes across nodes per step: {cross_plain} plain, {cross_node} with the "
              f"secondary shard ({len(plain)} and {len(crossing)} gathers)")


def test_only_the_refresh_crosses_nodes():
    run_distributed(_bytes_body, world=4, tp=1)


@pytest.mark.slow
def test_resume_with_the_secondary_shard_is_exact(tmp_path, monkeypatch):
    """World 2 at one rank per node: the secondary shard is each rank's whole copy, and a
    resume that left it stale (the loaded master not re-taken) would change step 3."""
    from tests.support.configs import CKPT_RUN
    from tests.support.loop import check_exact_resume

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # the forked workers inherit it
    check_exact_resume(tmp_path, 2, [*CKPT_RUN, "parallel.tp=1", "train.micro_batch_size=2",
                                      "parallel.zero=3", "parallel.zero_secondary=node",
                                      "parallel.dp_bucket_mb=0.1"])


def test_zero_secondary_needs_zero3():
    with pytest.raises(ConfigError, match=r"zero_secondary=node .* needs parallel.zero=3, got 2"):
        zero_config(2, 1, 2, "megatron", "none", ("parallel.zero_secondary=node",))
    with pytest.raises(ConfigError, match="parallel.zero_secondary"):
        zero_config(2, 1, 3, "megatron", "none", ("parallel.zero_secondary=rack",))


def _uneven_body(ctx):
    with pytest.raises(ConfigError, match=r"dp 4 ranks of a DP group sit \[1, 3\] to a node"):
        ctx.node_group(3)  # nodes {0, 1, 2} and {3}


def test_uneven_nodes_are_refused_on_every_rank():
    run_distributed(_uneven_body, world=4, tp=1)
