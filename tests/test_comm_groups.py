"""How many process groups (NCCL communicators) a layout makes each rank hold, and the
registry that shares them (oases.parallel.ranks.new_group).

Counts per rank, the default group not included, before the registry (commit 9690cd0)
and now (``python`` of each layout's context and pipeline runner on gloo):

    layout (world)            before                       now
    pp 2 x tp 2 (4)           5 5 5 5                      3 3 3 3
    pp 4 x tp 2 (8)           5 5 8 8 8 8 5 5              3 3 5 5 5 5 3 3
    pp 4 x tp 2, tied (8)     6 6 8 8 8 8 6 6              4 4 5 5 5 5 4 4
    pp 2 x dp 2 x tp 2 (8)    5 (every rank)               4
      with per-block degrees  7                            5
    dp 1 x tp 4 (4)           1                            0 (TP is the world)
    dp 4 x tp 1 (4)           1                            0 (DP is the world)
    dp 2 x tp 4, kv heads 1,  10                           5
      per-block degrees (8)
    dp 2 x tp 2 (4)           2                            2 (nothing to share)

The one-rank DP groups are gone, the fan-out groups are the TP groups, and the kv,
resharding and gradient groups that repeat another group's ranks are that group; each
direction of each boundary keeps its own point-to-point group.
"""

from __future__ import annotations

import datetime
import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from oases.errors import UserError
from oases.parallel import groups as G
from oases.parallel.groups import build_context, build_pipeline_context
from oases.parallel.layout import uniform_layout
from oases.parallel.ranks import (GroupTable, destroy_groups, new_group,
                                  recording_groups)
from oases.pipeline.runner import PipelineRunner
from oases.planner.comm_memory import CommLayout, communicators
from tests.support.distributed import run_distributed

CPU = torch.device("cpu")

# name: (pp, tp, tied embeddings, kv heads, per-block degree groups, groups per rank now)
CASES = {
    4: {"pp2xtp2": (2, 2, False, None, False, [3] * 4),
        "dp1xtp4": (1, 4, False, None, False, [0] * 4),
        "dp4xtp1": (1, 1, False, None, False, [0] * 4),
        "dp2xtp2": (1, 2, False, None, False, [2] * 4)},
    8: {"pp4xtp2": (4, 2, False, None, False, [3, 3, 5, 5, 5, 5, 3, 3]),
        "pp4xtp2-tied": (4, 2, True, None, False, [4, 4, 5, 5, 5, 5, 4, 4]),
        "pp2xdp2xtp2": (2, 2, False, None, False, [4] * 8),
        "dp2xtp4-kv1-degrees": (1, 4, False, 1, True, [5] * 8),
        "pp2xdp2xtp2-degrees": (2, 2, False, None, True, [5] * 8)},
}
BEFORE = {"pp2xtp2": [5] * 4, "pp4xtp2": [5, 5, 8, 8, 8, 8, 5, 5],
          "pp4xtp2-tied": [6, 6, 8, 8, 8, 8, 6, 6], "pp2xdp2xtp2": [5] * 8,
          "dp1xtp4": [1] * 4, "dp4xtp1": [1] * 4, "dp2xtp4-kv1-degrees": [10] * 8,
          "dp2xtp2": [2] * 4, "pp2xdp2xtp2-degrees": [7] * 8}


def _build(world: int, pp: int, tp: int, tied: bool, kv, degrees: bool):
    """The context (and at pp > 1 the pipeline runner) of a layout; their uses of groups."""
    made: list = []
    runner = None
    with recording_groups(made):
        if pp == 1:
            ctx = build_context(tp, CPU, kv_heads=kv)
            if degrees:
                ctx.degree_groups()
        else:
            layout = uniform_layout(world, pp, tp, 4, [1, tp] * 4 if degrees else None)
            ctx = build_pipeline_context(layout, CPU, tied, kv)
            runner = PipelineRunner(ctx, kind="1f1b", microbatches=pp, batch=2 * ctx.dp,
                                    seq=8, d_model=8)
    return ctx, made, runner


