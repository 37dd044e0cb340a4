"""The house's dependency order: the import contract in pyproject.toml holds, it breaks on
an upward, a sideways or a function-level import, every package stands on a floor, and a
function-level import of our own code says why it is deferred.

    errors, progress -> config -> parallel -> (models | overlap | pipeline | dp) -> planner
                     -> runtime -> cli
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"
OURS = ("oases", "models")


def _lint(where: Path) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run([str(LINT), "--no-cache", "--no-logo"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=120)


def test_contract_is_kept():
    r = _lint(ROOT)
    assert r.returncode == 0 and "KEPT" in r.stdout and "BROKEN" not in r.stdout, r.stdout


@pytest.mark.parametrize("into, line, broken", [
    # upward: a floor imports the one above it
    ("oases/parallel/comm.py", "from oases.runtime import trainer",
     "oases.parallel is not allowed to import oases.runtime"),
    # sideways: two packages of the middle floor are independent
    ("oases/pipeline/actions.py", "import oases.overlap.engines",
     "oases.pipeline is not allowed to import oases.overlap"),
    # the model zoo never reaches the planner, not even inside a function
    ("models/common.py", "def _hidden():\n    from oases.planner import cost",
     "oases.models is not allowed to import oases.planner"),
])
def test_contract_breaks_on_a_wrong_import(tmp_path, into, line, broken):
    for part in (*OURS, "pyproject.toml"):
        src = ROOT / part
        if src.is_dir():  # oases/models stays a link to the copied models/
            shutil.copytree(src, tmp_path / part, symlinks=True)
        else:
            shutil.copy(src, tmp_path / part)
    target = tmp_path / into
    target.write_text(target.read_text() + f"\n\n{line}  # injected\n")
    r = _lint(tmp_path)
    assert r.returncode != 0 and "BROKEN" in r.stdout and broken in r.stdout, r.stdout


def _layers() -> list[str]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = conf["contracts"]
    return [m.strip() for layer in contract["layers"] for m in layer.split("|")]


# `python -m oases.<command>` keeps working through these: each only forwards to oases.cli
FORWARDERS = {"plan", "prepare", "launch", "export", "generate", "consolidate", "schedule",
              "dashboard"}


def test_every_package_stands_on_a_floor():
    floors = set(_layers())
    for entry in sorted((ROOT / "oases").iterdir()):
        name = entry.stem if entry.suffix == ".py" else entry.name
        if name.startswith("__") or not (entry.suffix == ".py" or (entry / "__init__.py").exists()):
            continue
        if name in FORWARDERS:
            imports = [n for n in ast.walk(ast.parse(entry.read_text()))
                       if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert imports and all(getattr(n, "module", "") == f"oases.cli.{name}"
                                   for n in imports), f"oases/{name}.py must only forward"
            continue
        assert f"oases.{name}" in floors, f"oases/{entry.name} is on no floor of the contract"


def _deferred_imports(path: Path):
    """(line number, statement) of every function-level import."""
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node.lineno, ast.unparse(node)


def test_function_level_imports_say_why():
    """A function-level import of our own code is never a way around the contract (it
    counts there anyway); any import kept in a function, for start-up time or an optional
    dependency, says so with ``# deferred: <why>`` on its line or in the comment lines
    just above it."""
    missing = []
    files = [ROOT / "train.py", *sorted((ROOT / "oases").rglob("*.py")),
             *sorted((ROOT / "models").rglob("*.py"))]
    for path in files:
        lines = path.read_text().splitlines()
        for lineno, stmt in _deferred_imports(path):
            i = lineno - 1
            said = "# deferred:" in lines[i]
            while not said and i > 0 and lines[i - 1].strip().startswith("#"):
                i -= 1
                said = "# deferred:" in lines[i]
            if not said:
                missing.append(f"{path.relative_to(ROOT)}:{lineno}: {stmt}")
    assert not missing, "function-level imports without a '# deferred:' reason:\n" + \
        "\n".join(missing)


def test_the_library_imports_no_entry_point_test_or_benchmark():
    """``train.py``, ``tests/``, ``benchmarks/`` and ``emucluster/`` stand on top of the house: nothing in
    ``oases/`` or ``models/`` imports them (they are outside the contract's packages, so
    import-linter would not see such an import)."""
    bad = []
    for path in sorted([*(ROOT / "oases").rglob("*.py"), *(ROOT / "models").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in mods
                    if m.split(".")[0] in ("train", "tests", "benchmarks", "emucluster")]
    assert not bad, "\n".join(bad)


@pytest.mark.slow  # a python process of its own
def test_the_runtime_imports_dcp_at_the_first_save_or_load():
    """``torch.distributed.checkpoint`` pulls in DTensor and sympy (~0.5 s of every
    process's start-up): importing the trainer, as every train.py and CLI process does,
    leaves them out, and so does telling a failed collective from other errors (every
    error exit does); the checkpoint module's DCP names still resolve, on first use."""
    code = ("import sys, oases.runtime.trainer, oases.runtime.checkpoint as c\n"
            "heavy = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor',"
            " 'sympy') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "from oases.runtime.trainer import collective_failure\n"
            "assert collective_failure(RuntimeError('gloo: Connection reset by peer'))\n"
            "assert not c.is_dcp_failure(ValueError('x')) and not collective_failure(KeyError())\n"
            "assert 'torch.distributed.checkpoint' not in sys.modules, 'an error exit imports DCP'\n"
            "from torch.distributed.checkpoint.api import CheckpointException as E\n"
            "e = E('save', {1: (RuntimeError('wait timed out'), None)})\n"
            "assert c.is_dcp_failure(e) and collective_failure(e)\n"
            "assert not collective_failure(E('save', {0: (ValueError('disk'), None)}))\n"
            "assert c.CheckpointException.__module__ == 'torch.distributed.checkpoint.api'\n"
            "assert c.read_metadata.__module__ == 'oases.runtime.ckpt_format'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow  # a python train.py of its own
def test_an_error_exit_does_not_import_dcp(tmp_path):
    """A run that fails before any checkpoint (here: its data file is missing) exits
    without importing DCP: the trainer tells a failed collective from other errors
    without it (``-X importtime`` lists every module the process imported)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "--config", "configs/gpt-tiny.yaml",
         f"out_dir={tmp_path / 'run'}", "parallel.tp=1", "wandb.mode=disabled",
         f"data.train_path={tmp_path / 'missing.bin'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not exist" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    imported = [ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines()
                if ln.startswith("import time:")]
    assert "oases.runtime.trainer" in imported, imported[-5:]
    dcp = [m for m in imported if m.startswith(("torch.distributed.checkpoint",
                                                 "torch.distributed.tensor"))]
    assert not dcp, dcp[:5]
