"""The oldest torch ``pyproject.toml`` allows is the one CI tests: ``.ci/run`` installs
it, and the suite runs on it (so the floor is never below what has run)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _floor() -> tuple[int, int]:
    (m,) = re.findall(r'"torch>=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    return int(m[0]), int(m[1])


def test_the_floor_is_what_ci_runs():
    (ci,) = set(re.findall(r"torch==(\d+)\.(\d+)\.\d+", (ROOT / ".ci/run").read_text()))
    assert _floor() == (int(ci[0]), int(ci[1]))


def test_this_torch_is_not_below_the_floor():
    have = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert have >= _floor(), torch.__version__