def _counts_body(rank: int, world: int) -> None:
    base = list(c10d._world.pg_map)
    for name, (pp, tp, tied, kv, degrees, want) in CASES[world].items():
        ctx, made, runner = _build(world, pp, tp, tied, kv, degrees)
        held = len(c10d._world.pg_map) - len(base)
        assert held == want[rank], (name, rank, held, want)
        assert held < BEFORE[name][rank] or name == "dp2xtp2"
        # the planner counts the same groups (its figure includes the world's)
        lay = CommLayout(((ctx.dp, ctx.tp),) * pp, (degrees,) * pp, tied, kv)
        assert communicators(lay)[rank] == held + 1, (name, rank)
        if runner is not None:
            mine = [t for t in (runner.send_f, runner.recv_f, runner.send_b, runner.recv_b) if t]
            # a dst replica's fan-out is its TP group; each direction's p2p group its own
            assert all(t.group is ctx.tp_group for t in (runner.recv_f, runner.recv_b) if t)
            p2p = [t.p2p for t in mine]
            assert len(set(p2p)) == len(p2p) == 2 * min(2, ctx.stage + 1, pp - ctx.stage), name
            assert not set(p2p) & {ctx.tp_group, ctx.dp_group, ctx.tie_group}, name
        destroy_groups(made)
        assert list(c10d._world.pg_map) == base, name


@pytest.mark.parametrize("world", [4, 8])
def test_groups_per_rank_of_each_layout(world):
    run_distributed(_counts_body, world=world, tp=None, args=(world,))


# ---------------------------------------------------------------------------
# a shared group lives until its last use is given back


def _sharing_body(rank: int) -> None:
    base = list(c10d._world.pg_map)
    ctx = build_context(2, CPU)  # world 4: TP {0,1} {2,3}, DP {0,2} {1,3}
    made = list(c10d._world.pg_map)
    later: list = []
    with recording_groups(later):  # e.g. a throwaway step's fan-out groups
        again = [new_group([0, 1]), new_group([2, 3])]
    assert ctx.tp_group in again and list(c10d._world.pg_map) == made  # nothing new
    destroy_groups(later)  # the step closes first: the context's TP group stays
    assert list(c10d._world.pg_map) == made
    t = torch.ones(1)
    dist.all_reduce(t, group=ctx.tp_group)
    assert t.item() == 2.0
    with recording_groups(later):
        new_group([0, 1])
        new_group([2, 3])
    ctx.close()  # now the context first: the TP group stays for the other use
    assert ctx.tp_group in c10d._world.pg_map and ctx.dp_group not in c10d._world.pg_map
    destroy_groups(later)
    assert list(c10d._world.pg_map) == base
    # point-to-point groups are never shared, not even with each other
    p2p: list = []
    with recording_groups(p2p):
        a, b, c = (new_group([0, 1], p2p=True), new_group([0, 1], p2p=True),
                   new_group([0, 1], world=False))
    if rank in (0, 1):
        assert len({a, b, c}) == 3
    destroy_groups(p2p)
    destroy_groups(p2p)  # given back already: nothing happens
    assert list(c10d._world.pg_map) == base
    fresh = build_context(2, CPU)  # the table forgot the destroyed groups: new ones
    assert fresh.tp_group not in made and fresh.tp_group in c10d._world.pg_map
    fresh.close()


def test_a_shared_group_outlives_all_but_its_last_use():
    run_distributed(_sharing_body, world=4, tp=None)


