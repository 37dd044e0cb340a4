"""Process groups on NCCL's terms, checked on gloo where they can be.

* A context lists its uses of groups and :meth:`ParallelContext.close` gives them back,
  destroying those no one else uses: after building and closing, this rank's live groups
  are what they were (the planner's trials and throwaway steps rely on it not to pile up
  communicators). Sharing itself: tests/test_comm_groups.py.
* Every group gets the world's timeout (``parallel.timeout_s``), not torch's default
  for ``new_group`` (30 min on gloo, 10 min on NCCL), so a hung peer times out alike on
  every group.
* The NCCL settings chosen for a run (blocking waits, ``device_id``, high-priority TP
  streams) as pure functions; the real NCCL behaviour under ``@pytest.mark.cuda``.
* The planner's memory headroom for NCCL buffers and the allocator.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from oases.config import load_config
from oases.errors import ConfigError
from oases.parallel import groups as G
from oases.parallel.groups import build_context, build_pipeline_context
from oases.parallel.layout import uniform_layout
from oases.parallel.ranks import destroy_groups, groups_of, new_group, recording_groups
from oases.planner import stages as st
from oases.planner.cluster import RESERVED_BYTES, Cluster, usable_bytes
from oases.planner.cost import ModelShape
from oases.planner.fit import analytic_profile
from oases.runtime.build import throwaway_step
from tests.support.configs import TINY_RUN as TINY
from tests.support.runs import REPO, subprocess_env
from tests.support.distributed import TIMEOUT_S, run_distributed
from tests.support.torchrun_procs import run_with_hung_rank

CPU = torch.device("cpu")
GIB = 2**30


def _timeout_of(g) -> datetime.timedelta:
    return g._get_backend(CPU).options._timeout


# ---------------------------------------------------------------------------
# build, close: the live groups come back to what they were


def _sums_two_ranks(group) -> None:
    """``group`` works and holds two ranks: an all-reduce of ones gives 2."""
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    assert t.item() == 2.0


def _close_body(rank: int) -> None:
    before = list(c10d._world.pg_map)
    assert len(before) == 1  # the default group
    ctx = build_context(2, CPU, kv_heads=1)  # world 4 = dp 2 x tp 2; kv replicas at tp 2
    ctx.degree_groups()  # built on first use: the context's too
    made = groups_of(ctx.groups)
    # this rank's tp and dp groups and nothing else: the kv replica group (the 2 ranks of a
    # TP group at one kv head) is the TP group itself, as is the (1, 2) resharding group,
    # and degree 1's gradient group (every rank) is the default group
    assert made == [ctx.tp_group, ctx.dp_group] and ctx.kv_group is ctx.tp_group
    assert ctx.degree_groups().reshard_group(1, 2) is ctx.tp_group
    assert ctx.degree_groups().grad[1] is c10d._get_default_group()
    assert len(c10d._world.pg_map) == 1 + len(made)
    assert [g for g in c10d._world.pg_map if g in made] == made  # in creation order
    world = datetime.timedelta(seconds=TIMEOUT_S)
    assert all(_timeout_of(g) == world for g in made), [_timeout_of(g) for g in made]
    _sums_two_ranks(ctx.tp_group)
    ctx.close()
    assert list(c10d._world.pg_map) == before and ctx.groups == []
    ctx.close()  # twice: nothing left to destroy
    again = build_context(2, CPU)  # and a new context builds as before
    _sums_two_ranks(again.dp_group)
    again.close()
    assert list(c10d._world.pg_map) == before


def test_closing_a_context_destroys_its_groups():
    run_distributed(_close_body, world=4, tp=None)


def _throwaway_body(rank: int) -> None:
    """A pipeline (pp 2) context and a throwaway step on it: the step's runner makes
    its own transfer groups; closing the step destroys those only."""
    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layer=2", "model.seq_len=16",
                             "parallel.tp=1", "parallel.pp=2", "train.grad_accum=2",
                             "train.micro_batch_size=2", "data.kind=synthetic",
                             "model.tie_embeddings=true"]).validate(2)
    before = list(c10d._world.pg_map)
    ctx = build_pipeline_context(uniform_layout(2, 2, 1, cfg.model.n_layer), CPU,
                                 bool(cfg.model.tie_embeddings))
    assert groups_of(ctx.groups) == [ctx.tie_group]  # {0, 1}: the two stages' tables
    with_ctx = list(c10d._world.pg_map)
    step = throwaway_step(cfg, ctx, None)
    # the p2p group of each direction: both over ranks {0, 1}, as the tie group, and
    # three communicators all the same (oases.pipeline.cross_mesh says why)
    p2p = groups_of(step.groups)
    assert len(p2p) == 2 and ctx.tie_group not in p2p and not set(step.groups) & set(ctx.groups)
    step()
    step.close()
    assert list(c10d._world.pg_map) == with_ctx and step.groups == []
    _sums_two_ranks(ctx.tie_group)  # the context's groups still work
    ctx.close()
    assert list(c10d._world.pg_map) == before


def test_a_throwaway_step_destroys_the_groups_it_made():
    run_distributed(_throwaway_body, world=2, tp=None)


def _timeout_body(rank: int) -> None:
    """A hung peer on a subgroup times out after the world's timeout (here 2 s), not
    gloo's default 30 min."""
    c10d._set_pg_timeout(datetime.timedelta(seconds=2))  # the world's, as the run sets it
    mine: list = []
    with recording_groups(mine):
        g = new_group([0, 1], world=False)  # a subgroup, not the default group
    assert g is not c10d._get_default_group()
    assert _timeout_of(g) == datetime.timedelta(seconds=2)
    if rank == 0:  # rank 1 never joins this all-reduce
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="[Tt]imed out"):
            dist.all_reduce(torch.ones(1), group=g)
        assert time.monotonic() - t0 < 20
    c10d._set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S))
    dist.barrier()
    destroy_groups(mine)


