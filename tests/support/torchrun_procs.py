"""torchrun in the background and its workers, found through /proc.

The workers are found as children of the torchrun process by scanning /proc (their RANK
comes from /proc/<pid>/environ): no hook in production code. :func:`paused` stops a
worker (SIGSTOP: alive, but it joins no collective) and always lets it go again, so
torchrun's SIGTERM can reach it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.runs import REPO, subprocess_env


def start_torchrun(args: list[str], log: Path, *extra_torchrun: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc_per_node=2 [extra] train.py args``, output to ``log``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *extra_torchrun, "train.py", *args]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=f,
                                stderr=subprocess.STDOUT, text=True)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<p>/stat: field 4 is the parent pid)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
        if int(fields[1]) == pid:
            out.append(int(d))
    return out


def worker_pid(torchrun_pid: int, rank: int) -> int | None:
    """The live train.py worker of ``rank`` started by this torchrun, once it has exec'd
    (before that its environment is torchrun's, without RANK)."""
    for pid in children(torchrun_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(kv.split(b"=", 1) for kv in
                       Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"train.py" in cmdline and env.get(b"RANK") == str(rank).encode():
            return pid
    return None


def wait_for(cond, proc: subprocess.Popen, log: Path, timeout: float, what: str,
             poll_s: float = 0.05):
    """``cond()``'s first true value within ``timeout`` s; fails (with the log's tail) when
    torchrun exits first or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"torchrun exited ({proc.returncode}) before {what}:\n"
                                 f"{log.read_text()[-4000:]}")
        time.sleep(poll_s)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-4000:]}")


def metrics(out: Path) -> list[dict]:
    """The records of ``out``/metrics.jsonl written so far."""
    p = out / "metrics.jsonl"
    if not p.exists():
        return []
    recs = []
    for ln in p.read_text().splitlines():
        try:
            recs.append(json.loads(ln))
        except json.JSONDecodeError:  # a line being written
            pass
    return recs


@contextlib.contextmanager
def paused(pid: int):
    """Worker ``pid`` stopped (SIGSTOP) inside the block, continued on the way out."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def run_with_hung_rank(args: list[str], out: Path, log: Path, first_step_s: float,
                       error_s: float) -> tuple[int, str, float]:
    """A 2-rank run whose rank 1 stops (SIGSTOP) after the first logged step, until rank 0
    prints its ``parallel.timeout_s`` error. Returns (torchrun's status, its output,
    seconds from the stop to the error)."""
    proc = start_torchrun(args, log, "--max-restarts=0", "--monitor-interval=0.1")
    try:
        wait_for(lambda: any("loss" in r for r in metrics(out)), proc, log, first_step_s,
                 "a first step")
        victim = wait_for(lambda: worker_pid(proc.pid, 1), proc, log, 10, "rank 1's pid")
        with paused(victim):  # alive but never joins the next collective
            t0 = time.monotonic()
            wait_for(lambda: "parallel.timeout_s" in log.read_text() or None, proc, log,
                     error_s, "the timeout error")
            elapsed = time.monotonic() - t0
        rc = proc.wait(timeout=60)  # continued: torchrun's SIGTERM reaches it
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, log.read_text(), elapsed
