"""Shared fixtures for the end-to-end tests.

* ``pydoc_data``: one prepared byte-level corpus (``python -m oases.prepare --builtin
  pydoc``) for the whole session, so every training run reads the same files.
* ``run_train(args, nproc=2, expect_rc=0, timeout=240)``: ``torchrun train.py ...``
  from the repository root; returns the ``CompletedProcess`` (stdout and stderr
  captured as text).
* ``run_single(args, expect_rc=None, timeout=240)``: ``python train.py ...`` without
  torchrun (a world of one), for the error-exit tests: ``train.py`` itself returns
  status 2 there, whereas torchrun would turn a worker's status into its own.

Tests marked ``@pytest.mark.cuda`` (``gpus=N`` for N devices, default 1) skip with a
reason where there are fewer CUDA devices, so the CPU suite's time stays the same.

The subprocesses run with one OMP thread each (the CI machine has 2 cores) and
without any torchrun variables inherited from the caller.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def pytest_collection_modifyitems(config, items) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        mark = item.get_closest_marker("cuda")
        if mark is None:
            continue
        need = mark.kwargs.get("gpus", 1)
        if have < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} CUDA device{'s' if need > 1 else ''}, found {have}"))


def subprocess_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    return env


def resume_copy(run: Path, dest: Path, step: int = 2, drop: int = 4) -> Path:
    """A copy of a run's out_dir as it was right after its step-``step`` checkpoint
    (the later checkpoint ``drop`` removed, ``latest`` pointing back)."""
    import shutil

    shutil.copytree(run, dest)
    root = dest / "checkpoints"
    shutil.rmtree(root / f"step_{drop:06d}")
    (root / "latest").write_text(f"step_{step:06d}\n")
    return dest


def _describe(proc: subprocess.CompletedProcess) -> str:
    return (f"command: {' '.join(map(str, proc.args))}\nexit status {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}")


def _run(cmd: list[str], expect_rc, timeout: float, env: dict | None) -> subprocess.CompletedProcess:
    full_env = subprocess_env()
    if env:
        full_env.update(env)
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if expect_rc is not None:
        assert proc.returncode == expect_rc, _describe(proc)
    return proc


def run_train(args: list[str], nproc: int = 2, expect_rc: int | None = 0,
              timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc train.py *args`` in the repo root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "train.py", *map(str, args)]
    return _run(cmd, expect_rc, timeout, env)


def run_single(args: list[str], expect_rc: int | None = None, timeout: float = 240,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """``python train.py *args`` (no torchrun: world size 1) in the repo root."""
    return _run([sys.executable, "train.py", *map(str, args)], expect_rc, timeout, env)


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    """A prepared pydoc corpus: ``train.bin``, ``val.bin``, ``meta.json``."""
    out = tmp_path_factory.mktemp("pydoc")
    proc = subprocess.run([sys.executable, "-m", "oases.prepare", "--builtin", "pydoc",
                           "--out", str(out)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, _describe(proc)
    for f in ("train.bin", "val.bin"):
        assert (out / f).stat().st_size > 0, f
    return out


@pytest.fixture(scope="session")
def data_args(pydoc_data) -> list[str]:
    """Overrides pointing the shipped configs at the session's prepared corpus."""
    return [f"data.train_path={pydoc_data / 'train.bin'}",
            f"data.val_path={pydoc_data / 'val.bin'}"]


@pytest.fixture(name="run_train", scope="session")
def run_train_fixture():
    return run_train


@pytest.fixture(name="run_single", scope="session")
def run_single_fixture():
    return run_single
