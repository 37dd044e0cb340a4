"""The command surface stays stable: every documented ``python -m oases.<command>`` still
answers, and the ``oases`` console script reaches the same commands by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from oases.cli.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
MODULE_COMMANDS = ["plan", "prepare", "launch", "export", "generate", "consolidate", "schedule",
                   "config", "dashboard"]


@pytest.mark.parametrize("name", MODULE_COMMANDS)
def test_python_m_command_answers_help(name):
    r = subprocess.run([sys.executable, "-m", f"oases.{name}", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, (name, r.stderr[-500:])


def test_console_script_knows_every_command():
    assert set(MODULE_COMMANDS) | {"train"} == set(COMMANDS)
    for module, _ in COMMANDS.values():
        assert (ROOT / (module.replace(".", "/") + ".py")).exists(), module


def test_console_script_runs_a_command(capsys):
    assert main(["config", "--config", "configs/gpt-tiny.yaml", "--nproc", "2"]) == 0
    assert capsys.readouterr().out.startswith("config ok: gpt-tiny")
    assert main(["config", "--config", "configs/gpt-tiny.yaml", "parallel.tp=3"]) == 2
    assert "parallel.tp=3" in capsys.readouterr().err


def test_console_script_usage_and_unknown_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main([]) == 2
    assert main(["trian"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command 'trian'" in err[0]
