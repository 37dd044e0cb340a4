"""The emulated cluster's network: one namespace per node, a switch namespace with a
bridge, a veth pair per node (see :mod:`emucluster.cluster` for the picture).

Names: namespaces are ``oases<pid>-n<i>`` and ``oases<pid>-sw`` (``<pid>`` = the
launcher's process id, so concurrent clusters never clash). Both ends of every veth
are created inside the namespaces: nothing ever lives in the host's, and deleting
the namespaces removes the veths and the bridge with them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

PREFIX = "oases"
NS_RE = re.compile(rf"^{PREFIX}(\d+)-(sw|n\d+)$")


class ClusterError(Exception):
    """The cluster cannot be set up (not root, no iproute2, bad cluster file)."""


def check_prerequisites() -> None:
    """Raise ClusterError (one line) unless we are root with ``ip`` and ``tc``."""
    if not sys.platform.startswith("linux"):
        raise ClusterError("the emulated cluster needs Linux (network namespaces)")
    if os.geteuid() != 0:
        raise ClusterError("the emulated cluster needs root (network namespaces, tc): "
                           "run it with sudo")
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"the emulated cluster needs iproute2: {' and '.join(missing)} "
                           f"not found on PATH (apt-get install iproute2)")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and r.returncode:
        raise ClusterError(f"`{' '.join(args)}` failed: {r.stderr.strip() or r.stdout.strip()}")
    return r


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ifname(i: int) -> str:
    """Node i's veth, inside its namespace (GLOO_SOCKET_IFNAME)."""
    return f"{PREFIX}-v{i}"


def list_namespaces() -> list[str]:
    r = sh("ip", "netns", "list", check=False)
    return [ln.split()[0] for ln in r.stdout.splitlines() if ln.strip()]


def ns_pids(ns: str) -> list[int]:
    r = sh("ip", "netns", "pids", ns, check=False)
    return [int(x) for x in r.stdout.split() if x.isdigit()]


def kill_ns_processes(ns: str, grace_s: float = 3.0) -> None:
    pids = ns_pids(ns)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for p in ns_pids(ns) if pid_alive(p)]
            if not pids:
                return
            time.sleep(0.05)


def delete_namespace(ns: str) -> None:
    kill_ns_processes(ns)
    sh("ip", "netns", "del", ns, check=False)


def stale_namespaces(stale) -> list[str]:
    """Delete the cluster namespaces whose launcher pid ``stale(pid)``; returns their names."""
    removed = []
    for ns in list_namespaces():
        m = NS_RE.match(ns)
        if m and stale(int(m.group(1))):
            delete_namespace(ns)
            removed.append(ns)
    return removed


def build_switch(switch_ns: str, bridge: str) -> None:
    """The switch namespace with loopback up and an addressless bridge."""
    sh("ip", "netns", "add", switch_ns)
    sw = ("ip", "-n", switch_ns)
    sh(*sw, "link", "set", "lo", "up")
    sh(*sw, "link", "add", bridge, "type", "bridge")
    sh(*sw, "link", "set", bridge, "up")


def build_node(i: int, ns: str, switch_ns: str, bridge: str, address: str) -> None:
    """Node i's namespace, its veth (``address`` = ip/prefixlen) and its switch port p<i>."""
    sh("ip", "netns", "add", ns)
    nd, sw = ("ip", "-n", ns), ("ip", "-n", switch_ns)
    sh(*nd, "link", "set", "lo", "up")
    port, veth = f"p{i}", ifname(i)
    # Both ends are created inside the namespaces: nothing ever lives in the host's.
    sh(*sw, "link", "add", port, "type", "veth", "peer", "name", veth, "netns", ns)
    sh(*sw, "link", "set", port, "master", bridge)
    sh(*sw, "link", "set", port, "up")
    sh(*nd, "addr", "add", address, "dev", veth)
    sh(*nd, "link", "set", veth, "up")


def wait_links(node_ns: list[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    for i, ns in enumerate(node_ns):
        while True:
            r = sh("ip", "-n", ns, "-o", "link", "show", ifname(i), check=False)
            if "LOWER_UP" in r.stdout:
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"link {ifname(i)} in {ns} did not come up")
            time.sleep(0.05)
