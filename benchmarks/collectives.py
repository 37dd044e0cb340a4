"""One tensor's all-reduce, reduce-scatter and all-gather across a shaped link (gloo).

    sudo .venv/bin/python -m benchmarks.collectives [--clusters FILE ...] [--mib 2]

On each cluster (default the 500 Mbit/s 2-node one; needs root, as benchmarks.overlap)
one process per node times, between barriers, the collectives sequence parallelism
trades for an all-reduce: gloo's ``reduce_scatter_tensor``, the all-to-all plus local
sum that oases uses on gloo instead (``oases.parallel.comm``), and the all-gather.
Medians of ``--repeats`` after 2 warm-up calls, the kinds interleaved within each
repeat. Writes benchmarks/results/collectives.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.lib import driver
from emucluster import EmulatedCluster, load_specs
from benchmarks.lib.machine import machine_info

KINDS = ["all_reduce", "reduce_scatter_tensor", "all_to_all_single + sum",
         "all_gather_into_tensor"]


def node_main(mib: float, repeats: int, out: str) -> None:
    """One node's process (torchrun): rank 0 writes the medians (ms) to ``out``."""
    import statistics  # deferred: node side only

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    torch.set_num_threads(1)
    M = int(mib * 2**20 / 4) // n * n
    x = torch.randn(M)
    chunk, full, recv = torch.empty(M // n), torch.empty(M), torch.empty(M)
    ops = {"all_reduce": lambda: dist.all_reduce(x.clone()),
           "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(chunk, x),
           "all_to_all_single + sum": lambda: (dist.all_to_all_single(recv, x),
                                               torch.sum(recv.view(n, -1), 0, out=chunk)),
           "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, x[: M // n])}
    times = {k: [] for k in KINDS}
    for r in range(repeats + 2):
        for k in KINDS:
            dist.barrier()
            t0 = time.perf_counter()
            ops[k]()
            if r >= 2:
                times[k].append(time.perf_counter() - t0)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(
            {k: 1e3 * statistics.median(v) for k, v in times.items()} | {"mib": M * 4 / 2**20}))
    dist.destroy_process_group()


def render(out: Path, data: dict) -> None:
    lines = ["# Collectives across a shaped link (gloo)", "",
             driver.machine_line(data["machine"]), "", driver.command_line(data), "",
             "| cluster | MiB | " + " | ".join(KINDS) + " |",
             "|---|---|" + "---|" * len(KINDS)]
    for name, r in data["clusters"].items():
        lines.append(f"| {name} | {r['mib']:.1f} | "
                     + " | ".join(f"{r[k]:.1f} ms" for k in KINDS) + " |")
    lines += ["", "A bandwidth-optimal reduce-scatter or all-gather moves half an "
              "all-reduce's bytes at 2 ranks. gloo's reduce-scatter moves as many as the "
              "all-reduce; the all-to-all plus a local sum moves half.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    p = driver.parser(__doc__)
    p.add_argument("--clusters", nargs="+", default=["configs/cluster/two-nodes-500m.yaml"])
    p.add_argument("--mib", type=float, default=2.0, help="tensor size (one block's partial "
                   "sum at the overlap benchmark's shape: 8 x 128 x 512 fp32)")
    p.add_argument("--repeats", type=int, default=7)
    driver.report_flags(p, "collectives")
    p.add_argument("--on-node", nargs=3, metavar=("MIB", "REPEATS", "OUT"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    if args.on_node:
        node_main(float(args.on_node[0]), int(args.on_node[1]), args.on_node[2])
        return 0
    specs = load_specs(args.clusters)
    if specs is None:
        return 2
    t0, res = time.time(), {}
    for spec in specs:
        got = Path(driver.RESULTS, f".collectives-{spec.name}.json")
        with EmulatedCluster(spec) as c:
            runs = c.run(lambda i: c.torchrun_command(
                i, ["--on-node", str(args.mib), str(args.repeats), str(got)],
                script="benchmarks.collectives", module=True), timeout=600)
        if not all(r.ok for r in runs) or not got.exists():
            print(f"error: {spec.name}: {runs[0].output[-2000:]}", file=sys.stderr)
            return 1
        res[spec.name] = json.loads(got.read_text())
        got.unlink()
    driver.save(driver.out_prefix(args, "collectives"), {
        "machine": machine_info(), "command": driver.command("benchmarks.collectives", argv),
        "elapsed_min": (time.time() - t0) / 60, "clusters": res}, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
