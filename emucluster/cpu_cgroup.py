"""Per-node compute speed on the emulated cluster: one cgroup v1 cpu quota per node.

A cluster file's ``node_speed`` says how fast each node's devices compute relative
to the profiled device. The emulated cluster realises it with the kernel's CFS
bandwidth control: node i's processes may use at most

    cpu.cfs_quota_us = node_speed[i] x share x cpu.cfs_period_us

per period, where ``share`` (cores per node at speed 1.0) is the node's fair share
of the host, ``os.cpu_count() * devices_per_node / world`` cores, or
``emulation.cpu_share``. Capping the speed-1.0 nodes too keeps the comparison fair
on a loaded host: a 0.5 node gets half of what a 1.0 node gets, whatever else runs.

Layout: ``/sys/fs/cgroup/cpu/<tag>/node<i>``, ``<tag>`` = the cluster's
``oases<pid>`` (unique per launcher, like its namespaces). Under contention the
scheduler weighs a cgroup as one task (``cpu.shares`` 1024) against the host's
other tasks, so ``<tag>`` gets 1024 per rank and each node 1024 per device: the
cluster's processes weigh what they would outside a cgroup. A node's command is
launched through ``sh -c 'echo $$ > .../cgroup.procs && exec "$@"'``: the shell
enters the cgroup before it execs the real command, so nothing of the node runs
outside it, and every child (torchrun's workers) inherits it. Removal kills what
is still inside (a cluster being torn down) and removes the directories, deepest
first; the launcher also removes the groups of launchers that no longer run.
Needs root and the cgroup v1 cpu controller (``mount | grep cgroup``).

:class:`NodeQuota` is the pipeline benchmark's variant: the same quota for every node
(``--cpu-quota`` cores) plus a cpuacct group per node that measures each node's CPU.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from emucluster.netns import ClusterError

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
ACCT_ROOT = Path("/sys/fs/cgroup/cpuacct")
TASK_SHARES = 1024    # cpu.shares of one task at nice 0
PERIOD_US = 100_000
MIN_QUOTA_US = 1_000  # the kernel rejects a smaller quota
TAG_RE = re.compile(r"^oases(\d+)$")


class CgroupError(Exception):
    """A cgroup could not be created or removed (one line)."""


def cpu_quotas(speeds: Sequence[float], devices_per_node: int, cpu_count: int,
               cpu_share: Optional[float] = None, period_us: int = PERIOD_US) -> list[int]:
    """``cpu.cfs_quota_us`` of every node: speed x cores per node at speed 1.0 x period.
    The cores default to the node's fair share of the host's ``cpu_count`` cores."""
    world = len(speeds) * devices_per_node
    share = cpu_share if cpu_share is not None else cpu_count * devices_per_node / world
    return [max(MIN_QUOTA_US, round(float(s) * share * period_us)) for s in speeds]


def cluster_quotas(spec, cpu_count: Optional[int] = None) -> Optional[list[int]]:
    """The quotas for a cluster file, or None when every node runs at speed 1.0 (then no
    cgroup is made: the emulator behaves as for a cluster without speeds)."""
    speeds = spec.node_speed
    if not speeds or all(float(s) == 1.0 for s in speeds):
        return None
    return cpu_quotas(speeds, spec.devices_per_node, cpu_count or os.cpu_count() or 1,
                      spec.cpu_share)


def cgroup_problem(root: Path = CPU_ROOT) -> Optional[str]:
    """Why cpu quotas cannot be set on this host, or None if they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "cgroups need root"
    if not (root / "cpu.cfs_quota_us").is_file():
        return f"no cgroup v1 cpu controller at {root} (see `mount | grep cgroup`)"
    return None


