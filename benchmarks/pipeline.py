"""Pipeline parallelism across a slow link: schedules, engines and stage layouts.

    .venv/bin/python -m benchmarks.pipeline               # as root: the full benchmark
    .venv/bin/python -m benchmarks.pipeline --quick       # smoke run: 1 repeat, 4 steps
    .venv/bin/python -m benchmarks.pipeline --clusters configs/cluster/hetero-4.yaml \\
        --modes megatron+full+1f1b oases+fine+1f1b --repeats 5

pp=2 x tp=2 on four emulated nodes in two fast pairs joined by a slow link, each node
under a cpu quota (``--cpu-quota``): the modes (``MODES``: the case and the train.py
overrides, or the torch peer), the clusters, the shapes and the figures are in
benchmarks/README.md, section pipeline.py. Writes ``benchmarks/results/pipeline.{md,json,png}``
(``--quick``: pipeline-quick.*) and the timelines of round 0; ``--from-json`` re-writes them.
The .md quotes ``<name>-analysis.md`` beside the JSON, hand-written notes on the timelines.
"""


from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

from benchmarks.lib import driver, train_run
from emucluster import ClusterError, ClusterSpec, EmulatedCluster, free_port, load_specs
from emucluster.cpu_cgroup import NodeQuota, busy_cpu_s
from benchmarks.lib.machine import machine_info
from benchmarks.lib.pipeline_report import BASELINE, RESHARD_ORDERS, TRACED_STEP, render, write_plan
from benchmarks.lib.timeline import render_timelines, slug, trace_stats

REPO = driver.REPO
PEER = "benchmarks.peers.torch_pipelining"
DEFAULT_CLUSTERS = ["configs/cluster/hetero-4.yaml", "configs/cluster/hetero-4-300m.yaml"]

ENGINES = {
    "megatron+full": ["parallel.schedule=megatron", "parallel.recompute=full"],
    "oases+fine": ["parallel.schedule=oases", "parallel.recompute=fine"],
}
# mode -> (case, train.py overrides or None for the peer)
MODES: dict[str, tuple[str, Optional[list[str]]]] = {
    "megatron+full+1f1b": ("uniform", [*ENGINES["megatron+full"], "parallel.pp_schedule=1f1b"]),
    "oases+fine+1f1b": ("uniform", [*ENGINES["oases+fine"], "parallel.pp_schedule=1f1b"]),
    "oases+fine+eager-1f1b": ("uniform", [*ENGINES["oases+fine"],
                                          "parallel.pp_schedule=eager-1f1b"]),
    "nocomm+1f1b": ("uniform", [*ENGINES["oases+fine"], "parallel.pp_schedule=1f1b",
                                "parallel.tp_comm_noop=true"]),
    "megatron+full+nocomm+1f1b": ("uniform", [*ENGINES["megatron+full"],
                                              "parallel.pp_schedule=1f1b",
                                              "parallel.tp_comm_noop=true"]),
    "torch-1f1b": ("uniform", None),
    "reshard:1f1b": ("reshard", [*ENGINES["oases+fine"], "parallel.pp_schedule=1f1b"]),
    "reshard:eager-1f1b": ("reshard", [*ENGINES["oases+fine"],
                                       "parallel.pp_schedule=eager-1f1b"]),
    "oases+fine+zb-h1": ("uniform", [*ENGINES["oases+fine"], "parallel.pp_schedule=zb-h1"]),
    "oases+fine+eager-zb-h1": ("uniform", [*ENGINES["oases+fine"],
                                           "parallel.pp_schedule=eager-zb-h1"]),
    # pp 4 x tp 1 over the four nodes: one stage per node, three boundaries
    # interleaved-1f1b: two chunks per rank (the model's 8 layers as 4 x 2 or 2 x 2 x 2)
    "oases+fine+interleaved-1f1b": ("uniform", [*ENGINES["oases+fine"],
                                                "parallel.pp_schedule=interleaved-1f1b",
                                                "parallel.pp_virtual=2"]),
    # pp 4 x tp 1 over the four nodes: one stage per node, three boundaries
    **{f"pp4:{k}": ("pp4", ["parallel.tp=1", "parallel.pp=4", "parallel.schedule=megatron",
                            "parallel.recompute=none", f"parallel.pp_schedule={k}",
                            f"parallel.pp_virtual={2 if k == 'interleaved-1f1b' else 1}"])
       for k in ("1f1b", "eager-1f1b", "zb-h1", "eager-zb-h1", "interleaved-1f1b")},
    "reshard:1f1b+send": ("reshard", [*ENGINES["oases+fine"], "parallel.pp_schedule=1f1b",
                                      "parallel.pp_transfer=send"]),
    "reshard:eager-1f1b+send": ("reshard", [*ENGINES["oases+fine"],
                                            "parallel.pp_schedule=eager-1f1b",
                                            "parallel.pp_transfer=send"]),
}
ALL_MODES = list(MODES)
# default: these on every cluster but the last, which runs LAST_MODES
CORE_MODES = ["megatron+full+1f1b", "megatron+full+nocomm+1f1b", "oases+fine+1f1b"]
LAST_MODES = [m for m in ALL_MODES if not m.endswith("+send")]

