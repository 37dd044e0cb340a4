"""Pipeline parallelism across a slow link: schedules, engines and stage layouts.

    .venv/bin/python benchmarks/pipeline.py                 # as root: the full benchmark
    .venv/bin/python benchmarks/pipeline.py --quick         # smoke run: 1 repeat, 4 steps
    .venv/bin/python benchmarks/pipeline.py --clusters configs/cluster/hetero-4.yaml \
        --modes megatron+full+1f1b oases+fine+1f1b --repeats 5

Four emulated nodes, one process each, in two fast pairs joined by a slow link
(benchmarks/cluster.py; needs root and iproute2). ``--clusters`` (default both):
configs/cluster/hetero-4.yaml ({0,1} and {2,3} at 1 Gbit/s, 200 Mbit/s between the
pairs) and configs/cluster/hetero-4-300m.yaml (300 Mbit/s pairs, 100 Mbit/s between
them: the overlap benchmark's 300 Mbit/s, where TP communication is half of a
megatron+full step, the Oases paper's regime). The run is pp=2 x tp=2: oases puts
stage s on ranks 2s, 2s+1 (oases.layout: a stage owns consecutive ranks, TP inside
it), i.e. TP inside each pair and the pipeline across the slow link; train.py's
``pipeline:`` line is recorded to show it.

``--cpu-quota C`` (default 0.5, period ``--cpu-period-ms`` 10): every node's processes
run in a cgroup (v1 cpu controller) limited to C cores, so that each emulated device
computes at one fixed speed whatever the other nodes do (4 x 0.5 = the machine's 2
cores). Without it 4 processes share 2 cores and a rank that waits (a transfer, a
blocking all-reduce, the bubble) lends its core to the others, which no real cluster
does. 0 = no limit. A cpuacct group per node also measures each node's CPU and,
from /proc/stat, what other tenants used during each run.

Modes (each run is ``train.py`` in fresh processes unless said):

    same-layout case: pp 2 x tp 2, GPT ``--model`` (2 stages of n_layer/2 layers)
      megatron+full+1f1b        the Oases paper's baseline: blocking TP all-reduces,
                                full per-layer recompute, 1F1B
      oases+fine+1f1b           two sub-batches, TP collectives overlapped, fine recompute
      oases+fine+eager-1f1b     the same, eager-1F1B (more warm-up forwards)
      nocomm+1f1b               oases+fine+1f1b with parallel.tp_comm_noop=true: no TP
                                communication at all (timing only: the upper bound)
      megatron+full+nocomm+1f1b megatron+full+1f1b without TP communication: gives the
                                baseline's TP-communication share
      torch-1f1b                benchmarks/peers/torch_pipelining.py: the same stage
                                modules (megatron engine, full recompute) driven by
                                torch.distributed.pipelining.Schedule1F1B
    resharding case: stages of different layouts (a plan file in the work dir;
      ``--reshard-order`` dp2-tp2: stage 0 = layers [0, split) as dp 2 x tp 1 on nodes
      {0,1}, stage 1 = the rest as dp 1 x tp 2 on nodes {2,3}), so every boundary
      transfer is a cross-mesh reshard; GPT ``--reshard-model``, ``--reshard-split``
      layers on stage 0 (chosen so that the two stages take about as long, the case
      where a transfer on the critical path costs 1F1B a stall per micro-batch)
      reshard:1f1b              oases+fine, 1F1B, broadcast transfers
      reshard:eager-1f1b        oases+fine, eager-1F1B, broadcast transfers
      reshard:1f1b+send         the same with parallel.pp_transfer=send (naive; not run
      reshard:eager-1f1b+send   by default)

Default: the three megatron/oases modes that measure the TP overlap on every cluster
but the last; every mode but the ``+send`` ones on the last. ``--modes`` runs the
given modes on every cluster. Every mode runs ``--repeats`` times, modes interleaved
round-robin (so machine noise hits all alike). A run's figure is the median
``step_time_s`` (and ``pipeline_bubble``) of ``metrics.jsonl`` after ``--warmup``
steps; tokens/s = tokens per step / that time; a mode's figure the median over its
repeats. Round 0 of each train.py mode runs with parallel.trace=true (train.py traces
step 3; that step is left out of the timing) and its per-rank traces are drawn with
benchmarks/timeline.py to results/timeline-pipeline-<cluster>-<mode>.png. All modes
use untied embeddings (model.tie_embeddings=false): the torch peer cannot tie a weight
across stages.

Writes ``benchmarks/results/pipeline.{md,json,png}`` (``--quick``: pipeline-quick.*);
``--from-json`` re-writes them (and picks up ``<out>-analysis.md``, hand-written notes
on the timelines, into the .md).
"""

