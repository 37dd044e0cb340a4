"""Training runs whose ranks are forked from a server that imported oases once.

``train_forked(args, nproc=2)`` runs ``train.py``'s ``main(args)`` on ``nproc`` ranks and
returns a ``CompletedProcess`` as :func:`tests.support.runs.run_train` does; with
``nproc=1`` it is ``python train.py`` (a world of one, ``main``'s own exit status), as
:func:`tests.support.runs.run_single`; with ``module=`` it runs that module's ``main()``
instead, as ``torchrun --module`` does (the benchmarks' peers). Each rank is a fresh
process, forked from a multiprocessing *forkserver* started once per test process: the
server imported torch, the trainer and the CLI, so a rank starts in milliseconds instead
of ~2.5 s of CPU (torchrun's agent, another ~1.8 s, is not started at all). What a rank
runs after the imports is what ``train.py`` runs: the same ``main``, argument parsing,
exit statuses, stdout and stderr (file descriptors 1 and 2, C++ included), the
environment given.

Ranks of a world of more than one see the variables a torchrun worker gets for its
rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...) but
no ``TORCHELASTIC_*``: no agent watches them, as under a launcher of one's own. When one
rank fails, the others are killed and the status is 1 (torchrun's); only the tests of
what torchrun itself does (restarts, its report, signals to the agent) need it, and they
use :func:`tests.support.runs.run_train`.

The server's state is the imports' alone: nothing a test does in its own process (a
default dtype, a seed, deterministic algorithms, a compile cache) reaches the ranks.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.runs import REPO, describe, subprocess_env

# imported by the server before it forks anything (what a train.py process imports)
PRELOAD = ["tests.support.forked_entry"]
_ctx = None


def context():
    global _ctx
    if _ctx is None:
        _ctx = multiprocessing.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_envs(nproc: int, env: dict | None) -> list[dict]:
    base = {**subprocess_env(), **(env or {})}
    if nproc == 1:
        return [base]
    port = str(free_port())
    return [{**base, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0",
             "ROLE_RANK": str(r), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
             "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(nproc)]


def wait_all(procs, deadline: float) -> bool:
    """Join ``procs``; once one fails, kill the rest (an agent's part). False: timed out."""
    while any(p.exitcode is None for p in procs):
        if time.monotonic() > deadline:
            return False
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.exitcode is None:
                    p.kill()
        procs[0].join(0.05) if procs[0].exitcode is None else time.sleep(0.05)
    return True


def train_forked(args: list[str], nproc: int = 2, expect_rc: int | None = 0,
                 timeout: float = 240, env: dict | None = None,
                 module: str | None = None) -> subprocess.CompletedProcess:
    """``train.py *args`` on ``nproc`` forked ranks in the repo root (see the module doc);
    ``module``: ``python -m module *args`` instead (its ``main()``, as torchrun's
    ``--module`` runs it)."""
    from tests.support import forked_entry

    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory() as d:
        outs = [(os.path.join(d, f"out{r}"), os.path.join(d, f"err{r}")) for r in range(nproc)]
        procs = [context().Process(target=forked_entry.rank_main,
                                   args=(argv, e, str(REPO), *outs[r], module))
                 for r, e in enumerate(rank_envs(nproc, env))]
        for p in procs:
            p.start()
        finished = wait_all(procs, time.monotonic() + timeout)
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
        stdout, stderr = ("".join(Path(o[i]).read_text(errors="replace") for o in outs)
                          for i in (0, 1))
    codes = [p.exitcode for p in procs]
    rc = codes[0] if nproc == 1 else int(any(codes))
    cmd = [sys.executable, *(["-m", module] if module else ["train.py"]), *argv]
    proc = subprocess.CompletedProcess(cmd, rc, stdout, stderr)
    if not finished:
        raise AssertionError(f"forked ranks still running after {timeout} s (killed)\n"
                             + describe(proc))
    if expect_rc is not None:
        assert rc == expect_rc, f"rank exit statuses {codes}\n" + describe(proc)
    return proc


def single_forked(args: list[str], expect_rc: int | None = None, timeout: float = 240,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    """``python train.py *args`` (a world of one) on a forked rank: ``main``'s status."""
    return train_forked(args, nproc=1, expect_rc=expect_rc, timeout=timeout, env=env)
