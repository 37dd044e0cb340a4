"""An emulated multi-node cluster on one Linux machine: network namespaces, veth, tc.

    with EmulatedCluster("configs/cluster/two-nodes-500m.yaml") as c:   # root needed
        port = free_port()
        results = c.run(lambda i: c.torchrun_command(i, [...], "train.py", port))

starts a command in every node at once (``torchrun --nnodes N --node-rank i
--nproc-per-node D`` in each node, gloo over the emulated link). The network is
:mod:`.netns`, the shaping :mod:`.shaping`, the per-node cpu quota :mod:`.cpu_cgroup`;
this module launches and tears down.
Needs root and iproute2 (``ip``, ``tc``).

Topology (nothing is created in the host's own network namespace)::

      netns oases<pid>-n0          netns oases<pid>-sw            netns oases<pid>-n1
    +---------------------+     +------------------------+     +---------------------+
    | oases-v0 10.231.0.1 |=====| p0 --+                 |     |                     |
    |  tc: tbf/htb egress |     |  tbf |  bridge         |=====| oases-v1 10.231.0.2 |
    +---------------------+     |  p1 -+  (no address)   |     |  tc: tbf/htb egress |
                                +------------------------+     +---------------------+

* Every node is a network namespace with loopback up and one veth whose peer
  is a port of a bridge that lives in a separate "switch" namespace. The bridge
  has no address and the host namespace holds no part of the cluster, so the
  subnet (a private /24, ``emulation.subnet``) exists only inside the cluster,
  and deleting the namespaces removes every veth and the bridge with them.
* Links: a ``tbf`` NIC model on a uniform cluster, per-peer ``htb`` classes on a
  ``bandwidth_matrix_gbps`` one (:mod:`emucluster.shaping` says how).
* ``node_speed`` (some node != 1.0): every node's processes run in a cgroup v1
  cpu cgroup whose quota is its speed times its fair share of the host's cores
  (:mod:`emucluster.cpu_cgroup`); without it, no cgroup is made.

Names: namespaces are ``oases<pid>-n<i>`` and ``oases<pid>-sw`` (``<pid>`` = the
launcher's process id, so concurrent clusters never clash); at start-up the
namespaces of launchers that no longer run are removed (their processes killed
first), then their cpu cgroups. Teardown runs on ``__exit__``, on any exception,
on SIGINT/SIGTERM/SIGHUP (handlers installed while the cluster is up) and at
interpreter exit.
"""

from __future__ import annotations

import atexit
import dataclasses
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from emucluster import netns
from emucluster.cpu_cgroup import (CgroupError, NodeCgroups, cgroup_problem,
                                              cleanup_stale_cgroups, cluster_quotas)
from emucluster.netns import (NS_RE, PREFIX, ClusterError,  # noqa: F401
                                         check_prerequisites, list_namespaces)
from emucluster.shaping import shape_node
from oases.errors import UserError
from oases.planner.cluster import Cluster, load_cluster

REPO = Path(__file__).resolve().parents[1]
EXIT_USAGE = 2


class ClusterSpec(Cluster):
    """The cluster file, as the planner reads it (oases.planner.cluster: one schema,
    one validation), with bad-file errors raised as :class:`ClusterError`."""

    @classmethod
    def load(cls, path: str | Path) -> "ClusterSpec":
        try:
            c = load_cluster(str(path))
        except UserError as e:
            raise ClusterError(str(e)) from None
        return cls(**dataclasses.asdict(c))


def load_specs(paths) -> Optional[list[ClusterSpec]]:
    """The cluster files of a benchmark run, once the emulated cluster's prerequisites
    (root, iproute2) are checked; None after printing the one-line error (the caller
    exits with status 2)."""
    try:
        check_prerequisites()
        return [ClusterSpec.load(c) for c in paths]
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def cleanup_stale(everything: bool = False) -> list[str]:
    """Remove the namespaces and cpu cgroups of launchers that are no longer running
    (all ``oases<pid>`` ones with ``everything``); returns the names removed."""
    def stale(owner: int) -> bool:
        return everything or (owner != os.getpid() and not netns.pid_alive(owner))

    removed = netns.stale_namespaces(stale)
    try:  # after the namespaces: their processes, the cgroups' members, are gone
        removed += cleanup_stale_cgroups(stale)
    except CgroupError as e:
        raise ClusterError(str(e)) from None
    return removed