def test_a_subgroup_times_out_after_the_worlds_timeout():
    run_distributed(_timeout_body, world=2, tp=None, nccl_p2p=False)


# ---------------------------------------------------------------------------
# the NCCL settings, as pure functions


def test_device_id_and_high_priority_streams_on_nccl_only():
    gpu = torch.device("cuda", 1)
    assert G.init_kwargs("nccl", gpu) == {"device_id": gpu}
    assert G.init_kwargs("gloo", CPU) == {} and G.init_kwargs("gloo", gpu) == {}
    assert G.high_priority_tp("nccl", True) and not G.high_priority_tp("nccl", False)
    assert not G.high_priority_tp("gloo", True)
    assert G.tp_options(False) is None


def test_high_priority_tp_config_needs_nccl():
    ok = load_config(None, ["parallel.tp=1", "parallel.nccl_high_priority_tp=true"])
    assert ok.validate(1).parallel.nccl_high_priority_tp is True
    assert load_config(None, ["parallel.tp=1"]).validate(1).parallel.nccl_high_priority_tp is False
    for bad in ("parallel.backend=gloo", "parallel.device=cpu"):
        cfg = load_config(None, ["parallel.tp=1", "parallel.nccl_high_priority_tp=true", bad])
        with pytest.raises(ConfigError, match=r"parallel.nccl_high_priority_tp needs NCCL on CUDA"):
            cfg.validate(1)


# ---------------------------------------------------------------------------
# the planner's memory headroom


def test_memory_headroom():
    assert RESERVED_BYTES == GIB
    assert usable_bytes(80 * GIB) == pytest.approx(75 * GIB)  # 80 - 4 (5%) - 1
    assert usable_bytes(4 * GIB) == pytest.approx(2.8 * GIB)
    assert usable_bytes(0.5 * GIB) == 0.0  # never negative: nothing fits
    two = Cluster("t", 2, 2, 8, 100, 1, node_memory_gib=[80, 40])
    assert two.plan_bytes_of([0, 1]) == pytest.approx(75 * GIB)
    assert two.plan_bytes_of([1, 2]) == pytest.approx(37 * GIB)  # the smaller node's


