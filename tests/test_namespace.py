"""The model zoo's import name is ``oases.models``: a user's own ``models`` package (one of
the commonest folder names in ML projects) neither breaks oases nor is shadowed by it.

The files stay in the repository's top-level ``models/`` folder. Installs map the package
there (``package-dir`` in pyproject.toml); in a source tree without an install (the
import linter, ``PYTHONPATH=.`` runs) the link ``oases/models -> ../models`` finds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_is_installed_and_nothing_named_models_is():
    st = _setuptools()
    on_disk = {".".join(p.parent.relative_to(REPO).parts)
               for p in (REPO / "oases").glob("**/__init__.py")
               if not p.is_relative_to(REPO / "oases" / "models")}
    assert set(st["packages"]) == on_disk | {"oases.models"}
    assert st["package-dir"] == {"oases.models": "models"}
    assert all(p == "oases" or p.startswith("oases.") for p in st["packages"])


def test_the_source_tree_link_points_at_the_zoo():
    link = REPO / "oases" / "models"
    assert link.is_symlink() and os.readlink(link) == "../models"
    assert (REPO / "models" / "__init__.py").is_file()


@pytest.mark.slow  # a training run in a subprocess
def test_a_users_models_package_and_ours_live_side_by_side(tmp_path):
    """From a project directory with its own ``models`` package (first on sys.path, as
    ``python -m`` puts the current directory): the config command, a one-process training
    run and an import of both packages in one interpreter all work."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("MINE = True\n")
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": ""}
    env.pop("WORLD_SIZE", None)
    cfg = str(REPO / "configs" / "gpt-tiny.yaml")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)

    both = run("-c", "import models, oases.runtime.trainer, oases.models as zoo; "
                     "assert models.MINE and zoo.build_model and zoo is not models")
    assert both.returncode == 0, both.stderr
    checked = run("-m", "oases.config", "--config", cfg, "--nproc", "1", "parallel.tp=1")
    assert checked.returncode == 0, checked.stderr
    trained = run("-m", "oases.cli", "train", "--config", cfg, "parallel.tp=1",
                  "data.kind=synthetic", "data.train_path=", "data.val_path=",
                  "train.steps=2", "train.micro_batch_size=2", "train.log_interval=1",
                  "checkpoint.interval=0", "wandb.mode=disabled", f"out_dir={tmp_path / 'run'}")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "step 2/2" in trained.stdout