def _mesh_body(rank: int) -> None:
    base = list(c10d._world.pg_map)
    ctx = build_context(2, CPU)
    mesh = ctx.device_mesh()  # from the context's groups: none made
    assert mesh.get_group("tp") is ctx.tp_group and mesh.get_group("dp") is ctx.dp_group
    assert len(c10d._world.pg_map) == len(base) + 2
    ctx.close()
    whole = build_context(4, CPU)  # TP = the world, DP of one rank: no group of its own
    assert whole.tp_group is c10d._get_default_group() and whole.dp_group is None
    mesh = whole.device_mesh()  # the dp dimension gets one-rank groups, given back on close
    assert mesh.shape == (1, 4) and mesh.get_group("dp").size() == 1
    whole.close()
    assert list(c10d._world.pg_map) == base


def test_device_mesh_from_the_contexts_groups():
    run_distributed(_mesh_body, world=4, tp=None)


# ---------------------------------------------------------------------------
# the decisions, as data


def test_the_table_decides_alike_for_every_request():
    t = GroupTable(8)
    assert t.decide((3,), None, False, True) == "none"
    assert t.decide(tuple(range(8)), None, False, True) == "world"
    assert t.decide(tuple(range(8)), None, False, False) is None  # a tie group: its own
    assert t.decide(tuple(range(8)), ("hp",), False, True) is None  # options: its own
    k = t.add((0, 1), ("hp",), False)
    assert t.decide((0, 1), None, False, True) == k  # no options asked: any will do
    assert t.decide((0, 1), ("hp",), False, True) == k
    assert t.decide((0, 1), ("other",), False, True) is None
    assert t.decide((0, 1), None, True, True) is None  # p2p: always its own
    p = t.add((0, 1), None, True)
    assert t.decide((0, 1), None, False, True) == k  # and never handed out
    t.entries[k].users = 2
    assert t.release(k) is None and t.release(k) is not None and k not in t.entries
    assert t.release(p) is not None


# ---------------------------------------------------------------------------
# NCCL resource sharing (split_share): built on request, refused with pipelines


class _Config:
    split_share = -2147483648  # NCCL_CONFIG_UNDEF_INT, as torch's binding starts


class _Options:
    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self.config = _Config()


def test_split_share_goes_on_the_worlds_options(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=_Options),
                        raising=False)
    gpu = torch.device("cuda", 0)
    assert G.world_options("gloo", True) is None and G.world_options("nccl", False) is None
    opts = G.world_options("nccl", True)
    assert opts.config.split_share == 1 and not opts.is_high_priority_stream
    kw = G.init_kwargs("nccl", gpu, split_share=True, timeout=datetime.timedelta(seconds=7))
    assert kw["device_id"] == gpu and kw["pg_options"].config.split_share == 1
    assert kw["pg_options"]._timeout == datetime.timedelta(seconds=7)
    assert G.init_kwargs("nccl", gpu) == {"device_id": gpu}  # off unless asked
    assert G.init_kwargs("gloo", CPU, split_share=True) == {}  # never on gloo
    assert G.tp_options(True) is not G.tp_options(True)  # torch writes into each


def test_split_share_with_pipelines_is_refused_on_nccl_only():
    on = {G.SPLIT_SHARE_VAR: "1"}
    with pytest.raises(UserError, match=r"NCCL_COMM_SPLIT_SHARE_RESOURCES=1 with parallel.pp=2"):
        G.check_split_share(on, "nccl", 2)
    G.check_split_share(on, "nccl", 1)
    G.check_split_share(on, "gloo", 4)
    G.check_split_share({G.SPLIT_SHARE_VAR: "0"}, "nccl", 4)
    G.check_split_share({}, "nccl", 4)


def _gloo_split_share_body(rank: int) -> None:
    os.environ[G.SPLIT_SHARE_VAR] = "1"  # NCCL's variable: gloo runs as ever
    ctx = build_pipeline_context(uniform_layout(2, 2, 1, 2), CPU, False)
    ctx.close()


def test_split_share_never_fails_on_gloo():
    run_distributed(_gloo_split_share_body, world=2, tp=None)
