"""Run a torchrun script on an emulated multi-node cluster (network namespaces, veth, tc).

    sudo .venv/bin/python -m emucluster --cluster configs/cluster/two-nodes-1g.yaml -- \\
        --config configs/gpt-tiny.yaml parallel.tp=2 data.kind=synthetic wandb.mode=disabled

runs ``train.py`` with those arguments on every node of the cluster
(``torchrun --nnodes N --node-rank i --nproc-per-node D`` in each node, gloo over
the emulated link) and prints node 0's output. ``--cleanup`` removes what a
crashed run left behind and exits. Needs root and iproute2 (``ip``, ``tc``).
The cluster itself is :mod:`emucluster.cluster`.
"""

from __future__ import annotations

import sys
from typing import Optional

from emucluster.cluster import (EXIT_USAGE, ClusterError, ClusterSpec,
                                           EmulatedCluster, check_prerequisites, cleanup_stale,
                                           free_port)


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, script_args = argv[:k], argv[k + 1:]
    p = argparse.ArgumentParser(
        prog="python -m emucluster", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s --cluster configs/cluster/X.yaml [options] -- <train.py args...>")
    p.add_argument("--cluster", help="cluster file (configs/cluster/*.yaml)")
    p.add_argument("--script", default="train.py", help="script torchrun runs in every node")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is killed")
    p.add_argument("--all-output", action="store_true", help="print every node's output, not only node 0's")
    p.add_argument("--cleanup", action="store_true",
                   help="remove the namespaces left by launchers that no longer run, then exit")
    args = p.parse_args(argv)
    try:
        check_prerequisites()
        if args.cleanup:
            removed = cleanup_stale()
            print(f"removed {len(removed)} namespace(s) and cgroup(s)"
                  f"{': ' + ' '.join(removed) if removed else ''}")
            return 0
        if not args.cluster:
            p.error("--cluster is required")
        spec = ClusterSpec.load(args.cluster)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    port = free_port()
    try:
        with EmulatedCluster(spec) as c:
            print(f"cluster {spec.name}: {spec.nodes} nodes {', '.join(c.ips)} "
                  f"({', '.join(c.node_ns)}), torchrun master {c.master_addr}:{port}",
                  file=sys.stderr, flush=True)
            results = c.run(lambda i: c.torchrun_command(i, script_args, args.script, port),
                            timeout=args.timeout)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted: cluster torn down", file=sys.stderr)
        return 130
    for r in results:
        if r.node == 0 or args.all_output:
            if args.all_output:
                print(f"===== node {r.node} (exit {r.returncode}) =====")
            sys.stdout.write(r.output)
    failed = [r for r in results if not r.ok]
    for r in failed:
        why = "timed out" if r.timed_out else ("killed after a peer failed" if r.returncode is None
                                                else f"exit status {r.returncode}")
        print(f"node {r.node}: {why}", file=sys.stderr)
    return 0 if not failed else (results[0].returncode or 1)


if __name__ == "__main__":
    sys.exit(main())