from __future__ import annotations

import argparse
import datetime
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster import (ClusterError, ClusterSpec, EmulatedCluster,  # noqa: E402
                     check_prerequisites, free_port)
from machine import fmt_mbit, machine_info  # noqa: E402
from overlap import error_summary  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PEER = REPO / "benchmarks" / "peers" / "torch_pipelining.py"
DEFAULT_CLUSTERS = ["configs/cluster/hetero-4.yaml", "configs/cluster/hetero-4-300m.yaml"]
CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
CGROUP_ACCT = Path("/sys/fs/cgroup/cpuacct")

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
BASELINE = {"uniform": "megatron+full+1f1b", "reshard": "reshard:1f1b"}

# (description, numerator, denominator, minimum ratio or None = information only)
TARGETS = [
    ("oases+fine+1F1B >= 1.25x megatron+full+1F1B", "oases+fine+1f1b", "megatron+full+1f1b", 1.25),
    ("eager-1F1B >= 1.1x 1F1B, resharding on the critical path", "reshard:eager-1f1b",
     "reshard:1f1b", 1.1),
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
SHAPE_KEYS = tuple(DEFAULT_MODEL)
TRACED_STEP = 3  # train.py traces step min(3, steps) (oases.runtime.trainer)


# ---------------------------------------------------------------------------
# CPU quota per node (cgroup v1 cpu controller)


class NodeQuota:
    """One cgroup per emulated node: ``cpu.cfs_quota_us`` = cores x period (cores 0: no
    limit), plus a cpuacct group for accounting (this machine mounts cpu and cpuacct as
    separate v1 hierarchies). A node's command is wrapped so that it moves itself into
    both before exec."""

    def __init__(self, nodes: int, cores: float, period_us: int = 100_000) -> None:
        self.cores = cores
        self.period_us = period_us
        name = f"oases-pipeline-{os.getpid()}"
        self.roots = [CGROUP_ROOT / name, CGROUP_ACCT / name]
        self.dirs: list[Path] = []
        self.acct: list[Path] = []
        if not (CGROUP_ROOT / "cpu.cfs_quota_us").is_file():
            if cores > 0:
                raise ClusterError(f"--cpu-quota needs the cgroup v1 cpu controller at "
                                   f"{CGROUP_ROOT}")
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


# ---------------------------------------------------------------------------
# One run


def model_overrides(model: dict, vocab: int) -> list[str]:
    d = model["d_model"]
    return ["model.name=gpt-tiny", "model.arch=gpt", f"model.d_model={d}",
            f"model.n_layer={model['n_layer']}", f"model.n_head={model['n_head']}",
            f"model.n_kv_heads={model['n_head']}", f"model.ffn_hidden={4 * d}",
            f"model.seq_len={model['seq_len']}", f"model.vocab_size={vocab}",
            "model.tie_embeddings=false"]


RESHARD_ORDERS = {  # name -> ((dp, tp) of stage 0, (dp, tp) of stage 1)
    "tp2-dp2": ((1, 2), (2, 1)),
    "dp2-tp2": ((2, 1), (1, 2)),
}


def write_plan(path: Path, n_layer: int, order: str, split: int) -> Path:
    h = split
    (d0, t0), (d1, t1) = RESHARD_ORDERS[order]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# stage 0 on nodes {{0,1}} as dp {d0} x tp {t0}, stage 1 on nodes {{2,3}} "
                    f"as dp {d1} x tp {t1}\n"
                    "stages:\n"
                    f"  - {{layers: [0, {h}], dp: {d0}, tp: {t0}}}\n"
                    f"  - {{layers: [{h}, {n_layer}], dp: {d1}, tp: {t1}}}\n")
    return path


def microbatches(mode: str, args) -> int:
    return args.reshard_microbatches if MODES[mode][0] == "reshard" else args.microbatches


def train_args(mode: str, model: dict, args, out_dir: Path, plan: Optional[Path],
               trace: bool) -> list[str]:
    return [
        *model_overrides(model, args.vocab_size),
        "parallel.tp=2", "parallel.pp=2", "parallel.device=cpu", "parallel.backend=gloo",
        f"parallel.timeout_s={args.run_timeout}",
        *([f"parallel.plan={plan}"] if plan is not None else []),
        *MODES[mode][1],
        *(["parallel.trace=true"] if trace else []),
        f"train.steps={args.steps}", f"train.micro_batch_size={model['micro_batch_size']}",
        f"train.grad_accum={microbatches(mode, args)}", "train.log_interval=1",
        "wandb.mode=disabled", "data.kind=synthetic", "checkpoint.save_final=false",
        "checkpoint.interval=0", "eval.interval=0", f"out_dir={out_dir}",
    ]