# (description, numerator, denominator, minimum ratio or None = information only)
TARGETS = [
    ("oases+fine+1F1B >= 1.25x megatron+full+1F1B", "oases+fine+1f1b", "megatron+full+1f1b", 1.25),
    ("eager-1F1B >= 1.1x 1F1B, resharding on the critical path", "reshard:eager-1f1b",
     "reshard:1f1b", 1.1),
    ("zb-h1 >= 1.1x 1F1B at pp=4 (run with m = 2pp = 8 micro-batches)", "pp4:zb-h1",
     "pp4:1f1b", 1.1),
    ("(info) eager-zb-h1 vs 1F1B at pp=4", "pp4:eager-zb-h1", "pp4:1f1b", None),
    ("(info) interleaved-1F1B (v=2) vs 1F1B at pp=4", "pp4:interleaved-1f1b", "pp4:1f1b", None),
    ("(info) interleaved-1F1B (v=2) vs 1F1B, pp 2 x tp 2", "oases+fine+interleaved-1f1b",
     "oases+fine+1f1b", None),
    ("(info) eager-1F1B vs 1F1B at pp=4", "pp4:eager-1f1b", "pp4:1f1b", None),
    ("(info) zb-h1 vs 1F1B, pp 2 x tp 2", "oases+fine+zb-h1", "oases+fine+1f1b", None),
    ("(info) eager-zb-h1 vs eager-1F1B, pp 2 x tp 2", "oases+fine+eager-zb-h1",
     "oases+fine+eager-1f1b", None),
    ("(info) eager-1F1B vs 1F1B, same layouts", "oases+fine+eager-1f1b", "oases+fine+1f1b", None),
    ("(info) oases+fine+1F1B vs the no-TP-comm bound", "oases+fine+1f1b", "nocomm+1f1b", None),
    ("(info) oases+fine+1F1B vs torch Schedule1F1B", "oases+fine+1f1b", "torch-1f1b", None),
    ("(info) megatron+full+1F1B vs torch Schedule1F1B (same modules)", "megatron+full+1f1b",
     "torch-1f1b", None),
    ("(info) broadcast vs send transfers, 1F1B, reshard case", "reshard:1f1b",
     "reshard:1f1b+send", None),
    ("(info) broadcast vs send transfers, eager-1F1B, reshard case", "reshard:eager-1f1b",
     "reshard:eager-1f1b+send", None),
]

# ~1-3 s steps on the 2-core box (4 processes); TP comm a large share of megatron+full
DEFAULT_MODEL = {"d_model": 512, "n_layer": 8, "n_head": 8, "seq_len": 128,
                 "micro_batch_size": 8}
DEFAULT_RESHARD_MODEL = {"d_model": 256, "n_layer": 6, "n_head": 8, "seq_len": 256,
                         "micro_batch_size": 4}
