"""Multi-node restarts: two torchrun agents ("nodes"), one node's worker killed mid-run.

Two torchrun agents on 127.0.0.1 act as two nodes of one job, the way a multi-node job
is launched (``--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d
--rdzv-endpoint=127.0.0.1:PORT --max-restarts=2``, with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which a multi-node restart needs: each worker
group then builds its own store instead of reusing the agents' one, whose keys outlive
a restart). They train gpt-tiny on synthetic data at dp=2 (one rank per node) with a
checkpoint every 2 steps and ``resume=auto``. Once a checkpoint exists and training has
gone past it, node 1's worker (not its agent) gets SIGKILL: its agent restarts it, the
other agent sees the new rendezvous round (or its worker's failed collective) and
restarts its worker too, and the new group resumes from the latest complete checkpoint.

Checked: both agents exit 0 and a worker resumed; ``metrics.jsonl`` holds steps 1..N
once each, in order; ``latest`` names the final step, whose checkpoint reads whole into
finite tensors; and every step's loss equals, bit for bit, an uninterrupted run of the
same job (the trainer's loop in two gloo workers in-process: the same two ranks, the
same collectives, so the same float32 results on CPU).
"""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support.loop import records, train_workers
from tests.support.runs import REPO, subprocess_env
from tests.support.torchrun_procs import children, metrics

pytestmark = pytest.mark.slow

STEPS = 6
CONFIG = "configs/gpt-tiny.yaml"
OVERRIDES = ["model.n_layer=2", "model.seq_len=32", "data.kind=synthetic", "data.val_path=",
             "parallel.tp=1", f"train.steps={STEPS}", "checkpoint.interval=2",
             "checkpoint.keep=2", "train.log_interval=1", "eval.interval=0",
             "wandb.mode=disabled", "parallel.timeout_s=60"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_nodes(out: Path) -> list[tuple[subprocess.Popen, Path]]:
    """Two agents, node 0 hosting the rendezvous store; each logs to its own file."""
    port = _free_port()
    env = {**subprocess_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = []
    for i in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=restart-{os.getpid()}", f"--rdzv-conf=is_host={int(i == 0)}",
               "--local-addr=127.0.0.1", "--max-restarts=2", "--monitor-interval=0.1",
               "train.py", "--config", CONFIG, *OVERRIDES, "resume=auto", f"out_dir={out}"]
        log = out.parent / f"node{i}.log"
        with open(log, "w") as f:
            nodes.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f,
                                           stderr=subprocess.STDOUT, start_new_session=True),
                          log))
    return nodes


def _worker_of(agent_pid: int) -> int | None:
    """The live train.py worker this agent started (one per node here)."""
    for pid in children(agent_pid):
        try:
            if b"train.py" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                return pid
        except OSError:
            continue
    return None


def _kill_mid_run(nodes, out: Path, after_step: int, timeout_s: float) -> int:
    """SIGKILL node 1's worker once ``after_step`` is logged past a checkpoint; the step
    reached then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert all(p.poll() is None for p, _ in nodes), "an agent exited before the kill"
        done = max((r["step"] for r in metrics(out) if "loss" in r), default=0)
        if done >= after_step and (out / "checkpoints" / "latest").exists():
            victim = _worker_of(nodes[1][0].pid)
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
                return done
        time.sleep(0.05)
    raise AssertionError(f"no step {after_step} within {timeout_s} s")


def test_a_killed_worker_on_one_of_two_nodes_restarts_the_group_exactly(tmp_path):
    from oases.runtime.checkpoint import full_model_state

    out = tmp_path / "run"
    nodes = _start_nodes(out)
    try:
        killed_after = _kill_mid_run(nodes, out, 3, 180)
        codes = [p.wait(timeout=240) for p, _ in nodes]
    finally:
        for p, _ in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    logs = "\n".join(log.read_text(errors="replace") for _, log in nodes)
    assert codes == [0, 0], logs[-4000:]
    assert killed_after < STEPS, "the run finished before the kill: nothing was tested"
    resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", logs)]
    assert resumed and resumed[0] <= killed_after, logs[-4000:]

    recs = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    final = out / "checkpoints" / f"step_{STEPS:06d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == final.name
    state = full_model_state(final)
    assert state and all(bool(torch.isfinite(t).all()) for t in state.values())

    ref = tmp_path / "reference"
    train_workers(ref, 2, OVERRIDES, str(REPO / CONFIG))
    want = {s: r["loss"] for s, r in records(ref).items()}
    got = {r["step"]: r["loss"] for r in recs}
    assert sorted(want) == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in got.values())
    assert got == want, {s: (got[s], want[s]) for s in got if got[s] != want[s]}