def peer_args(model: dict, args, out_json: Path) -> list[str]:
    return ["--pp", "2", "--tp", "2", "--d-model", str(model["d_model"]),
            "--n-layer", str(model["n_layer"]), "--n-head", str(model["n_head"]),
            "--seq-len", str(model["seq_len"]), "--micro-batch-size", str(model["micro_batch_size"]),
            "--microbatches", str(microbatches("torch-1f1b", args)), "--vocab", str(args.vocab_size),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--timeout-s", str(min(args.run_timeout, 120)), "--out-json", str(out_json)]


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
        script, script_args = str(PEER), peer_args(model, args, out_json)
    else:
        script, script_args = "train.py", train_args(mode, model, args, out_dir, plan, trace)
    cmd = lambda i: quota.wrap(i, cluster.torchrun_command(i, script_args, script, port))  # noqa: E731
    rec["command_node0"] = shlex.join(cluster.torchrun_command(0, script_args, script, port))
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
    failed = [r for r in results if not r.ok]
    if failed:
        if any(r.timed_out for r in failed):
            rec["error"] = f"timed out after {args.run_timeout:.0f} s"
            # what a hung peer printed last (e.g. the torch peer on gloo)
            tails = [ln for r in results for ln in r.output.splitlines()[-3:] if ln.strip()]
            rec["error_tail"] = tails[-6:]
        else:
            rec["error"] = error_summary([r.output for r in failed if r.returncode]
                                         + [r.output for r in results])
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
            recs = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines()
                    if ln.strip()]
            # the traced step (step 3) of a traced run is left out of the timing
            timed = [r for r in recs if "step_time_s" in r and r["step"] > args.warmup
                     and not (trace and r["step"] == TRACED_STEP)]
            times = [r["step_time_s"] for r in timed]
            bubbles = [r["pipeline_bubble"] for r in timed if "pipeline_bubble" in r]
            tokens = model["micro_batch_size"] * microbatches(mode, args) * model["seq_len"]
            rec["losses"] = [r.get("loss") for r in recs if "loss" in r]
    except (OSError, ValueError, KeyError, TypeError) as e:
        rec["error"] = f"could not read the step times: {type(e).__name__}: {e}"
        return rec
    if not times:
        rec["error"] = "no timed steps (is --steps larger than --warmup?)"
        return rec
    rec.update(ok=True, step_times_s=times, step_time_s=statistics.median(times),
               tokens_per_step=tokens,
               bubble=statistics.median(bubbles) if bubbles else None)
    if trace and not peer:
        traces = sorted(out_dir.glob("trace_rank*.json"))
        rec["traces"] = [str(p) for p in traces]
    return rec


# ---------------------------------------------------------------------------
# Summary


def summarize_cluster(runs: list[dict], modes: list[str]) -> dict:
    per = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        ok = [r for r in rs if r["ok"]]
        if not ok:
            errs = [r["error"] for r in rs if r.get("error")]
            per[mode] = {"ok": False, "case": MODES[mode][0], "repeats": 0,
                         "error": errs[0] if errs else "not run"}
            continue
        t = statistics.median(r["step_time_s"] for r in ok)
        bub = [r["bubble"] for r in ok if r.get("bubble") is not None]
        per[mode] = {"ok": True, "case": MODES[mode][0], "step_time_s": t,
                     "step_time_s_repeats": [r["step_time_s"] for r in ok],
                     "tokens_per_step": ok[0]["tokens_per_step"],
                     "tokens_per_s": ok[0]["tokens_per_step"] / t,
                     "bubble": statistics.median(bub) if bub else None,
                     "bubble_repeats": bub, "repeats": len(ok),
                     "failed_repeats": len(rs) - len(ok),
                     "layout": next((r.get("layout") for r in ok if r.get("layout")), None)}
    for mode, m in per.items():
        if not m["ok"]:
            continue
        base = per.get(BASELINE[m["case"]], {})
        m["ratio_vs_baseline"] = (m["tokens_per_s"] / base["tokens_per_s"]
                                  if base.get("ok") else None)
    mf, mfn = per.get("megatron+full+1f1b", {}), per.get("megatron+full+nocomm+1f1b", {})
    comm_share = ((mf["step_time_s"] - mfn["step_time_s"]) / mf["step_time_s"]
                  if mf.get("ok") and mfn.get("ok") else None)
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
    targets = []
    for desc, num, den, need in TARGETS:
        a, b = per.get(num), per.get(den)
        if a is None or b is None:
            continue
        if a["ok"] and b["ok"]:
            ratio = a["tokens_per_s"] / b["tokens_per_s"]
            status = ("PASS" if ratio >= need else "FAIL") if need else "info"
            # the same ratio within each round (the two runs were minutes apart)
            by_round = {}
            for r in runs:
                if r["ok"] and r["mode"] in (num, den):
                    by_round.setdefault(r["round"], {})[r["mode"]] = r["step_time_s"]
            rounds = [v[den] / v[num] for _, v in sorted(by_round.items())
                      if num in v and den in v]
            targets.append({"target": desc, "ratio": ratio, "need": need, "status": status,
                            "per_round": rounds,
                            "figures": f"{a['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f} tok/s"})
        else:
            missing = [m for m, x in ((num, a), (den, b)) if not x["ok"]]
            targets.append({"target": desc, "ratio": None, "need": need, "status": "N/A",
                            "figures": f"{', '.join(missing)} failed"})
    return {"modes": per, "megatron_full_comm_share": comm_share, "targets": targets}


