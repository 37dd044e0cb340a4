"""Training runs as subprocesses, from the repository root.

* ``run_train(args, nproc=2, expect_rc=0, timeout=240)``: ``torchrun train.py ...``;
  returns the ``CompletedProcess`` (stdout and stderr captured as text).
* ``run_single(args, expect_rc=None, timeout=240)``: ``python train.py ...`` without
  torchrun (a world of one), for the error-exit tests: ``train.py`` itself returns
  status 2 there, whereas torchrun would turn a worker's status into its own.

The subprocesses run with one OMP thread each (the CI machine has 2 cores) and
without any torchrun variables inherited from the caller.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def subprocess_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    return env


def resume_copy(run: Path, dest: Path, step: int = 2, drop: int = 4) -> Path:
    """A copy of a run's out_dir as it was right after its step-``step`` checkpoint
    (the later checkpoint ``drop`` removed, ``latest`` pointing back)."""
    shutil.copytree(run, dest)
    root = dest / "checkpoints"
    shutil.rmtree(root / f"step_{drop:06d}")
    (root / "latest").write_text(f"step_{step:06d}\n")
    return dest


def describe(proc: subprocess.CompletedProcess) -> str:
    return (f"command: {' '.join(map(str, proc.args))}\nexit status {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")


def run_checked(cmd: list[str], expect_rc, timeout: float,
                env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` in the repo root; ``expect_rc`` (None: any) is asserted with the output."""
    full_env = subprocess_env()
    if env:
        full_env.update(env)
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, describe(proc)
    return proc


def run_train(args: list[str], nproc: int = 2, expect_rc: int | None = 0,
              timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc train.py *args`` in the repo root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "train.py", *map(str, args)]
    return run_checked(cmd, expect_rc, timeout, env)


def run_single(args: list[str], expect_rc: int | None = None, timeout: float = 240,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """``python train.py *args`` (no torchrun: world size 1) in the repo root."""
    return run_checked([sys.executable, "train.py", *map(str, args)], expect_rc, timeout, env)


def prepare_pydoc(out: Path) -> Path:
    """``python -m oases.prepare --builtin pydoc`` into ``out``: ``train.bin``,
    ``val.bin``, ``meta.json``."""
    run_checked([sys.executable, "-m", "oases.prepare", "--builtin", "pydoc", "--out", str(out)],
                0, 120)
    for f in ("train.bin", "val.bin"):
        assert (out / f).stat().st_size > 0, f
    return out
