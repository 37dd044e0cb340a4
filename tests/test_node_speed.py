"""Heterogeneous nodes: the cluster file's ``node_speed`` / ``node_memory_gib``, the
cost model's compute scaling and memory limit, and the emulator's per-node cpu quota
(the quota arithmetic everywhere; a real throttled run only as root with cgroup v1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emucluster.cpu_cgroup import (CPU_ROOT, NodeCgroups, cgroup_problem,
                                              cleanup_stale_cgroups, cluster_quotas, cpu_quotas)
from oases.errors import UserError
from oases.planner.cluster import Cluster, load_cluster
from oases.planner.cost import CostModel, ModelShape, RunShape
from oases.planner.fit import analytic_profile

ROOT = Path(__file__).resolve().parents[1]
HALF = ROOT / "configs/cluster/four-nodes-halfspeed.yaml"


def _cluster_file(tmp_path: Path, extra: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text("name: t\nnodes: 4\ndevices_per_node: 1\ndevice_memory_gib: 4\n"
                 "intra_node_bandwidth_gbps: 100\ninter_node_bandwidth_gbps: 1\n" + extra)
    return str(p)


# ------------------------------------------------------------------ the cluster file


def test_shipped_halfspeed_file_and_group_speed_memory():
    c = load_cluster(str(HALF))
    assert c.node_speed == [1.0, 1.0, 0.5, 0.5] and c.node_memory_gib is None
    assert c.speed_of([0, 1]) == 1.0 and c.speed_of([2]) == 0.5
    assert c.speed_of(range(4)) == 0.5           # a group runs at its slowest member's pace
    assert c.memory_bytes_of(range(4)) == 4 * 2**30  # default: device_memory_gib each
    two = Cluster("t", 2, 2, 8, 100, 1, node_speed=[0.25, 2.0], node_memory_gib=[8, 3])
    assert [two.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert two.speed_of([2, 3]) == 2.0 and two.speed_of([1, 2]) == 0.25
    assert two.memory_bytes_of([0, 1]) == 8 * 2**30 and two.memory_bytes_of([1, 2]) == 3 * 2**30
    with pytest.raises(UserError, match="rank 4 is outside cluster t"):
        two.speed_of([4])
    # a file without the keys: every node is the reference device
    plain = load_cluster(str(ROOT / "configs/cluster/four-nodes-1g.yaml"))
    assert plain.speed_of(range(4)) == 1.0 and plain.memory_bytes_of([3]) == 4 * 2**30


@pytest.mark.parametrize("extra,msg", [
    ("node_speed: [1, 1, 0.5]\n", r"node_speed must be a list of 4 numbers"),
    ("node_speed: 0.5\n", r"node_speed must be a list of 4 numbers"),
    ("node_speed: [1, 1, 0, 1]\n", r"node_speed\[2\]=0 must be a positive number <= 16"),
    ("node_speed: [1, 17, 1, 1]\n", r"node_speed\[1\]=17 must be a positive number <= 16"),
    ("node_speed: [1, 1, 1, yes]\n", r"node_speed\[3\]=True must be a positive number"),
    ("node_memory_gib: [4, 4, -1, 4]\n", r"node_memory_gib\[2\]=-1 must be a positive number"),
    ("emulation: {cpu_share: 0}\n", r"emulation.cpu_share=0 must be a positive number"),
    ("emulation: {cpus: 1}\n", r"emulation takes only subnet, bridge and cpu_share"),
    ("cpu_share: 1\n", r"unknown key\(s\) cpu_share"),
])
def test_bad_per_node_keys_one_line_error(tmp_path, extra, msg):
    path = _cluster_file(tmp_path, extra)
    with pytest.raises(UserError, match=msg) as e:
        load_cluster(path)
    assert path in str(e.value) and "\n" not in str(e.value)


def test_emulation_cpu_share_is_parsed(tmp_path):
    c = load_cluster(_cluster_file(tmp_path, "node_speed: [1, 1, 1, 0.5]\n"
                                             "emulation: {cpu_share: 0.75}\n"))
    assert c.cpu_share == 0.75 and c.speed_of([3]) == 0.5


# ------------------------------------------------------------------ emulation quotas


def test_cpu_quotas_fair_share_and_override():
    # fair share: 8 cores / 4 nodes = 2 cores per node at speed 1.0
    assert cpu_quotas([1.0, 1.0, 0.5, 0.5], 1, 8) == [200_000, 200_000, 100_000, 100_000]
    # 2 devices per node on 2 nodes: 8 cores x 2 / 4 ranks = 4 cores per node
    assert cpu_quotas([1.0, 0.5], 2, 8) == [400_000, 200_000]
    assert cpu_quotas([1.0, 0.5], 1, 8, cpu_share=0.5) == [50_000, 25_000]
    assert cpu_quotas([0.001], 1, 1) == [1_000]   # the kernel's minimum quota
    spec = load_cluster(str(HALF))
    assert cluster_quotas(spec, cpu_count=2) == [50_000, 50_000, 25_000, 25_000]
    spec.cpu_share = 1.0
    assert cluster_quotas(spec, cpu_count=2) == [100_000, 100_000, 50_000, 50_000]
    # every node at 1.0 (or no key): no cgroups at all, as before
    assert cluster_quotas(load_cluster(str(ROOT / "configs/cluster/four-nodes-1g.yaml"))) is None
    spec.node_speed = [1.0] * 4
    assert cluster_quotas(spec) is None


# ------------------------------------------------------------------ cost model


def _cost_model(cluster: Cluster, tp: int = 4, ranks=None) -> CostModel:
    shape = ModelShape("gpt", 2, 256, 8, 8, 1024, 512, 64)
    run = RunShape(tp, 4 // tp, 8, 1, 2, "oases", "fine")
    return CostModel(shape, run, cluster, analytic_profile(shape, run, shape.valid_degrees(tp)),
                     ranks=ranks)


def test_half_speed_node_doubles_predicted_compute():
    fast = dict(nodes=4, devices_per_node=1, device_memory_gib=4,
                intra_node_bandwidth_gbps=1e6, inter_node_bandwidth_gbps=1e6)  # links ~free
    ref = _cost_model(Cluster("ref", **fast))
    half = _cost_model(Cluster("half", **fast, node_speed=[1.0, 1.0, 1.0, 0.5]))
    assert ref.speed == 1.0 and half.speed == 0.5
    for key in ref.cf:
        assert half.cf[key] == pytest.approx(2 * ref.cf[key])
        assert half.cb[key] == pytest.approx(2 * ref.cb[key])
        assert half.m[key] == ref.m[key] and half.mem[key] == ref.mem[key]  # links, bytes
    assert half.constant_time() == pytest.approx(2 * ref.constant_time())
    for plan in ([4] * ref.n, [1, 2, 4, 2]):
        assert half.plan_time(plan) == pytest.approx(2 * ref.plan_time(plan), rel=1e-3)
        assert half.plan_memory(plan) == ref.plan_memory(plan)
    # only the run's ranks count: tp=2 x dp=2 spans node 3 too, ranks 0-2 do not
    assert _cost_model(Cluster("half", **fast, node_speed=[1.0, 1.0, 1.0, 0.5]), tp=2).speed == 0.5
    assert _cost_model(Cluster("half", **fast, node_speed=[1.0, 1.0, 1.0, 0.5]),
                       ranks=[0, 1, 2]).speed == 1.0


@pytest.mark.slow  # a planner process that profiles the model
def test_plan_cli_memory_limit_is_the_smallest_node(tmp_path, monkeypatch):
    """``python -m oases.plan`` without --memory-gib plans for the run's smallest
    device: a tiny node 3 makes every plan too big (one line, exit 2)."""
    import oases.planner.profile as profile
    from oases.cli.plan import main

    def analytic(cfg, run, device, db, **_):
        shape = ModelShape.from_config(cfg.model)
        return analytic_profile(shape, run, shape.valid_degrees(run.tp))

    monkeypatch.setattr(profile, "get_profile", analytic)
    cluster = _cluster_file(tmp_path, "node_memory_gib: [4, 4, 4, 0.0001]\n")
    args = ["--config", str(ROOT / "configs/gpt-tiny.yaml"), "--cluster", cluster,
            "--out", str(tmp_path / "plan.yaml"), "parallel.tp=4", "parallel.schedule=oases",
            "parallel.recompute=fine", "model.n_layer=2"]
    assert main(args) == 2
    assert not (tmp_path / "plan.yaml").exists()
    assert main(args[:4] + ["--memory-gib", "4"] + args[4:]) == 0  # an explicit limit wins


# ------------------------------------------------------------------ a real quota

# Burns a fixed amount of CPU time (so the work is the same whatever the host's
# speed) and reports the wall time it took and the cpu cgroup it ran in.
_BURN = """
import time
t0 = time.perf_counter()
while time.process_time() < {cpu_s}:
    pass