def summarize(runs: list[dict], plan: list[dict]) -> dict:
    return {c["name"]: {**{k: c[k] for k in ("file", "fast_gbps", "slow_gbps", "modes")},
                        **summarize_cluster([r for r in runs if r["cluster"] == c["name"]],
                                            c["modes"])}
            for c in plan}


def _slug(mode: str) -> str:
    return mode.replace(":", "-").replace("+", "-")


def write_markdown(path: Path, meta: dict, summary: dict, runs: list[dict]) -> None:
    m, rm, mi = meta["model"], meta["reshard_model"], meta["machine"]
    q = meta["cpu_quota"]
    (d0, t0), (d1, t1) = RESHARD_ORDERS[meta["reshard_order"]]
    L = [f"# Pipeline parallelism across a slow link ({meta['tag']})", "",
         f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['mem_gib']} GiB, Linux {mi['kernel']}, "
         f"Python {mi['python']}, torch {mi['torch']}, oases {mi['git']}, {mi['date']}.", "",
         f"Command: `{meta['command']}` ({meta['elapsed_min']:.1f} min)"
         + (" -- **interrupted**: partial results." if meta.get("interrupted") else "."), "",
         "## Set-up", "",
         "4 emulated nodes (network namespaces, benchmarks/cluster.py) x 1 CPU process, two "
         "pairs {0,1} and {2,3} with a fast link inside a pair and a slow one between the pairs "
         "(tc htb per destination), gloo, OMP_NUM_THREADS=1"
         + (f"; every node limited to **{q:g} core** (cgroup v1 cpu quota, period "
            f"{meta['cpu_period_ms']:g} ms), so each emulated device computes at one fixed "
            f"speed and 4 x {q:g} = {4 * q:g} cores = this machine (without it, a rank that "
            f"waits lends its core to the other ranks, which no real cluster does)"
            if q > 0 else "; no CPU limit (4 processes share the cores)") + ".", "",
         f"Resharding case: stage 0 = layers [0, {meta['reshard_split']}) as dp {d0} x tp {t0}, "
         f"stage 1 = the rest as dp {d1} x tp {t1} (a plan file with `stages:`), so every "
         f"activation and gradient crossing the slow link is a cross-mesh reshard; GPT d_model "
         f"{rm['d_model']}, {rm['n_layer']} layers, {rm['n_head']} heads, seq {rm['seq_len']}, "
         f"micro-batch {rm['micro_batch_size']} sequences ({meta['reshard_act_mib']:.2f} MiB of "
         f"activation), {meta['reshard_microbatches']} micro-batches. The layer split balances "
         f"the stages (stage 1 runs at tp 2, its TP all-reduces cross the pair link, and has "
         f"the head), so that a transfer delays the pipeline instead of hiding behind a slower "
         f"stage; the model is narrow so that a transfer is a sizeable part of a stage's "
         f"compute (a wider or longer model grows the compute faster than the activation).", "",
         f"Each figure: median over {meta['repeats']} repeats (fresh processes, modes "
         f"interleaved round-robin) of the median step time of steps {meta['warmup'] + 1}.."
         f"{meta['steps']} (round 0 without the traced step {TRACED_STEP}); tokens/s = tokens "
         f"per step / that time. Bubble = "
         f"`pipeline_bubble` of metrics.jsonl: mean over ranks of the fraction of the step "
         f"spent outside F/B compute (fill/drain, waits for transfers, gradient clipping), "
         f"median over the same steps and repeats. Absolute times on a shared 2-core machine "
         f"are noisy; compare ratios within a table.", ""]
    ran = {MODES[x][0] for c in summary.values() for x in c["modes"]}
    layout_txt = [
        "pp=2 x tp=2: oases puts stage s on ranks 2s, 2s+1 (oases.layout: a stage owns "
        "consecutive ranks, TP inside it), i.e. stage 0 = nodes {0,1}, stage 1 = nodes {2,3}: "
        "TP inside each fast pair, the pipeline across the slow link. train.py printed: "
        f"`{meta.get('uniform_layout') or meta.get('reshard_layout') or 'n/a'}`.", ""]
    same_txt = [
        f"Same-layout case: GPT d_model {m['d_model']}, {m['n_layer']} layers (4 per stage), "
        f"{m['n_head']} heads, ffn {4 * m['d_model']}, vocab {meta['vocab_size']}, seq "
        f"{m['seq_len']}, micro-batch {m['micro_batch_size']} sequences, "
        f"{meta['microbatches']} micro-batches per step (train.grad_accum), fp32, untied "
        f"embeddings (the torch peer cannot tie a weight across stages; all modes use the "
        f"same model).", ""]
    # the set-up paragraphs of the cases that ran, before the "Each figure" paragraph
    k = next(i for i, ln in enumerate(L) if ln.startswith("Each figure"))
    reshard_txt = L[k - 2:k]
    del L[k - 2:k]
    L[k - 2:k - 2] = (layout_txt + (same_txt if "uniform" in ran else [])
                      + (reshard_txt if "reshard" in ran else []))

    def table(name: str, s: dict, case: str) -> None:
        per = s["modes"]
        rows = [x for x in s["modes"] if MODES[x][0] == case]
        if not rows:
            return
        title = ("same layouts, pp 2 x tp 2" if case == "uniform"
                 else f"stages of different layouts: dp {d0} x tp {t0} -> dp {d1} x tp {t1}")
        L.extend([f"### {name}: {title}", "",
                  f"| mode | step (s) | repeats (s) | tokens/s | vs {BASELINE[case]} | bubble |",
                  "|---|---|---|---|---|---|"])
        for mode in rows:
            r = per[mode]
            if not r["ok"]:
                L.append(f"| {mode} | failed | | | | {r['error'].replace('|', '/')} |")
                continue
            reps = ", ".join(f"{t:.3f}" for t in r["step_time_s_repeats"])
            ratio = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] else "n/a"
            bub = f"{100 * r['bubble']:.0f}%" if r["bubble"] is not None else "n/a"
            L.append(f"| {mode} | {r['step_time_s']:.3f} | {reps} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio} | {bub} |")
        L.append("")
        tp_ = per.get("torch-1f1b", {})
        if case == "uniform" and "max_loss_diff_vs_megatron" in tp_:
            L.append(f"The torch peer's losses match megatron+full+1f1b's over "
                     f"{tp_['loss_steps_compared']} steps within "
                     f"{tp_['max_loss_diff_vs_megatron']:.1e} (same model, data and optimizer; "
                     f"only the pipeline driver differs).")
            L.append("")
        share = s.get("megatron_full_comm_share")
        if case == "uniform" and share is not None:
            L.extend([f"TP-communication share of megatron+full+1f1b's step (vs "
                  f"megatron+full+nocomm+1f1b): **{100 * share:.0f}%**; perfect overlap at no "
                  f"other cost could give at most {1 / (1 - share):.2f}x.", ""])

    for name, s in summary.items():
        L += [f"## {name}: {fmt_mbit(s['fast_gbps'])} inside a pair, {fmt_mbit(s['slow_gbps'])} "
              f"between the pairs (`{s['file']}`)", ""]
        table(name, s, "uniform")
        table(name, s, "reshard")
        if s["targets"]:
            L += [f"### {name}: targets", "",
                  "| target | measured (medians) | each round | result |", "|---|---|---|---|"]
            for t in s["targets"]:
                got = f"{t['ratio']:.3f}x ({t['figures']})" if t["ratio"] else t["figures"]
                rounds = ", ".join(f"{v:.2f}x" for v in t.get("per_round") or [])
                L.append(f"| {t['target']} | {got} | {rounds} | **{t['status']}** |")
            L.append("")
    tl = meta.get("timelines") or {}
    if tl:
        L += ["## Timelines", "",
              "One traced step (step 3 of round 0; left out of the timing) per mode, drawn by "
              "benchmarks/timeline.py: per rank a pipeline row (F/B actions; red = waiting for a "
              "transfer, purple = waiting for the step's sends), the engine's compute row (blue "
              "/ orange: the oases engine's two sub-batches) and its collectives (green).", ""]
        for key, png in tl.items():
            L.append(f"- {key}: `{Path(png).name}`")
        L.append("")
    if meta.get("analysis"):
        L += ["## What the timelines show", "", *meta["analysis"], ""]
    loads = [r["loadavg_1min_before"] for r in runs if "loadavg_1min_before" in r]
    others = [r["others_cpu_cores"] for r in runs if "others_cpu_cores" in r]
    if loads:
        L += [f"Machine load: 1-min load average before each run (it includes the previous "
              f"run's own 4 processes) min {min(loads):.1f}, median "
              f"{statistics.median(loads):.1f}, max {max(loads):.1f}"
              + (f"; CPU used by other tenants during a run (machine busy time minus this "
                 f"benchmark's cgroups): median {statistics.median(others):.2f} cores, max "
                 f"{max(others):.2f} of {mi['cores']}" if others else "") + ".", ""]
    L += ["Raw numbers (every run's step times, bubbles, losses, per-node CPU, errors, node-0 "
          f"commands, per-rank trace totals): `{Path(meta['json']).name}`; chart: "
          f"`{Path(meta['png']).name}`.", ""]
    path.write_text("\n".join(L))