DEFAULT_RESHARD_SPLIT = 4


# ---------------------------------------------------------------------------
# One run


def microbatches(mode: str, args) -> int:
    return args.reshard_microbatches if MODES[mode][0] == "reshard" else args.microbatches


def train_args(mode: str, model: dict, args, out_dir: Path, plan: Optional[Path],
               trace: bool) -> list[str]:
    return [
        *train_run.gpt_overrides(model, args.vocab_size), "model.tie_embeddings=false",
        "parallel.tp=2", "parallel.pp=2", "parallel.device=cpu", "parallel.backend=gloo",
        f"parallel.timeout_s={args.run_timeout}",
        *([f"parallel.plan={plan}"] if plan is not None else []),
        *MODES[mode][1],
        *(["parallel.trace=true"] if trace else []),
        *train_run.timed_run_overrides(args.steps, model["micro_batch_size"],
                                    microbatches(mode, args), out_dir),
    ]


LAYOUT_RE = re.compile(r"^pipeline: (.*)$", re.M)


def run_one(cluster: EmulatedCluster, quota: NodeQuota, mode: str, model: dict, args,
            out_dir: Path, plan: Optional[Path], trace: bool) -> dict:
    rec: dict = {"cluster": cluster.spec.name, "mode": mode, "case": MODES[mode][0],
                 "ok": False, "error": None}
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    port = free_port()
    peer = MODES[mode][1] is None
    if peer:
        out_json = out_dir / "peer.json"
        script, script_args = PEER, train_run.peer_args(
            model, args, out_json, "--pp", "2", "--tp", "2", "--vocab", str(args.vocab_size),
            "--microbatches", str(microbatches("torch-1f1b", args)),
            "--timeout-s", str(min(args.run_timeout, 120)))
    else:
        script, script_args = "train.py", train_args(mode, model, args, out_dir, plan, trace)
    torchrun = lambda i: cluster.torchrun_command(i, script_args, script, port,  # noqa: E731
                                                  module=peer)
    cmd = lambda i: quota.wrap(i, torchrun(i))  # noqa: E731
    rec["command_node0"] = shlex.join(torchrun(0))
    rec["loadavg_1min_before"] = round(os.getloadavg()[0], 2)
    thr0, use0, busy0 = quota.throttled_s(), quota.usage_s(), busy_cpu_s()
    t0 = time.monotonic()
    results = cluster.run(cmd, timeout=args.run_timeout)
    wall = time.monotonic() - t0
    rec["wall_s"] = round(wall, 2)
    thr1, use1, busy1 = quota.throttled_s(), quota.usage_s(), busy_cpu_s()
    if thr0 and quota.cores > 0:
        rec["cpu_throttled_s"] = [round(b - a, 2) for a, b in zip(thr0, thr1)]
    if use0:
        ours = [b - a for a, b in zip(use0, use1)]
        rec["node_cpu_cores"] = [round(u / wall, 3) for u in ours]
        # what else ran on the machine meanwhile (the other tenants), in cores
        rec["others_cpu_cores"] = round(max(0.0, (busy1 - busy0) - sum(ours)) / wall, 3)
    for r in results:
        (out_dir / f"node{r.node}.log").write_text(r.output)
    rec["error"] = train_run.run_error(results, args.run_timeout)
    if rec["error"]:
        if any(r.timed_out for r in results):
            # what a hung peer printed last (e.g. the torch peer on gloo)
            tails = [ln for r in results for ln in r.output.splitlines()[-3:] if ln.strip()]
            rec["error_tail"] = tails[-6:]
        return rec
    try:
        if peer:
            data = json.loads(out_json.read_text())
            times = [float(t) for t in data["step_times_s"]][args.warmup:]
            tokens = int(data["tokens_per_step"])
            bubbles = []
            rec["losses"] = data.get("losses")
        else:
            m = LAYOUT_RE.search(results[0].output)
            rec["layout"] = m.group(1).strip() if m else None
            recs = train_run.metrics(out_dir)
            # the traced step (step 3) of a traced run is left out of the timing
            timed = [r for r in recs if "step_time_s" in r and r["step"] > args.warmup
                     and not (trace and r["step"] == TRACED_STEP)]
            times = [r["step_time_s"] for r in timed]
            bubbles = [r["pipeline_bubble"] for r in timed if "pipeline_bubble" in r]
            tokens = model["micro_batch_size"] * microbatches(mode, args) * model["seq_len"]
            rec["losses"] = [r.get("loss") for r in recs if "loss" in r]
    except train_run.READ_ERRORS as e:
        return train_run.unreadable(rec, e)
    train_run.timed(rec, times, tokens,
                    bubble=statistics.median(bubbles) if bubbles else None)
    if rec["ok"] and trace and not peer:
        traces = sorted(out_dir.glob("trace_rank*.json"))
        rec["traces"] = [str(p) for p in traces]
    return rec


# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Summary


def summarize_cluster(runs: list[dict], modes: list[str]) -> dict:
    def extra(mode: str, ok: list[dict]) -> dict:
        bub = [r["bubble"] for r in ok if r.get("bubble") is not None]
        return {"bubble": statistics.median(bub) if bub else None, "bubble_repeats": bub,
                "layout": next((r.get("layout") for r in ok if r.get("layout")), None)}

    per = driver.mode_medians(runs, modes, extra, lambda mode: {"case": MODES[mode][0]})
    for mode, m in per.items():
        if not m["ok"]:
            continue
        base = per.get(BASELINE[m["case"]], {})
        m["ratio_vs_baseline"] = (m["tokens_per_s"] / base["tokens_per_s"]
                                  if base.get("ok") else None)
    comm_share = driver.comm_share(per, "megatron+full+1f1b", "megatron+full+nocomm+1f1b")
    # the torch peer trains the same model on the same data: its losses must match
    # megatron+full+1f1b's step by step (a check that it runs the same computation)
    a = next((r for r in runs if r["mode"] == "torch-1f1b" and r["ok"] and r.get("losses")), None)
    b = next((r for r in runs if r["mode"] == "megatron+full+1f1b" and r["ok"]
              and r.get("losses")), None)
    if a and b and "torch-1f1b" in per:
        n = min(len(a["losses"]), len(b["losses"]))
        per["torch-1f1b"]["max_loss_diff_vs_megatron"] = max(
            abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n]))
        per["torch-1f1b"]["loss_steps_compared"] = n
    targets = driver.ratio_targets(per, TARGETS, runs)
    return {"modes": per, "megatron_full_comm_share": comm_share, "targets": targets}


def summarize(runs: list[dict], plan: list[dict]) -> dict:
    return {c["name"]: {**{k: c[k] for k in ("file", "fast_gbps", "slow_gbps", "modes")},
                        **summarize_cluster([r for r in runs if r["cluster"] == c["name"]],
                                            c["modes"])}
            for c in plan}


# ---------------------------------------------------------------------------


def parse_shape(p, kvs: list[str], default: dict, flag: str, even_layers: bool = True) -> dict:
    model = driver.parse_shape(p, kvs, default, flag)
    if model["d_model"] % model["n_head"] or model["n_head"] % 2:
        p.error(f"{flag}: n_head must divide d_model and be even (tp 2)")
    if model["n_layer"] < 2 or (even_layers and model["n_layer"] % 2):
        p.error(f"{flag}: n_layer must be even (2 stages of the same depth)")
    if model["micro_batch_size"] % 4:
        p.error(f"{flag}: micro_batch_size must be a multiple of 4 (2 sub-batches, and 2 dp "
                f"replicas in the reshard case)")
    return model


