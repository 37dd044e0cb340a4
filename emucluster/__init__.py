"""The emulated cluster: N nodes on one Linux machine (network namespaces joined by veth
links to a bridge, ``tc`` shaping each link, a cgroup cpu quota per node), each running
``torchrun``. Benchmarks and tests import it; it imports nothing from them.

    sudo .venv/bin/python -m emucluster \\
        --cluster configs/cluster/two-nodes-500m.yaml -- <train.py args>

:mod:`.cluster` launches and tears down, :mod:`.netns` builds the network,
:mod:`.shaping` the links, :mod:`.cpu_cgroup` the per-node compute speed.
Needs root and iproute2 (``ip``, ``tc``).
"""

from emucluster.cluster import (EXIT_USAGE, ClusterError, ClusterSpec,
                                           EmulatedCluster, NodeResult, check_prerequisites,
                                           cleanup_stale, free_port, load_specs)

__all__ = ["EXIT_USAGE", "ClusterError", "ClusterSpec", "EmulatedCluster", "NodeResult",
           "check_prerequisites", "cleanup_stale", "free_port", "load_specs"]