def write_plot(path: Path, summary: dict) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart"
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.5))
    labels, rel, tps, bub, colors = [], [], [], [], []
    palette = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
    for ci, (name, s) in enumerate(summary.items()):
        for mode, r in s["modes"].items():
            labels.append(f"{mode}\n{name}")
            tps.append(r.get("tokens_per_s", 0.0) if r["ok"] else 0.0)
            rel.append((r.get("ratio_vs_baseline") or 0.0) if r["ok"] else 0.0)
            bub.append(100 * (r.get("bubble") or 0.0) if r["ok"] else 0.0)
            colors.append(palette[ci % len(palette)] if MODES[mode][0] == "uniform"
                          else "tab:orange")
    x = list(range(len(labels)))
    axes[0].bar(x, rel, color=colors)
    for xi, (v, t) in enumerate(zip(rel, tps)):
        if v:
            axes[0].text(xi, v + 0.02, f"{t:,.0f}", ha="center", va="bottom", fontsize=6)
    axes[0].axhline(1.0, color="black", linewidth=0.8)
    axes[0].axhline(1.25, color="tab:blue", linestyle="--", linewidth=0.8)
    axes[0].axhline(1.1, color="tab:orange", linestyle="--", linewidth=0.8)
    axes[1].bar(x, bub, color=colors)
    for ax, title, yl in ((axes[0], "throughput vs the case's 1F1B baseline on the same cluster "
                                    "(labels: tokens/s; dashed: targets 1.25x, 1.1x)",
                           "x megatron+full+1f1b  /  x reshard:1f1b"),
                          (axes[1], "pipeline bubble (fraction outside F/B)", "% of step")):
        ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(yl)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("pp=2 x tp=2 on 4 emulated nodes (one colour per cluster; orange: resharding "
                 "stages, another model shape)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def render_timelines(runs: list[dict], out_dir: Path, prefix: str, multi: bool) -> dict:
    import timeline

    out = {}
    for r in runs:
        key = f"{r['cluster']} {r['mode']}" if multi else r["mode"]
        if not r.get("traces") or key in out:
            continue
        png = out_dir / (f"{prefix}{r['cluster']}-{_slug(r['mode'])}.png" if multi
                         else f"{prefix}{_slug(r['mode'])}.png")
        try:
            timeline.render([Path(p) for p in r["traces"]], png,
                            f"{r['mode']} on {r['cluster']}: one step (step 3); ranks 0-1 = "
                            f"stage 0, ranks 2-3 = stage 1")
            out[key] = str(png)
        except Exception as e:  # a chart must not lose the numbers
            print(f"warning: timeline of {key}: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def trace_stats(paths: list[str]) -> dict:
    """Per rank: ms in F, B, waits for transfers, wait sends, and the step span."""
    out = {}
    for p in paths:
        ev = json.loads(Path(p).read_text())["traceEvents"]
        pl = [e for e in ev if e.get("tid") == "pipeline"]
        if not pl:
            continue
        r = int(re.search(r"rank(\d+)", p).group(1))
        agg: dict = {"F": 0.0, "B": 0.0, "wait_F": 0.0, "wait_B": 0.0, "wait_sends": 0.0}
        for e in pl:
            n = e["name"]
            k = ("wait_sends" if n.startswith("wait sends") else
                 f"wait_{n.split()[1][0]}" if n.startswith("wait") else n[0])
            agg[k] = agg.get(k, 0.0) + e["dur"] / 1e3
        agg["span"] = max(e["ts"] + e["dur"] for e in pl) / 1e3
        comm = [e for e in ev if e.get("cat") == "comm"]
        agg["comm_ms"] = sum(e["dur"] for e in comm) / 1e3
        out[r] = {k: round(v, 1) for k, v in agg.items()}
    return out


# ---------------------------------------------------------------------------


def parse_shape(p, kvs: list[str], default: dict, flag: str, even_layers: bool = True) -> dict:
    model = dict(default)
    for kv in kvs:
        k, _, v = kv.partition("=")
        k = k.replace("-", "_")
        if k == "mbs":
            k = "micro_batch_size"
        if k not in model or not v.isdigit():
            p.error(f"{flag} {kv}: expected one of {', '.join(model)} = a positive integer")
        model[k] = int(v)
    if model["d_model"] % model["n_head"] or model["n_head"] % 2:
        p.error(f"{flag}: n_head must divide d_model and be even (tp 2)")
    if model["n_layer"] < 2 or (even_layers and model["n_layer"] % 2):
        p.error(f"{flag}: n_layer must be even (2 stages of the same depth)")
    if model["micro_batch_size"] % 4:
        p.error(f"{flag}: micro_batch_size must be a multiple of 4 (2 sub-batches, and 2 dp "
                f"replicas in the reshard case)")
    return model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clusters", nargs="+", default=DEFAULT_CLUSTERS,
                   help="4-node cluster files; the last one also runs the torch peer and "
                        "the resharding case")
    p.add_argument("--modes", nargs="+", default=None, choices=ALL_MODES, metavar="MODE",
                   help=f"subset of: {' '.join(ALL_MODES)}, run on every cluster (default: "
                        f"{' '.join(CORE_MODES)} on every cluster but the last, and "
                        f"{' '.join(LAST_MODES)} on the last)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4,
                   help="same-layout case: train.grad_accum (>= pp)")
    p.add_argument("--reshard-microbatches", type=int, default=8)
    p.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                   help="same-layout shape: d_model n_layer n_head seq_len micro_batch_size "
                        f"(default {' '.join(f'{k}={v}' for k, v in DEFAULT_MODEL.items())})")
    p.add_argument("--reshard-model", nargs="*", default=[], metavar="KEY=VALUE",
                   help="resharding-case shape (default "
                        f"{' '.join(f'{k}={v}' for k, v in DEFAULT_RESHARD_MODEL.items())})")
    p.add_argument("--reshard-order", default="dp2-tp2", choices=list(RESHARD_ORDERS),
                   help="stage layouts of the resharding case (stage 0 - stage 1)")
    p.add_argument("--reshard-split", type=int, default=None,
                   help="layers of stage 0 in the resharding case (default: the model's "
                        "default split; balance the stages' compute, see the docstring)")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--cpu-quota", type=float, default=0.5,
                   help="cores per emulated node (cgroup cpu quota); 0 = no limit")
    p.add_argument("--cpu-period-ms", type=float, default=10.0,
                   help="cgroup cpu.cfs_period_us / 1000: the quota is enforced per period "
                        "(short: a node is never stopped for long while its peers wait)")
    p.add_argument("--no-trace", action="store_true", help="no traced run, no timelines")
    p.add_argument("--run-timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="1 repeat, 4 steps (2 warm-up)")
    p.add_argument("--out", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--from-json", default=None, metavar="JSON",
                   help="re-write the .md/.png of a saved run (no runs, no root)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 4, 2
    if args.warmup >= args.steps:
        p.error("--warmup must be smaller than --steps")
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


def rerender(path: Path) -> int:
    data = json.loads(path.read_text())
    meta, summary, runs = data["meta"], data["summary"], data["runs"]
    plan_ = [{"name": n, **{k: c[k] for k in ("file", "fast_gbps", "slow_gbps", "modes")}}
             for n, c in summary.items()]
    summary = summarize(runs, plan_)  # with this version's derived figures
    data["summary"] = summary
    path.write_text(json.dumps(data, indent=1))
    af = REPO / meta.get("analysis_file", "")
    if meta.get("analysis_file") and af.is_file():
        meta["analysis"] = af.read_text().splitlines()
    write_markdown(path.with_suffix(".md"), meta, summary, runs)
    write_plot(path.with_suffix(".png"), summary)
    print(f"re-wrote {path.with_suffix('.md')} and .png from {path}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json:
        return rerender(Path(args.from_json))
    try:
        check_prerequisites()
        specs = [ClusterSpec.load(c) for c in args.clusters]
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
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
    out = Path(args.out) if args.out else RESULTS / ("pipeline-quick" if args.quick else "pipeline")
    tl_prefix = "timeline-pipeline-quick-" if args.quick else "timeline-pipeline-"
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    workdir = Path(args.workdir) if args.workdir else REPO / "runs" / "bench-pipeline" / stamp
    workdir = workdir.resolve()
    plan = write_plan(workdir / "plan-reshard.yaml", args.reshard_shape["n_layer"],
                      args.reshard_order, args.reshard_split)
    exe = sys.executable
    if exe.startswith(str(REPO)):
        exe = os.path.relpath(exe, REPO)
    command = " ".join(shlex.quote(a) for a in
                       [exe, os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
    t_start = time.monotonic()
    runs: list[dict] = []
    n_runs = args.repeats * sum(len(c["modes"]) for c in plan_)
    per_cluster = ", ".join(f"{c['name']}: {len(c['modes'])} modes" for c in plan_)
    print(f"pipeline: {n_runs} runs ({per_cluster} x {args.repeats} repeats); "
          f"model {args.model_shape}; reshard model "
          f"{args.reshard_shape} ({args.reshard_order}); cpu quota {args.cpu_quota} core/node; "
          f"work dir {workdir}", flush=True)
    interrupted = False
    quota = None
    try:
        for c in plan_:
            spec = c["spec"]
            quota = NodeQuota(spec.nodes, args.cpu_quota, int(args.cpu_period_ms * 1000))
            dead: set[str] = set()
            try:
                with EmulatedCluster(spec) as cluster:
                    for rnd in range(args.repeats):
                        for mode in c["modes"]:
                            if mode in dead:
                                continue
                            case = MODES[mode][0]
                            shape = args.model_shape if case == "uniform" else args.reshard_shape
                            rdir = workdir / spec.name / _slug(mode) / f"r{rnd}"
                            rec = run_one(cluster, quota, mode, shape, args, rdir,
                                          plan if case == "reshard" else None,
                                          trace=rnd == 0 and not args.no_trace)
                            rec["round"] = rnd
                            runs.append(rec)
                            el = (time.monotonic() - t_start) / 60
                            if rec["ok"]:
                                bub = (f", bubble {100 * rec['bubble']:.0f}%"
                                       if rec["bubble"] is not None else "")
                                oth = (f", others {rec['others_cpu_cores']:.2f} cores"
                                       if "others_cpu_cores" in rec else "")
                                print(f"[{el:5.1f} min] {spec.name} r{rnd} {mode:26s} "
                                      f"{rec['step_time_s']:.3f} s/step ({rec['tokens_per_step'] / rec['step_time_s']:,.0f} "
                                      f"tok/s{bub}, run {rec['wall_s']:.0f} s{oth})", flush=True)
                            else:
                                dead.add(mode)
                                print(f"[{el:5.1f} min] {spec.name} r{rnd} {mode:26s} FAILED: "
                                      f"{rec['error']}", flush=True)
            finally:
                quota.close()
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: writing the results so far", file=sys.stderr)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = (time.monotonic() - t_start) / 60
    summary = summarize(runs, plan_)
    timelines = ({} if args.no_trace else
                 render_timelines(runs, out.parent, tl_prefix, multi=len(plan_) > 1))
    for r in runs:
        if r.get("traces"):
            r["trace_stats_ms"] = trace_stats(r["traces"])
    rs = args.reshard_shape
    meta = {"tag": "quick" if args.quick else "full", "command": command,
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
            "analysis_file": os.path.relpath(out.parent.resolve() / (out.name + "-analysis.md"),
                                             REPO),
            "loadavg_end": list(os.getloadavg())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "summary": summary, "runs": runs}, indent=1))
    write_markdown(out.with_suffix(".md"), meta, summary, runs)
    warn = write_plot(out.with_suffix(".png"), summary)
    if warn:
        print(f"warning: {warn}", file=sys.stderr)
    print(out.with_suffix(".md").read_text())
    print(f"wrote {out.with_suffix('.md')}, .json, .png in {elapsed:.1f} min")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