class NodeCgroups:
    """The cpu cgroups of one cluster's nodes: ``create()``, ``wrap(i, cmd)``, ``remove()``."""

    def __init__(self, tag: str, quotas: Sequence[int], devices_per_node: int = 1,
                 period_us: int = PERIOD_US, root: Path = CPU_ROOT) -> None:
        if not TAG_RE.match(tag):
            raise CgroupError(f"cgroup tag {tag!r} must be oases<pid>")
        self.base = root / tag
        self.quotas, self.period_us = list(quotas), period_us
        self.devices_per_node = devices_per_node

    def path(self, i: int) -> Path:
        return self.base / f"node{i}"

    def create(self) -> None:
        """Make one cgroup per node with its quota (removing everything on failure)."""
        try:
            self.base.mkdir()
            world = len(self.quotas) * self.devices_per_node
            (self.base / "cpu.shares").write_text(str(TASK_SHARES * world))
            for i, q in enumerate(self.quotas):
                d = self.path(i)
                d.mkdir()
                (d / "cpu.shares").write_text(str(TASK_SHARES * self.devices_per_node))
                (d / "cpu.cfs_period_us").write_text(str(self.period_us))
                (d / "cpu.cfs_quota_us").write_text(str(q))
        except OSError as e:
            self.remove()
            raise CgroupError(f"cannot set up cpu cgroup {self.base}: {e.strerror or e}") from None

    def wrap(self, i: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` launched inside node i's cgroup (the shell joins it, then execs cmd)."""
        procs = self.path(i) / "cgroup.procs"
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *map(str, cmd)]

    def remove(self) -> None:
        remove_tree(self.base)


def _procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _empty(d: Path, grace_s: float = 5.0) -> None:
    """Kill what is left in cgroup ``d`` (SIGKILL: its cluster is being torn down)."""
    deadline = time.monotonic() + grace_s
    while (pids := _procs(d)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def remove_tree(base: Path) -> None:
    """Remove cgroup ``base`` and its children, deepest first (a cgroup directory goes
    with ``rmdir`` once no process is in it; its control files go with it)."""
    if not base.is_dir():
        return
    dirs = sorted((p for p in base.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for d in [*dirs, base]:
        _empty(d)
        try:
            d.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise CgroupError(f"cannot remove cpu cgroup {d}: {e.strerror or e}") from None


def cleanup_stale_cgroups(is_stale: Callable[[int], bool], root: Path = CPU_ROOT) -> list[str]:
    """Remove the ``oases<pid>`` cgroups whose launcher ``is_stale(pid)``; returns their paths."""
    if not root.is_dir():
        return []
    removed = []
    for d in sorted(root.iterdir()):
        m = TAG_RE.match(d.name)
        if m and d.is_dir() and is_stale(int(m.group(1))):
            remove_tree(d)
            removed.append(str(d))
    return removed


class NodeQuota:
    """One cgroup per emulated node: ``cpu.cfs_quota_us`` = cores x period (cores 0: no
    limit), plus a cpuacct group for accounting (this machine mounts cpu and cpuacct as
    separate v1 hierarchies). A node's command is wrapped so that it moves itself into
    both before exec."""

    def __init__(self, nodes: int, cores: float, period_us: int = 100_000) -> None:
        self.cores = cores
        self.period_us = period_us
        name = f"oases-pipeline-{os.getpid()}"
        self.roots = [CPU_ROOT / name, ACCT_ROOT / name]
        self.dirs: list[Path] = []
        self.acct: list[Path] = []
        if not (CPU_ROOT / "cpu.cfs_quota_us").is_file():
            if cores > 0:
                raise ClusterError(f"--cpu-quota needs the cgroup v1 cpu controller at "
                                   f"{CPU_ROOT}")
            return
        for r in self.roots:
            if r.parent.is_dir():
                r.mkdir(exist_ok=True)
        for i in range(nodes):
            d = self.roots[0] / f"n{i}"
            d.mkdir(exist_ok=True)
            (d / "cpu.cfs_period_us").write_text(str(period_us))
            (d / "cpu.cfs_quota_us").write_text(str(int(cores * period_us)) if cores > 0 else "-1")
            self.dirs.append(d)
            if self.roots[1].is_dir():
                a = self.roots[1] / f"n{i}"
                a.mkdir(exist_ok=True)
                self.acct.append(a)

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        if not self.dirs:
            return cmd
        # `ip netns exec` mounts a fresh /sys, which hides /sys/fs/cgroup: reach the
        # cgroups through this (host-side) process's root instead
        root = f"/proc/{os.getpid()}/root"
        paths = [f"{root}{self.dirs[i]}/cgroup.procs"]
        if self.acct:
            paths.append(f"{root}{self.acct[i]}/cgroup.procs")
        script = " && ".join(f'echo $$ > "${k + 1}"' for k in range(len(paths)))
        return ["sh", "-c", f"{script} && shift {len(paths)} && exec \"$@\"", "sh", *paths, *cmd]

    def usage_s(self) -> list[float]:
        """CPU seconds used so far by each node's processes (cpuacct)."""
        out = []
        for a in self.acct:
            try:
                out.append(int((a / "cpuacct.usage").read_text()) / 1e9)
            except (OSError, ValueError):
                out.append(float("nan"))
        return out

    def throttled_s(self) -> list[float]:
        out = []
        for d in self.dirs:
            try:
                st = dict(ln.split() for ln in (d / "cpu.stat").read_text().splitlines())
                out.append(int(st.get("throttled_time", 0)) / 1e9)
            except (OSError, ValueError):
                out.append(float("nan"))
        return out

    def close(self) -> None:
        for d in [*self.dirs, *self.acct]:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        for r in self.roots:
            try:
                r.rmdir()
            except OSError:
                pass


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all cores; /proc/stat)."""
    f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")
