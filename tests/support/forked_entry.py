"""The rank side of :mod:`tests.support.forked_runs`: imported by its forkserver before
any fork (so every rank starts with train.py's imports done), and ``rank_main`` run in
each forked rank."""

from __future__ import annotations

import atexit
import importlib
import io
import os
import sys

import torch
import torch.distributed  # noqa: F401  (what the trainer joins a world with)

import oases.runtime.trainer  # noqa: F401  (train.py imports it once its config is good)
from oases.cli.train import main


def rank_main(argv: list[str], env: dict, cwd: str, out_path: str, err_path: str,
              module: str | None = None) -> None:
    """``train.py *argv`` in this process (``python -m module *argv`` when ``module`` is
    given: its ``main()``, which reads ``sys.argv``): the environment replaced by ``env``,
    the working directory ``cwd``, file descriptors 1 and 2 into the two files; exits with
    ``main``'s status (1 and a traceback for an exception, as Python's own exit)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    sys.argv = [module or "train.py", *argv]
    if "OMP_NUM_THREADS" in env:  # read once, by the server's torch: set it as a fresh one would
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        rc = main(argv) if module is None else importlib.import_module(module).main()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        rc = 1
    atexit._run_exitfuncs()  # what an interpreter's exit runs; a forked child skips it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc if isinstance(rc, int) else 0)  # a main() returning None: status 0
