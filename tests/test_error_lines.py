"""Under torchrun a bad run prints its one ``error:`` line even when rank 0 is slow.

An error every rank meets alike (a bad config) is printed by rank 0 only. torchrun stops
every worker as soon as one exits with a failure, so rank 1 exiting at once used to
have a rank 0 that was a few seconds behind killed before it printed: the run ended
with no error line at all (about 1 run in 75 of a bad stage plan; every time with rank
0 paused for 8 s). Here rank 0 is paused for real: SIGSTOP as soon as its process
exists, SIGCONT 8 s later, long after rank 1 has met the error (well under a second for
an unknown key, a few seconds for a stage plan read after torch is imported).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from oases.cli import train as cli
from oases.errors import ConfigError
from tests.support.runs import REPO
from tests.support.torchrun_procs import paused, start_torchrun, wait_for, worker_pid

PAUSE_S = 8.0
BASE = ["--config", "configs/gpt-tiny.yaml", "data.kind=synthetic", "wandb.mode=disabled",
        "eval.interval=0", "train.steps=2"]


def _run_with_rank0_paused(args: list[str], log: Path) -> tuple[int, str, float]:
    """(torchrun's status, its output, seconds from rank 0's pause to torchrun's exit)."""
    proc = start_torchrun(args, log, "--monitor-interval=0.1")
    try:
        rank0 = wait_for(lambda: worker_pid(proc.pid, 0), proc, log, 60, "rank 0's worker",
                         poll_s=0.002)
        with paused(rank0):
            t0 = time.monotonic()
            time.sleep(PAUSE_S)
        rc = proc.wait(timeout=120)
        return rc, log.read_text(), time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()


def _gap_plan(tmp_path: Path) -> Path:
    plan = tmp_path / "plan.yaml"
    plan.write_text("stages:\n  - {layers: [0, 1], dp: 1, tp: 1}\n"
                    "  - {layers: [2, 4], dp: 1, tp: 1}\n")
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("case", ["unknown_key", "stage_plan"])
def test_a_slow_rank0_still_prints_the_error_line(case, tmp_path):
    out = tmp_path / "run"
    if case == "unknown_key":  # refused before torch is imported
        extra = ["train.stpes=3"]
        want = "error: unknown config key 'train.stpes' (did you mean train.steps?)"
    else:  # refused in the run, after torch is imported, before any process group
        plan = _gap_plan(tmp_path)
        extra = ["parallel.tp=1", "parallel.pp=2", "train.grad_accum=2",
                 f"parallel.plan={plan}"]
        want = f"error: plan file {plan}"
    rc, text, elapsed = _run_with_rank0_paused([*BASE, f"out_dir={out}", *extra],
                                               tmp_path / "torchrun.log")
    assert rc != 0, text[-3000:]
    errs = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    # rank 0's line, once: rank 1 waited for torchrun to stop it instead of reporting too
    assert len(errs) == 1 and errs[0].startswith(want), text[-3000:]
    assert case == "unknown_key" or "stage 1 has layers [2, 4)" in errs[0], errs
    # torchrun's first failure is rank 0's status 2 (rank 1 was stopped, by SIGTERM)
    assert re.search(r"Root Cause[^\n]*\n\[0\]:\n(?:.*\n){2}\s*rank\s*:\s*0\b[^\n]*\n"
                     r"\s*exitcode\s*:\s*2\b", text), text[-3000:]
    assert elapsed >= PAUSE_S, elapsed
    assert "ConfigError" not in text, text[-3000:]  # no worker traceback (torchrun has its own)
    assert not out.exists()  # a refused run writes nothing


# ---------------------------------------------------------------------------
# who prints, in-process (the wait shortened)


@pytest.mark.parametrize("rank,agent,alike,line", [
    ("0", False, True, "error: bad key"),              # rank 0 always
    ("0", True, True, "error: bad key"),
    ("1", False, True, None),                          # no agent: rank 0 prints it
    ("1", True, True, "error: [rank 1] bad key"),      # rank 0 never did: after the wait
    ("1", False, False, "error: [rank 1] bad key"),    # its own error: at once
])
def test_who_prints_the_line(monkeypatch, capsys, rank, agent, alike, line):
    monkeypatch.setenv("RANK", rank)
    if agent:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    waited = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)
    cli.report("error", ConfigError("bad key"), alike)
    err = capsys.readouterr().err.splitlines()
    assert err == ([line] if line else [])
    assert waited == ([cli.PEER_REPORT_GRACE_S] if rank == "1" and agent and alike else [])


def test_a_config_error_on_rank_1_waits_for_the_agent(monkeypatch, capsys):
    """``main`` on rank 1 under torchrun: a config error (every rank meets it) waits for
    the agent to stop the rank (here the wait returns at once), then names the rank."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    waited = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)
    rc = cli.main(["--config", str(REPO / "configs" / "gpt-tiny.yaml"), "train.stpes=3"])
    assert rc == 2 and waited == [cli.PEER_REPORT_GRACE_S]
    assert capsys.readouterr().err.startswith("error: [rank 1] unknown config key 'train.stpes'")