def free_port() -> int:
    """A TCP port free on this host. (Each node namespace is fresh, so it is free there too.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class NodeResult:
    node: int
    returncode: Optional[int]   # None: killed by the launcher (timeout or a failed peer)
    output: str                 # stdout and stderr, interleaved
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class EmulatedCluster:
    """``with EmulatedCluster(spec) as c: c.run(lambda i: [...])`` — see the module doc."""

    _live: list["EmulatedCluster"] = []   # for the signal/atexit handlers

    def __init__(self, spec: ClusterSpec | str | Path, tag: Optional[str] = None) -> None:
        self.spec = spec if isinstance(spec, ClusterSpec) else ClusterSpec.load(spec)
        self.tag = tag or f"{PREFIX}{os.getpid()}"
        if not NS_RE.match(f"{self.tag}-sw"):
            raise ClusterError(f"tag {self.tag!r} must be {PREFIX}<pid>")
        net = ipaddress.ip_network(self.spec.subnet)
        self.prefixlen = net.prefixlen
        self.ips = [str(net.network_address + i + 1) for i in range(self.spec.nodes)]
        self.switch_ns = f"{self.tag}-sw"
        self.node_ns = [f"{self.tag}-n{i}" for i in range(self.spec.nodes)]
        quotas = cluster_quotas(self.spec)   # None: every node at speed 1.0
        self.cgroups = NodeCgroups(self.tag, quotas, self.spec.devices_per_node) if quotas else None
        self._procs: list[subprocess.Popen] = []
        self._up = False
        self._torn_down = False
        self._old_handlers: dict = {}
        self._lock = threading.Lock()

    # names ---------------------------------------------------------------
    def ifname(self, i: int) -> str:
        """The node's veth, inside its namespace (GLOO_SOCKET_IFNAME)."""
        return netns.ifname(i)

    @property
    def master_addr(self) -> str:
        return self.ips[0]

    # lifecycle -----------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        check_prerequisites()
        if self.cgroups and (why := cgroup_problem()):
            raise ClusterError(f"node_speed needs per-node cpu quotas: {why}")
        cleanup_stale()
        EmulatedCluster._live.append(self)
        self._install_handlers()
        try:
            self._setup()
        except BaseException:
            self.teardown()
            raise
        self._up = True
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals can only be handled in the main thread; atexit still applies
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)
        atexit.register(self.teardown)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        self._old_handlers.clear()

    def _setup(self) -> None:
        s = self.spec
        if self.cgroups:
            try:
                self.cgroups.create()
            except CgroupError as e:
                raise ClusterError(str(e)) from None
        netns.build_switch(self.switch_ns, s.bridge)
        for i, ns in enumerate(self.node_ns):
            netns.build_node(i, ns, self.switch_ns, s.bridge, f"{self.ips[i]}/{self.prefixlen}")
            shape_node(s, i, ns, self.switch_ns, self.ips)
        netns.wait_links(self.node_ns)

    def teardown(self) -> None:
        """Kill every process in the cluster and delete its namespaces (idempotent)."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        # A second Ctrl-C during teardown must not leave half the cluster behind.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
        try:
            self._kill_procs()
            for ns in [*self.node_ns, self.switch_ns]:
                if ns in list_namespaces():
                    netns.delete_namespace(ns)
            if self.cgroups:  # empty now: their processes died with the namespaces
                try:
                    self.cgroups.remove()
                except CgroupError as e:  # teardown goes on; --cleanup retries later
                    print(f"warning: {e}", file=sys.stderr, flush=True)
        finally:
            self._up = False
            if self in EmulatedCluster._live:
                EmulatedCluster._live.remove(self)
            try:
                atexit.unregister(self.teardown)
            except Exception:  # pragma: no cover
                pass
            self._restore_handlers()

    def leftovers(self) -> list[str]:
        """Namespaces (and the cpu cgroup) of this cluster that still exist (empty after
        teardown)."""
        ours = {*self.node_ns, self.switch_ns}
        left = [ns for ns in list_namespaces() if ns in ours]
        if self.cgroups and self.cgroups.base.exists():
            left.append(str(self.cgroups.base))
        return left

    def _kill_procs(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self._procs.clear()

    # running -------------------------------------------------------------
    def node_env(self, i: int, extra: Optional[dict] = None) -> dict:
        env = dict(os.environ)
        env.update({"GLOO_SOCKET_IFNAME": self.ifname(i), "OMP_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    "OASES_NODE": str(i), "OASES_NODE_IP": self.ips[i]})
        env.pop("TP_SOCKET_IFNAME", None)
        env.update(extra or {})
        return env

    def run(self, cmd_for_node: Callable[[int], list[str]], timeout: float = 600.0,
            env: Optional[dict] = None, cwd: Optional[str | Path] = None,
            peer_grace_s: float = 20.0) -> list[NodeResult]:
        """Run ``cmd_for_node(i)`` in every node at once; wait for all of them.

        A node still running ``timeout`` seconds after the start, or ``peer_grace_s``
        seconds after another node failed (its collectives would otherwise wait for
        the dead peer), is killed (``returncode None``). Returns one NodeResult per node.
        """
        if not self._up:
            raise ClusterError("the cluster is not up (use it as a context manager)")
        logs, procs = [], []
        try:
            for i, ns in enumerate(self.node_ns):
                log = tempfile.TemporaryFile(mode="w+b")
                logs.append(log)
                cmd = ["ip", "netns", "exec", ns, *map(str, cmd_for_node(i))]
                if self.cgroups:  # joins node i's cpu cgroup before anything of it runs
                    cmd = self.cgroups.wrap(i, cmd)
                p = subprocess.Popen(cmd,
                                     env=self.node_env(i, env), cwd=str(cwd or REPO),
                                     stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
                procs.append(p)
                self._procs.append(p)
            start = time.monotonic()
            killed_at: dict[int, bool] = {}
            failed_at = None
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                over = now - start > timeout
                if over or (failed_at is not None and now - failed_at > peer_grace_s):
                    for i, p in enumerate(procs):
                        if p.poll() is None:
                            killed_at[i] = over
                            _killpg(p)
                    for p in procs:
                        p.wait()
                    break
                time.sleep(0.05)
            for ns in self.node_ns:  # stragglers (e.g. workers orphaned by a killed torchrun)
                if netns.ns_pids(ns):
                    netns.kill_ns_processes(ns)
            results = []
            for i, (p, log) in enumerate(zip(procs, logs)):
                log.seek(0)
                out = log.read().decode(errors="replace")
                rc = None if i in killed_at else p.returncode
                results.append(NodeResult(i, rc, out, timed_out=killed_at.get(i, False)))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    _killpg(p)
                    p.wait()
                if p in self._procs:
                    self._procs.remove(p)
            for log in logs:
                log.close()

    def torchrun_command(self, i: int, script_args: list[str], script: str = "train.py",
                         port: int = 29500, module: bool = False) -> list[str]:
        """``torchrun`` for node i (static rendezvous at node 0); with ``module`` the
        script is a module name, run as ``python -m`` runs it."""
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(self.spec.nodes), "--node-rank", str(i),
                "--nproc-per-node", str(self.spec.devices_per_node),
                "--master-addr", self.master_addr, "--master-port", str(port),
                *(["--module"] if module else []), script, *script_args]


def _killpg(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(3.0)
            return
        except subprocess.TimeoutExpired:
            continue


def _on_signal(signum, frame) -> None:
    if EmulatedCluster._live:
        print(f"{signal.Signals(signum).name}: tearing the emulated cluster down",
              file=sys.stderr, flush=True)
    for c in list(EmulatedCluster._live):
        c.teardown()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)