def test_layout_search_limits_leave_the_headroom():
    """The stage limits (what is left after each stage's embedding/head constants) add
    up to the device memory less the headroom; an explicit limit is taken as given."""
    job = st.Job(ModelShape("gpt", 4, 256, 8, 8, 1024, 512, 64), 8, 2, "megatron", "none")
    base = st.profile_run(job, 2, 8)
    prof = analytic_profile(job.shape, base, job.shape.valid_degrees(2), 5e9)
    ch = next(c for c in st.enumerate_choices(job, 4) if c.pp == 2)
    cluster = Cluster("c", 2, 2, 4, 10.0, 1.0)
    for limit, want in ((None, usable_bytes(4 * GIB)), (3 * GIB, 3 * GIB)):
        prob = st.build(job, ch, cluster, prof, base, limit)
        assert len(prob.inst.memory_limit) == 2
        for lim, k in zip(prob.inst.memory_limit, prob.memory_const):
            assert lim + k == pytest.approx(want)


# ---------------------------------------------------------------------------
# NCCL for real

_HANG = textwrap.dedent("""
    import os
    import time

    import torch
    import torch.distributed as dist

    from oases.parallel.groups import join_world
    from oases.runtime.trainer import collective_failure
    join_world("cuda", "auto", timeout_s=2)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    assert dist.distributed_c10d._get_default_group().bound_device_id == torch.device("cuda", 0)
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)  # the communicator is up
    torch.cuda._sleep(int(1e10))  # ~5 s of cycles at 2 GHz
    t0 = time.monotonic()
    dist.all_reduce(x, async_op=True).wait()  # queued behind the sleep: times out in 2 s
    assert time.monotonic() - t0 < 1.0, "the wait blocked the host"
    try:
        while time.monotonic() - t0 < 60:  # the watchdog aborts; the next collective raises
            time.sleep(0.2)
            dist.all_reduce(x)
    except Exception as e:
        assert collective_failure(e), repr(e)
        print(f"raised after {time.monotonic() - t0:.1f}s: {type(e).__name__}", flush=True)
        os._exit(0)
    print("no error", flush=True)
    os._exit(1)
""")


@pytest.mark.cuda
def test_an_nccl_timeout_raises_in_the_caller():
    """With oases' NCCL settings a wait never blocks the host, and a collective that does
    not finish within the timeout has its communicator aborted by the watchdog, so the
    next collective raises a catchable error in the calling thread (torch's default
    would take the process down). One GPU: the collective is held back by a kernel
    sleeping on the stream it waits for. The flight recorder's dump wait is cut to 4 x
    0.5 s here. Without the run's watch (tests/test_nccl_watch.py) the raise is slow:
    the abort waits for the sleeping kernel, and the watchdog then sleeps 4 x the dump
    wait for each collective the loop queued behind the hung one (measured on an H200:
    28 s with an 8 s kernel, 10 queued). 45 s bounds the 5 s kernel's case."""
    env = {k: v for k, v in subprocess_env().items() if "NCCL" not in k}
    env["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "500"
    proc = subprocess.run([sys.executable, "-c", _HANG], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    took = re.search(r"raised after ([\d.]+)s", proc.stdout)
    assert took and float(took.group(1)) < 45, proc.stdout


@pytest.mark.cuda(gpus=2)
@pytest.mark.slow
def test_hung_peer_on_nccl_exits_4_with_one_line(tmp_path):
    """The gloo test of tests/test_fault_tolerance.py on NCCL: rank 1 stopped, rank 0's
    collective times out after parallel.timeout_s, one line, exit status 4."""
    out, log = tmp_path / "run", tmp_path / "torchrun.log"
    args = [*TINY, f"out_dir={out}", "parallel.tp=2", "parallel.device=cuda",
            "train.steps=100000", "parallel.timeout_s=5", "resume=none"]
    os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] = "500"  # the dump wait: 4 x 0.5 s
    try:
        rc, text, elapsed = run_with_hung_rank(args, out, log, 300, 60)
    finally:
        del os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]
    assert rc != 0 and elapsed < 30, (rc, elapsed)
    rank0 = [ln for ln in text.splitlines() if ln.startswith("error: [rank 0] ")]
    assert len(rank0) == 1 and "parallel.timeout_s=5" in rank0[0], text[-4000:]
    assert re.search(r"exitcode\s*:\s*4\b", text), text[-3000:]