def parse_args(argv=None):
    p = driver.parser(__doc__)
    p.add_argument("--clusters", nargs="+", default=DEFAULT_CLUSTERS,
                   help="4-node cluster files; the last one also runs the torch peer and "
                        "the resharding case")
    p.add_argument("--modes", nargs="+", default=None, choices=ALL_MODES, metavar="MODE",
                   help=f"subset of: {' '.join(ALL_MODES)}, run on every cluster (default: "
                        f"{' '.join(CORE_MODES)} on every cluster but the last, and "
                        f"{' '.join(LAST_MODES)} on the last)")
    driver.run_flags(p, steps=5, warmup=2)
    p.add_argument("--microbatches", type=int, default=4,
                   help="same-layout case: train.grad_accum (>= pp)")
    p.add_argument("--reshard-microbatches", type=int, default=8)
    train_run.model_flag(p, DEFAULT_MODEL, what="same-layout shape")
    train_run.model_flag(p, DEFAULT_RESHARD_MODEL, "--reshard-model", "resharding-case shape")
    p.add_argument("--reshard-order", default="dp2-tp2", choices=list(RESHARD_ORDERS),
                   help="stage layouts of the resharding case (stage 0 - stage 1)")
    p.add_argument("--reshard-split", type=int, default=None,
                   help="layers of stage 0 in the resharding case (default: the model's "
                        "default split; balance the stages' compute, see the docstring)")
    p.add_argument("--cpu-quota", type=float, default=0.5,
                   help="cores per emulated node (cgroup cpu quota); 0 = no limit")
    p.add_argument("--cpu-period-ms", type=float, default=10.0,
                   help="cgroup cpu.cfs_period_us / 1000: the quota is enforced per period "
                        "(short: a node is never stopped for long while its peers wait)")
    p.add_argument("--no-trace", action="store_true", help="no traced run, no timelines")
    p.add_argument("--quick", action="store_true", help="1 repeat, 4 steps (2 warm-up)")
    driver.report_flags(p, "pipeline")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 4, 2
    driver.check_run_flags(p, args)
    if min(args.microbatches, args.reshard_microbatches) < 2:
        p.error("--microbatches and --reshard-microbatches must be >= pp = 2")
    args.model_shape = parse_shape(p, args.model, DEFAULT_MODEL, "--model")
    args.reshard_shape = parse_shape(p, args.reshard_model, DEFAULT_RESHARD_MODEL,
                                     "--reshard-model", even_layers=False)
    if args.reshard_split is None:
        args.reshard_split = (DEFAULT_RESHARD_SPLIT if not args.reshard_model
                              else args.reshard_shape["n_layer"] // 2)
    if not 0 < args.reshard_split < args.reshard_shape["n_layer"]:
        p.error("--reshard-split must leave at least one layer to each stage")
    if args.modes is not None:
        args.modes = list(dict.fromkeys(args.modes))
    return args


def refresh(data: dict) -> dict:
    """The saved runs summarised again (with this version's derived figures)."""
    plan_ = [{"name": n, **{k: c[k] for k in ("file", "fast_gbps", "slow_gbps", "modes")}}
             for n, c in data["summary"].items()]
    data["summary"] = summarize(data["runs"], plan_)
    return data


@contextlib.contextmanager
def quota_cluster(spec: ClusterSpec, args):
    """The cluster up, every node under its cpu quota: yields (cluster, quota)."""
    quota = NodeQuota(spec.nodes, args.cpu_quota, int(args.cpu_period_ms * 1000))
    try:
        with EmulatedCluster(spec) as cluster:
            yield cluster, quota
    finally:
        quota.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, refresh, out=args.out)
    specs = load_specs(args.clusters)
    if specs is None:
        return 2
    for spec in specs:
        if spec.nodes * spec.devices_per_node != 4:
            print(f"error: cluster {spec.name} has {spec.nodes * spec.devices_per_node} devices; "
                  f"pp 2 x tp 2 needs 4", file=sys.stderr)
            return 2
    if len({s.name for s in specs}) != len(specs):
        print("error: two cluster files have the same name", file=sys.stderr)
        return 2
    plan_ = []
    for k, (spec, f) in enumerate(zip(specs, args.clusters)):
        mat = spec.bandwidth_matrix_gbps
        modes = args.modes or (LAST_MODES if k == len(specs) - 1 else CORE_MODES)
        plan_.append({"name": spec.name, "file": f, "spec": spec, "modes": modes,
                      "fast_gbps": mat[0][1] if mat else spec.inter_node_bandwidth_gbps,
                      "slow_gbps": mat[0][2] if mat else spec.inter_node_bandwidth_gbps})
    out = driver.out_prefix(args, "pipeline")
    # named by the results (timeline-pipeline-<mode>.png by default): another run's
    # --out does not draw over this report's timelines
    tl_prefix = f"timeline-{out.name}-"
    workdir = driver.workdir(args, "pipeline").resolve()
    plan = write_plan(workdir / "plan-reshard.yaml", args.reshard_shape["n_layer"],
                      args.reshard_order, args.reshard_split)
    n_runs = args.repeats * sum(len(c["modes"]) for c in plan_)
    per_cluster = ", ".join(f"{c['name']}: {len(c['modes'])} modes" for c in plan_)
    print(f"pipeline: {n_runs} runs ({per_cluster} x {args.repeats} repeats); "
          f"model {args.model_shape}; reshard model "
          f"{args.reshard_shape} ({args.reshard_order}); cpu quota {args.cpu_quota} core/node; "
          f"work dir {workdir}", flush=True)

    def one(ctx, mode, rnd):
        cluster, quota = ctx
        case = MODES[mode][0]
        shape = args.reshard_shape if case == "reshard" else args.model_shape
        rdir = workdir / cluster.spec.name / slug(mode) / f"r{rnd}"
        return run_one(cluster, quota, mode, shape, args, rdir,
                       plan if case == "reshard" else None,
                       trace=rnd == 0 and not args.no_trace)

    def line(rec, minutes):
        extra = ""
        if rec["ok"]:
            extra = ((f", bubble {100 * rec['bubble']:.0f}%" if rec["bubble"] is not None else "")
                     + (f", others {rec['others_cpu_cores']:.2f} cores"
                        if "others_cpu_cores" in rec else ""))
        return driver.run_line(f"{rec['cluster']} r{rec['round']}", rec, minutes, 26, extra)

    try:
        runs, interrupted, elapsed = driver.run_rounds(
            [(lambda spec=c["spec"]: quota_cluster(spec, args), c["modes"]) for c in plan_],
            args.repeats, one, line)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary = summarize(runs, plan_)
    timelines = ({} if args.no_trace else
                 render_timelines(runs, out.parent, tl_prefix, multi=len(plan_) > 1))
    for r in runs:
        if r.get("traces"):
            r["trace_stats_ms"] = trace_stats(r["traces"])
    rs = args.reshard_shape
    meta = {"tag": "quick" if args.quick else "full",
            "command": driver.command("benchmarks.pipeline", argv),
            "machine": machine_info(), "clusters": args.clusters, "cpu_quota": args.cpu_quota,
            "cpu_period_ms": args.cpu_period_ms, "model": args.model_shape,
            "reshard_model": rs, "reshard_order": args.reshard_order,
            "reshard_split": args.reshard_split,
            "vocab_size": args.vocab_size, "microbatches": args.microbatches,
            "reshard_microbatches": args.reshard_microbatches, "steps": args.steps,
            "warmup": args.warmup, "repeats": args.repeats, "elapsed_min": elapsed,
            "interrupted": interrupted, "json": str(out.with_suffix(".json")),
            "png": str(out.with_suffix(".png")), "timelines": timelines,
            "reshard_plan": plan.read_text(),
            "reshard_act_mib": rs["micro_batch_size"] * rs["seq_len"] * rs["d_model"] * 4 / 2**20,
            "uniform_layout": next((r.get("layout") for r in runs
                                    if r.get("case") == "uniform" and r.get("layout")), None),
            "reshard_layout": next((r.get("layout") for r in runs
                                    if r.get("case") == "reshard" and r.get("layout")), None),
            "loadavg_end": list(os.getloadavg())}
    driver.save(out, {"meta": meta, "summary": summary, "runs": runs}, render)
    print(f"wrote {out.with_suffix('.md')}, .json, .png in {elapsed:.1f} min")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
