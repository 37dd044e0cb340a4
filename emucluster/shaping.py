"""Link shaping of the emulated cluster with ``tc``.

* Uniform cluster (no ``bandwidth_matrix_gbps``): a NIC model. Each node's veth
  egress is a ``tbf`` at ``inter_node_bandwidth_gbps`` (with a ``netem delay`` of
  ``latency_ms`` as its child when > 0), and so is the switch port towards the
  node (its ingress), so a node sends and receives at most the link rate, in each
  direction at once (full duplex).
* ``bandwidth_matrix_gbps`` (heterogeneous): a per-pair link model. Each node's
  veth egress is an ``htb`` with one class per peer j (rate = ceil = matrix[i][j])
  selected by a ``u32`` filter on the destination IP, each class with its own
  ``netem delay`` leaf when ``latency_ms`` > 0; unclassified traffic (ARP) goes to a
  default class at the fastest rate. Switch ports are not shaped, so a node can
  receive from two peers at their two link rates at once.
"""

from __future__ import annotations

from emucluster.netns import ClusterError, ifname, sh


def netem(*args: str) -> None:
    r = sh(*args, check=False)
    if r.returncode and "unknown" in r.stderr.lower():
        raise ClusterError("latency_ms > 0 needs the netem qdisc (CONFIG_NET_SCH_NETEM), which "
                           "this kernel lacks: set latency_ms: 0 in the cluster file")
    if r.returncode:
        raise ClusterError(f"`{' '.join(args)}` failed: {r.stderr.strip()}")


def kbit(gbps: float) -> str:
    return f"{max(1, round(gbps * 1e6))}kbit"


def burst_bytes(gbps: float) -> int:
    # 2 ms at the link rate, at least 32 KiB: enough for tbf/htb at HZ=250..1000
    # and a few MTU packets, small against the MB-sized TP messages.
    return max(32 * 1024, int(gbps * 1e9 / 8 * 0.002))


def shape_node(spec, i: int, ns: str, switch_ns: str, ips: list[str]) -> None:
    """The qdiscs of node i (namespace ``ns``) for cluster file ``spec``."""
    dev = ifname(i)
    tc = ("ip", "netns", "exec", ns, "tc")
    delay = ["netem", "delay", f"{spec.latency_ms}ms", "limit", "100000"] if spec.latency_ms else None
    if spec.bandwidth_matrix_gbps is None:
        rate = spec.inter_node_bandwidth_gbps
        tbf = ["tbf", "rate", kbit(rate), "burst", str(burst_bytes(rate)), "latency", "500ms"]
        sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
        if delay:
            netem(*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *delay)
        # ingress of the node = egress of its switch port; no delay there (one-way
        # latency is added once, on the sender's side)
        swtc = ("ip", "netns", "exec", switch_ns, "tc")
        sh(*swtc, "qdisc", "add", "dev", f"p{i}", "root", "handle", "1:", *tbf)
        return
    peers = [j for j in range(spec.nodes) if j != i]
    rates = {j: spec.node_gbps(i, j) for j in peers}
    top = max(rates.values()) if rates else spec.inter_node_bandwidth_gbps
    total = sum(rates.values()) or top

    def cls(parent: str, classid: str, gbps: float) -> None:
        b = str(burst_bytes(gbps))
        sh(*tc, "class", "add", "dev", dev, "parent", parent, "classid", classid, "htb",
           "rate", kbit(gbps), "ceil", kbit(gbps), "burst", b, "cburst", b)

    sh(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2")
    cls("1:", "1:1", total + top)
    cls("1:1", "1:2", top)                      # default: ARP and anything unmatched
    for j in peers:
        minor = f"{0x10 + j:x}"
        cls("1:1", f"1:{minor}", rates[j])
        if delay:
            netem(*tc, "qdisc", "add", "dev", dev, "parent", f"1:{minor}",
                  "handle", f"{0x10 + j:x}:", *delay)
        sh(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
           "u32", "match", "ip", "dst", f"{ips[j]}/32", "flowid", f"1:{minor}")
