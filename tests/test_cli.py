"""The command surface stays stable: every documented ``python -m oases.<command>`` still
answers, and the ``oases`` console script reaches the same commands by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oases.cli.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
MODULE_COMMANDS = ["plan", "prepare", "launch", "export", "generate", "consolidate", "schedule",
                   "config", "dashboard"]


# Each module run as ``python -m oases.<name> --help`` would run it (runpy, as __main__),
# all in one interpreter: one start-up of python and torch instead of one per command.
HELP_ALL = """
import contextlib, io, json, runpy, sys
out = {}
for name in sys.argv[1:]:
    sys.argv = [name, "--help"]
    buf, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_module(f"oases.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    out[name] = [code, buf.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    r = subprocess.run([sys.executable, "-c", HELP_ALL, *MODULE_COMMANDS], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


@pytest.mark.parametrize("name", MODULE_COMMANDS)
def test_python_m_command_answers_help(name, helps):
    code, out = helps[name]
    assert code in (0, None) and "usage:" in out, (name, code, out[-500:])


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