cg = [l for l in open('/proc/self/cgroup') if ':cpu:' in l or ':cpu,' in l]
print(time.perf_counter() - t0, cg[0].strip().split(':')[-1])
"""


@pytest.mark.skipif(cgroup_problem() is not None, reason=f"per-node cpu quotas: {cgroup_problem()}")
def test_half_speed_quota_halves_the_compute_rate():
    """The emulator's cgroups (same helper, same quota arithmetic) on one process at a
    time: the 0.5 node takes ~2x as long for the same CPU work. Shares of 0.5 core and
    0.25 core, below what one process gets even on a busy 2-core host, so the quota and
    not the neighbours sets both paces."""
    tag = f"oases{os.getpid()}"
    cg = NodeCgroups(tag, cpu_quotas([1.0, 0.5], 1, os.cpu_count() or 1, cpu_share=0.5))
    sleeper = None
    try:
        cg.create()
        wall = []
        for i in range(2):
            out = subprocess.run(cg.wrap(i, [sys.executable, "-c", _BURN.format(cpu_s=0.35)]),
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            seconds, group = out.stdout.split()
            assert group == f"/{tag}/node{i}"     # the process ran inside its node's cgroup
            wall.append(float(seconds))
        assert 1.6 <= wall[1] / wall[0] <= 2.5, wall
        # teardown removes a cgroup that still holds a process (killing it first)
        sleeper = subprocess.Popen(cg.wrap(0, ["sleep", "60"]))
        deadline = time.monotonic() + 5
        while str(sleeper.pid) not in (cg.path(0) / "cgroup.procs").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cg.remove()
        assert sleeper.wait(5) == -9 and not cg.base.exists()
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
        cg.remove()
    assert not cg.base.exists()


@pytest.mark.skipif(cgroup_problem() is not None, reason=f"per-node cpu quotas: {cgroup_problem()}")
def test_stale_cgroups_of_a_dead_launcher_are_removed():
    dead = subprocess.Popen(["true"])
    dead.wait()
    cg = NodeCgroups(f"oases{dead.pid}", [50_000, 25_000], devices_per_node=2)
    try:
        cg.create()
        assert (cg.path(1) / "cpu.cfs_quota_us").read_text().strip() == "25000"
        # under contention the cluster weighs as its 4 ranks would outside a cgroup
        assert (cg.base / "cpu.shares").read_text().strip() == str(4 * 1024)
        assert (cg.path(0) / "cpu.shares").read_text().strip() == str(2 * 1024)
        # only this launcher's group is judged stale: other clusters' are left alone
        removed = cleanup_stale_cgroups(lambda pid: pid == dead.pid)
        assert removed == [str(CPU_ROOT / f"oases{dead.pid}")] and not cg.base.exists()
    finally:
        cg.remove()
