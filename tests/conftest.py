"""Pytest hooks and the session fixtures; what test files share lives in tests/support.

* ``pydoc_data``: one prepared byte-level corpus (``python -m oases.prepare --builtin
  pydoc``) for the whole session, so every training run reads the same files.
* ``data_args``: the overrides that point the shipped configs at it.
* ``run_train`` / ``run_single``: :func:`tests.support.forked_runs.train_forked` and
  :func:`tests.support.forked_runs.single_forked` as fixtures: ``train.py``'s ``main`` on
  ranks forked from a server that imported it once (a world of ``nproc``, or of one as
  ``python train.py``). The tests of the launch itself (torchrun, its agent, ``python
  train.py``'s process) use :mod:`tests.support.runs`. A test that asks for either fixture
  trains, so it is in the ``slow`` tier (``make test-fast`` leaves it out); a test that
  trains another way, or compiles with inductor, says so with ``@pytest.mark.slow``, and
  so does a test of more than ~4 s whose feature has a cheaper check of its own in the
  fast tier.

Tests marked ``@pytest.mark.cuda`` (``gpus=N`` for N devices, default 1) skip with a
reason where there are fewer CUDA devices, so the CPU suite's time stays the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import forked_runs, runs

# Fixtures whose users run whole trainings.
SLOW_FIXTURES = frozenset({"run_train", "run_single"})


def pytest_collection_modifyitems(config, items) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        mark = item.get_closest_marker("cuda")
        if mark is None:
            continue
        need = mark.kwargs.get("gpus", 1)
        if have < need:
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need} CUDA device{'s' if need > 1 else ''}, found {have}"))


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    """A prepared pydoc corpus: ``train.bin``, ``val.bin``, ``meta.json``."""
    return runs.prepare_pydoc(tmp_path_factory.mktemp("pydoc"))


@pytest.fixture(scope="session")
def data_args(pydoc_data) -> list[str]:
    """Overrides pointing the shipped configs at the session's prepared corpus."""
    return [f"data.train_path={pydoc_data / 'train.bin'}",
            f"data.val_path={pydoc_data / 'val.bin'}"]


@pytest.fixture(name="run_train", scope="session")
def run_train_fixture():
    return forked_runs.train_forked


@pytest.fixture(name="run_single", scope="session")
def run_single_fixture():
    return forked_runs.single_forked
