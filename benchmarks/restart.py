"""Multi-node restarts: two torchrun agents ("nodes"), one node's worker killed mid-run.

    .venv/bin/python -m benchmarks.restart                     # ~1-2 min on 2 cores, no root
    .venv/bin/python -m benchmarks.restart --victim 0 --steps 80

Two torchrun agents on 127.0.0.1 act as two nodes of one job, the way a multi-node
job is launched (``--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:PORT --max-restarts=2``, with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which a multi-node restart needs: each
worker group then builds its own store instead of reusing the agents' one, whose
keys outlive a restart). They train ``configs/gpt-tiny.yaml`` on synthetic data at
dp=2 (one rank per node) with a checkpoint every few steps and ``resume=auto``:

1. a reference run: the same two agents, nothing killed;
2. the restart run: once a checkpoint exists and training has gone past it, the
   worker process of one node (``--victim``; not its agent) gets SIGKILL. Its agent
   restarts its worker, the other agent sees the new rendezvous round (or its own
   worker's failed collective) and restarts its worker too; the new group resumes
   from the latest complete checkpoint.

Then it checks that

* both agents exit with status 0, and a worker did resume (``resumed from``);
* ``metrics.jsonl`` holds every step 1..train.steps exactly once, in order;
* ``checkpoints/latest`` names the final step, and that checkpoint consolidates
  (``python -m oases.consolidate``) into finite tensors;
* the loss after the restart equals the reference run's at every step after the
  checkpoint it resumed from (exact resume: bit-equal on CPU).

It prints PASS or FAIL per check and writes ``benchmarks/results/restart.md`` (and
``.json``, and ``.png`` with both loss curves when matplotlib is there). Exit status
0 when every check passes, 1 otherwise. Not a test of the suite: it takes a minute
or two and binds local ports.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


# ---------------------------------------------------------------------------
# processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_env(own_store: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in _DIST_VARS and k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    if own_store:
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def train_args(out: Path, a: argparse.Namespace) -> list[str]:
    return ["--config", "configs/gpt-tiny.yaml", "data.kind=synthetic", "data.val_path=",
            f"out_dir={out}", "parallel.tp=1", f"train.steps={a.steps}",
            f"checkpoint.interval={a.interval}", "checkpoint.keep=2", "resume=auto",
            "train.log_interval=1", "eval.interval=0", "wandb.mode=disabled",
            f"parallel.timeout_s={a.timeout_s:g}"]


def start_nodes(out: Path, a: argparse.Namespace, tag: str) -> list[tuple[subprocess.Popen, Path]]:
    """Two agents, node 0 hosting the rendezvous store; each logs to its own file."""
    port = free_port()
    nodes = []
    for i in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=restart-{os.getpid()}-{tag}", f"--rdzv-conf=is_host={int(i == 0)}",
               "--local-addr=127.0.0.1", f"--max-restarts={a.max_restarts}",
               "--monitor-interval=0.5", "train.py", *train_args(out, a)]
        log = out.parent / f"{out.name}-node{i}.log"
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=REPO, env=agent_env(not a.shared_store), stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        nodes.append((proc, log))
    return nodes


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (field 4 of /proc/<p>/stat is the parent pid)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def worker_of(agent_pid: int) -> int | None:
    """The live train.py worker started by this agent (one per node here)."""
    for pid in children(agent_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train.py" in cmdline:
            return pid
    return None


def stop_all(nodes) -> None:
    for proc, _ in nodes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_nodes(nodes, timeout: float) -> list[int | None]:
    t0 = time.monotonic()
    for proc, _ in nodes:
        try:
            proc.wait(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            break
    codes = [proc.poll() for proc, _ in nodes]
    stop_all(nodes)
    return codes


def metrics(out: Path) -> list[dict]:
    p = out / "metrics.jsonl"
    recs = []
    if p.exists():
        for ln in p.read_text().splitlines():
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:  # a line being written
                continue
            if "loss" in rec:
                recs.append(rec)
    return recs


# ---------------------------------------------------------------------------
# the two runs


def reference_run(work: Path, a: argparse.Namespace) -> dict:
    out = work / "reference"
    t0 = time.monotonic()
    nodes = start_nodes(out, a, "ref")
    codes = wait_nodes(nodes, a.run_timeout_s)
    return {"codes": codes, "wall_s": time.monotonic() - t0,
            "loss": {r["step"]: r["loss"] for r in metrics(out)}}


def restart_run(work: Path, a: argparse.Namespace) -> dict:
    out = work / "restart"
    t0 = time.monotonic()
    nodes = start_nodes(out, a, "kill")
    res: dict = {"killed": None}
    try:
        deadline = t0 + a.run_timeout_s
        kill_at = a.kill_after or a.interval + a.interval // 2
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p, _ in nodes):
                break
            done = max((r["step"] for r in metrics(out)), default=0)
            latest = out / "checkpoints" / "latest"
            if done >= kill_at and latest.exists():
                victim = worker_of(nodes[a.victim][0].pid)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    res["killed"] = {"pid": victim, "node": a.victim, "after_step": done,
                                     "latest": latest.read_text().strip(),
                                     "at_s": time.monotonic() - t0}
                    break
            time.sleep(0.05)
        res["codes"] = wait_nodes(nodes, max(1.0, deadline - time.monotonic()))
    finally:
        stop_all(nodes)
    res["wall_s"] = time.monotonic() - t0
    res["logs"] = [log.read_text(errors="replace") for _, log in nodes]
    res["out"] = out
    res["records"] = metrics(out)
    return res


def consolidate(out: Path, dest: Path) -> tuple[bool, str]:
    """``python -m oases.consolidate`` on the run: (it worked and every tensor is finite,
    what it said or what it wrote)."""
    p = subprocess.run([sys.executable, "-m", "oases.consolidate", str(out), "--out", str(dest)],
                       cwd=REPO, env=agent_env(), capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        text = (p.stdout + p.stderr).strip().splitlines()
        return False, f"status {p.returncode}: {text[-1] if text else ''}"
    import torch

    state = torch.load(dest, weights_only=True)
    finite = bool(state) and all(bool(torch.isfinite(t).all()) for t in state.values())
    params = sum(t.numel() for t in state.values())
    return finite, (f"{len(state)} tensors, {params / 1e6:.2f}M parameters, "
                    f"{'all finite' if finite else 'NOT all finite'}")


# ---------------------------------------------------------------------------
# checks and report


def check(ref: dict, run: dict, a: argparse.Namespace, work: Path) -> tuple[list, dict]:
    checks: list[tuple[str, bool, str]] = []
    logs = "\n".join(run["logs"])
    killed = run["killed"]
    checks.append(("a worker was killed mid-run", killed is not None and
                   killed["after_step"] < a.steps,
                   f"node {killed['node']}'s worker (pid {killed['pid']}) after step "
                   f"{killed['after_step']}, latest {killed['latest']}" if killed else "no kill"))
    checks.append(("reference run: both agents exit 0", ref["codes"] == [0, 0],
                   f"exit statuses {ref['codes']}"))
    checks.append(("restart run: both agents exit 0", run["codes"] == [0, 0],
                   f"exit statuses {run['codes']}"))
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", logs)]
    checks.append(("the restarted group resumed from a checkpoint", bool(resumed),
                   f"resumed at step {resumed[0]}" if resumed else "no 'resumed from' line"))
    steps = [r["step"] for r in run["records"]]
    checks.append(("metrics.jsonl: steps 1..N once each, in order",
                   steps == list(range(1, a.steps + 1)),
                   f"{len(steps)} records, last {steps[-1] if steps else None}"))
    latest = run["out"] / "checkpoints" / "latest"
    name = latest.read_text().strip() if latest.exists() else None
    checks.append(("checkpoints/latest is the final step", name == f"step_{a.steps:06d}",
                   f"latest = {name}"))
    good, text = consolidate(run["out"], work / "model.pt")
    checks.append(("the final checkpoint consolidates (finite tensors)", good, text))
    after = resumed[0] if resumed else 0
    loss = {r["step"]: r["loss"] for r in run["records"]}
    tail = [s for s in range(after + 1, a.steps + 1)]
    diffs = [abs(loss[s] - ref["loss"][s]) for s in tail if s in loss and s in ref["loss"]]
    exact = bool(tail) and len(diffs) == len(tail) and max(diffs) == 0.0
    checks.append((f"loss after the restart = the uninterrupted run's (steps {after + 1}.."
                   f"{a.steps})", exact,
                   f"largest difference {max(diffs):.3g} over {len(diffs)} of {len(tail)} steps"
                   if diffs else "no steps to compare"))
    detail = {"resumed_at": after, "kill": killed, "ref_wall_s": ref["wall_s"],
              "run_wall_s": run["wall_s"], "loss_restart": loss, "loss_reference": ref["loss"],
              "max_abs_diff_after_restart": max(diffs) if diffs else None}
    return checks, detail


def machine() -> str:
    from benchmarks.lib.machine import machine_info

    m = machine_info()
    return f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, torch {m['torch']}"


def write_report(checks, detail, a, cmd: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    ok = all(c[1] for c in checks)
    k = detail["kill"]
    lines = ["# Multi-node restart (two torchrun agents, one worker killed)", "",
             f"Machine: {machine()}.  ", f"Command: `{cmd}`", "",
             f"Two torchrun agents on 127.0.0.1 (`--nnodes=2 --nproc-per-node=1 "
             f"--rdzv-backend=c10d --max-restarts={a.max_restarts}`, "
             f"`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`) train gpt-tiny on synthetic data at dp=2, "
             f"{a.steps} steps, a checkpoint every {a.interval}, `resume=auto`. "
             + (f"Node {k['node']}'s worker got SIGKILL after step {k['after_step']} "
                f"({k['at_s']:.1f} s into the run; `latest` was {k['latest']}); "
                f"the new group resumed at step {detail['resumed_at']}." if k else
                "No worker was killed.") , "",
             f"**{'PASS' if ok else 'FAIL'}**", "", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {name} | {'PASS' if good else 'FAIL'} | {info} |" for name, good, info in checks]
    lr, lf = detail["loss_restart"], detail["loss_reference"]
    at = detail["resumed_at"]
    shown = [s for s in range(max(1, at - 2), min(a.steps, at + 6) + 1)]
    lines += ["", "Loss around the restart (the restart run's steps after "
              f"{at} were computed again by the new group):", "",
              "| step | uninterrupted | restarted | equal |", "|---|---|---|---|"]
    for s in shown:
        x, y = lf.get(s), lr.get(s)
        lines.append(f"| {s} | {x if x is None else f'{x:.6f}'} | "
                     f"{y if y is None else f'{y:.6f}'} | {'yes' if x == y else 'no'} |")
    lines += ["", f"Wall time: uninterrupted {detail['ref_wall_s']:.1f} s, with the kill and "
              f"restart {detail['run_wall_s']:.1f} s (both include start-up; this is a "
              f"correctness check, not a timing).", ""]
    (RESULTS / "restart.md").write_text("\n".join(lines))
    (RESULTS / "restart.json").write_text(json.dumps(
        {"pass": ok, "checks": [{"check": n, "pass": g, "detail": i} for n, g, i in checks],
         **{k2: v for k2, v in detail.items()}, "args": vars(a)}, indent=1, default=str) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(sorted(lf), [lf[s] for s in sorted(lf)], label="uninterrupted", lw=3, alpha=0.5)
    ax.plot(sorted(lr), [lr[s] for s in sorted(lr)], "--", label="killed + restarted")
    if k:
        ax.axvline(k["after_step"], color="tab:red", lw=1, label=f"SIGKILL (node {k['node']})")
        ax.axvline(at, color="tab:gray", lw=1, ls=":", label=f"resumed at step {at}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("gpt-tiny, 2 nodes x 1 rank, dp=2: loss with a restart")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "restart.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.restart", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="train.steps")
    ap.add_argument("--interval", type=int, default=10, help="checkpoint.interval")
    ap.add_argument("--kill-after", type=int, default=0,
                    help="kill once this step is logged (default: 1.5 checkpoint intervals)")
    ap.add_argument("--victim", type=int, choices=(0, 1), default=1,
                    help="whose worker dies: node 1, or node 0 (which hosts the rendezvous)")
    ap.add_argument("--max-restarts", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="parallel.timeout_s")
    ap.add_argument("--run-timeout-s", type=float, default=400.0, help="per run")
    ap.add_argument("--shared-store", action="store_true",
                    help="leave TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset (shows what it prevents)")
    ap.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    a = ap.parse_args(argv)
    if not 0 < (a.kill_after or a.interval + a.interval // 2) < a.steps:
        ap.error("--kill-after must fall inside the run")
    cmd = " ".join([".venv/bin/python -m benchmarks.restart",
                    *(argv if argv is not None else sys.argv[1:])])
    with tempfile.TemporaryDirectory(prefix="oases-restart-") as tmp:
        work = Path(a.workdir) if a.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        print(f"reference run: 2 nodes, {a.steps} steps ...", flush=True)
        ref = reference_run(work, a)
        print(f"  done in {ref['wall_s']:.1f} s, exit statuses {ref['codes']}", flush=True)
        print(f"restart run: SIGKILL to node {a.victim}'s worker mid-run ...", flush=True)
        run = restart_run(work, a)
        print(f"  done in {run['wall_s']:.1f} s, exit statuses {run['codes']}", flush=True)
        checks, detail = check(ref, run, a, work)
        if not all(c[1] for c in checks):
            for i, text in enumerate(run["logs"]):
                print(f"--- node {i} (last lines) ---\n" + "\n".join(text.splitlines()[-25:]))
    for name, good, info in checks:
        print(f"{'PASS' if good else 'FAIL'}  {name}: {info}")
    ok = all(c[1] for c in checks)
    write_report(checks, detail, a, cmd)
    print(f"{'PASS' if ok else 'FAIL'}: wrote {RESULTS / 'restart.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
