"""Preemption: SIGTERM (or SIGUSR1) mid-run finishes the step, saves a checkpoint and exits
with status 5; ``resume=auto`` then continues, and the loss curve equals an
uninterrupted run's exactly (CPU kernels are deterministic; the data position and RNG
states are in the checkpoint)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.runs import REPO, run_single, subprocess_env

pytestmark = pytest.mark.slow

STEPS = 30


def _args(out: Path) -> list[str]:
    return ["--config", "configs/gpt-tiny.yaml", f"out_dir={out}", "parallel.tp=1",
            f"train.steps={STEPS}", "train.micro_batch_size=2", "model.seq_len=32",
            "data.kind=synthetic", "data.val_path=", "eval.interval=0", "wandb.mode=disabled",
            "train.log_interval=1", "resume=auto"]


def _losses(out: Path) -> dict[int, float]:
    recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("preempt") / "ref"
    run_single(_args(out), expect_rc=0)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_saves_and_resume_is_exact(sig, ref, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "train.py", *_args(out)], cwd=REPO,
                            env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # signal once training is under way
        if line.startswith("step 3/"):
            proc.send_signal(sig)
            break
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 5, (proc.returncode, stderr[-2000:])
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"stopped: {sig.name} received"), stderr
    stopped = max(_losses(out))
    assert 3 <= stopped < STEPS
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped:06d}" and f"checkpoint {out}" in lines[0]

    run_single(_args(out), expect_rc=0)
    assert _losses(out) == _losses(ref)  # bit-exact over the whole curve
