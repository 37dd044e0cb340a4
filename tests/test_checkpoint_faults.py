"""Faults in the checkpoint path: nothing complete is ever lost.

In-process, every file operation of a save is made to fail in turn
(:mod:`tests.support.ckpt_faults`): the save of step 6 into a run that holds step 2 and step 4
(``checkpoint.keep=2``), which writes the RNG file, the DCP files, meta.json, renames
the directory, replaces ``latest`` and prunes step 2. At each of its 34 operations:

* an error (ENOSPC where space is taken: mkdir, open, write; EIO elsewhere: fsync,
  rename, unlink, rmdir), for a synchronous and an asynchronous save;
* a kill (that operation and every later one never happen). An async save performs the
  very same operations in the same order (checked), so its kills are the same cases.

After each: the save either finished or raised one line (``CheckpointWriteError``);
``latest`` names a complete checkpoint (no fallback needed), the one it named before
unless the fault came after its replacement; step 4 is intact; a resume loads exactly
the state saved at its step; and the next save (what the resumed run does) succeeds and
leaves no leftovers.

Then: across two ranks a fault on one rank ends both with the same line, which rank 0
alone prints (as it prints a CheckpointError); an out_dir that one rank does not see
(node-local) stops the run before any save; and under torchrun an injected ENOSPC on
rank 1 (which stops the run at its next save) and a real ``kill -9`` of rank 0 inside
the publish are resumed to the very loss curve that training had before any fault.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from oases.cli import train as cli
from oases.config import load_config
from oases.errors import CheckpointError, CheckpointWriteError
from oases.parallel.groups import ParallelContext
from oases.runtime import checkpoint as ckpt
from oases.runtime import trainer
from oases.runtime.ckpt_files import ckpt_root, find_checkpoint, step_name
from oases.runtime.resume import chosen_checkpoint
from oases.runtime.run_dir import RunLock, check_shared
from tests.support.ckpt_faults import FileFaults
from tests.support.runs import REPO, subprocess_env
from tests.support.distributed import run_distributed
from tests.support.torchrun_procs import metrics

CTX = ParallelContext.single("cpu")
SPACE_OPS = ("mkdir", "open", "write")  # the operations that take space fail with ENOSPC


class _Tiny(nn.Module):
    def __init__(self, name: str = "w") -> None:
        super().__init__()
        self.register_parameter(name, nn.Parameter(torch.zeros(3, 2)))
        self.b = nn.Parameter(torch.zeros(2))


def _state(step: int, name: str = "w"):
    """A model and Adam state whose every value says ``step``."""
    model = _Tiny(name)
    opt = torch.optim.Adam(model.parameters())
    ckpt.ensure_optimizer_state(opt)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(step)
            opt.state[p]["exp_avg"].fill_(2 * step)
            opt.state[p]["step"].fill_(step)
    return model, opt


def _save(out: Path, step: int, saver=None, ctx=CTX, name: str = "w") -> None:
    model, opt = _state(step, name)
    meta = {"step": step, "data": {"consumed": step}}
    rng = {"mark": torch.tensor(step)}
    if saver is None:
        ckpt.save(str(out), step, model, opt, ctx, meta, rng, keep=2)
    else:
        saver.save(str(out), step, model, opt, ctx, meta, rng, keep=2)
        saver.wait()


def _holds(path: Path, step: int, moments: bool = True) -> bool:
    """Whether the checkpoint at ``path`` loads whole and holds the state of ``step``
    (``moments``: the Adam moments read and checked too)."""
    meta = ckpt.read_meta(path)
    model = ckpt.full_model_state(path)
    rng = torch.load(path / "rng" / "rank0.pt", weights_only=True)
    ok = (meta["step"] == step and int(rng["mark"]) == step
          and all(torch.equal(t, torch.full_like(t, step)) for t in model.values()))
    if moments:
        ok = ok and all(torch.equal(t, torch.full_like(t, 2 * step))
                        for t in ckpt.full_model_state(path, "optim.exp_avg").values())
    return ok


@pytest.fixture(scope="module")
def before(tmp_path_factory) -> Path:
    """A run that holds step 2 and step 4, ``latest`` naming step 4."""
    out = tmp_path_factory.mktemp("faults") / "before"
    _save(out, 2)
    _save(out, 4)
    return out


def _ops(before: Path, tmp: Path, saver) -> list[tuple[str, str]]:
    out = tmp / "count"
    shutil.copytree(before, out)
    with FileFaults(ckpt_root(out)) as faults:
        _save(out, 6, saver)
    return [(k, p.replace(str(out), "")) for k, p in faults.ops]


def test_a_save_makes_each_step_durable_before_the_next(before, tmp_path):
    """The order of a save's operations: each file fsynced before the rename that
    publishes it, the directory fsynced after each rename; the async save's the same."""
    ops = _ops(before, tmp_path, None)
    tmp, root = "/checkpoints/step_000006.tmp", "/checkpoints"
    want = [("fsync", f"{tmp}/rng/rank0.pt"), ("fsync", f"{tmp}/__0_0.distcp"),
            ("write", f"{tmp}/meta.json"), ("fsync", f"{tmp}/meta.json"),
            ("fsync", f"{tmp}/rng"), ("fsync", tmp), ("rename", tmp), ("fsync", root),
            ("write", f"{root}/latest.tmp"), ("fsync", f"{root}/latest.tmp"),
            ("rename", f"{root}/latest.tmp"), ("fsync", root),
            ("rename", f"{root}/step_000002"), ("fsync", root)]
    at = 0
    for w in want:  # each after the one before
        assert w in ops[at:], (w, ops[at:])
        at = ops.index(w, at) + 1
    assert _ops(before, tmp_path / "async", ckpt.AsyncSaver()) == ops


def _trial(before: Path, out: Path, k: int, kill: bool, async_: bool, n_ops: list) -> str:
    shutil.copytree(before, out)
    root = ckpt_root(out)
    kind = n_ops[k][0]
    err = errno.ENOSPC if kind in SPACE_OPS else errno.EIO
    with FileFaults(root, at=k, err=err, kill=kill) as faults:
        try:
            _save(out, 6, ckpt.AsyncSaver() if async_ else None)
            outcome = "saved"
        except CheckpointWriteError as e:
            outcome = str(e)
            assert "\n" not in outcome and outcome.startswith("checkpoint step_000006 ")
            assert os.strerror(err) in outcome, outcome
        except BaseException:
            if not faults.killed:
                raise
            outcome = "killed"
    assert faults.hit == (kind, str(out) + n_ops[k][1]), (faults.hit, n_ops[k])
    assert kill == (outcome == "killed")
    return outcome


def _check_after(out: Path, k: int, outcome: str, latest_at: int) -> None:
    root = ckpt_root(out)
    found, note = find_checkpoint(out)
    assert note is None and found is not None, note  # `latest` names a complete checkpoint
    step = ckpt.read_meta(found)["step"]
    # a fault up to latest's replacement leaves it untouched; after it, step 6 is published
    assert step == (6 if outcome == "saved" or k > latest_at else 4), (k, outcome, step)
    assert found == root / (root / "latest").read_text().strip()
    assert _holds(found, step)
    assert _holds(root / step_name(4), 4, moments=False)  # complete before: never lost
    if step == 4:
        assert _holds(root / step_name(2), 2, moments=False)
    # the resumed run's next save succeeds and leaves nothing behind
    with FileFaults(root):  # counts only (and skips the disk flushes)
        _save(out, step + 2)
    left = sorted(p.name for p in root.iterdir())
    assert left == ["latest", step_name(step), step_name(step + 2)], left
    assert find_checkpoint(out) == (root / step_name(step + 2), None)
    assert _holds(root / step_name(step + 2), step + 2)


@pytest.mark.parametrize("mode", ["sync-error", "async-error", "kill"])
def test_every_fault_point_keeps_a_complete_checkpoint(mode, before, tmp_path):
    async_ = mode == "async-error"
    ops = _ops(before, tmp_path, ckpt.AsyncSaver() if async_ else None)
    latest_at = ops.index(("rename", "/checkpoints/latest.tmp"))
    outcomes = []
    for k in range(len(ops)):
        out = tmp_path / f"t{k}"
        outcome = _trial(before, out, k, mode == "kill", async_, ops)
        _check_after(out, k, outcome, latest_at)
        outcomes.append(outcome)
    # a fault that lets the save finish: a mkdir of a directory that exists (exist_ok:
    # the root, DCP's of the save's directory), or removing the pruned directory's files
    # (left for the next save)
    made = ops.index(("mkdir", "/checkpoints/step_000006.tmp"))
    harmless = [k for k, op in enumerate(ops) if op == ("mkdir", "/checkpoints")
                or (op == ops[made] and k != made) or op[0] in ("unlink", "rmdir")]
    saved = [k for k, o in enumerate(outcomes) if o == "saved"]
    assert set(saved) <= set(harmless), [ops[k] for k in saved]
    assert len(ops) == 34, ops  # the count the docs give


# ---------------------------------------------------------------------------
# two ranks: a fault on one ends both with the same line


CASES = {  # name: (rank with the fault, (operation, path suffix), async)
    "rng-rank1": (1, ("write", "rng/rank1.pt"), False),
    "dcp-rank1": (1, ("write", "__1_0.distcp"), False),
    "publish-rank0": (0, ("write", "meta.json"), False),
    "async-dcp-rank1": (1, ("write", "__1_0.distcp"), True),
    "async-publish-rank0": (0, ("rename", "step_000004.tmp"), True),
}


def _two_ranks(ctx, base: str) -> None:
    for name, (rank, match, async_) in CASES.items():
        out = Path(base) / name
        saver = ckpt.AsyncSaver(30) if async_ else None
        _save(out, 2, saver, ctx, f"w{ctx.rank}")  # distinct tensors: both ranks write
        faults = FileFaults(ckpt_root(out), match=match, err=errno.ENOSPC)
        line = None
        with faults if ctx.rank == rank else FileFaults(ckpt_root(out)):
            try:
                _save(out, 4, saver, ctx, f"w{ctx.rank}")
            except CheckpointWriteError as e:
                line = str(e)
        lines = [None, None]
        dist.all_gather_object(lines, line)
        assert lines[0] is not None and lines[0] == lines[1], (name, lines)
        assert f"rank {rank}: " in line and "No space left on device" in line, line
        root = ckpt_root(out)
        assert (root / "latest").read_text().strip() == step_name(2), name
        dist.barrier()
        if ctx.rank == 0:
            assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(2)], name
        _save(out, 4, saver, ctx, f"w{ctx.rank}")  # and the next save goes through
        assert (root / "latest").read_text().strip() == step_name(4), name


def test_a_fault_on_one_rank_stops_every_rank_with_the_same_line(tmp_path):
    run_distributed(_two_ranks, world=2, tp=1, args=(str(tmp_path),))


# ---------------------------------------------------------------------------
# the line of a CheckpointError or a failed save is printed once (rank 0's)


@pytest.mark.parametrize("error,status", [(CheckpointError, 2), (CheckpointWriteError, 6)])
def test_a_checkpoint_error_is_printed_by_rank_0_only(error, status, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    waited = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)

    def run(cfg):
        raise error("checkpoint runs/x/checkpoints/step_000004 is bad")
    monkeypatch.setattr(trainer, "run", run)
    rc = cli.main(["model.name=gpt-tiny", "data.kind=synthetic"])
    assert rc == status and waited == [cli.PEER_REPORT_GRACE_S]
    assert capsys.readouterr().err == ("error: [rank 1] checkpoint runs/x/checkpoints/"
                                       "step_000004 is bad\n")


# ---------------------------------------------------------------------------
# an out_dir that a rank does not see (node-local) stops the run at start-up


def _node_local(ctx, base: str) -> None:
    """Each rank in a directory of its own ("node"): the relative out_dir ``run`` is a
    different directory on each, as a node-local disk would make it."""
    os.chdir(Path(base) / f"node{ctx.rank}")
    lock = RunLock("run")
    if ctx.rank == 0:
        lock.acquire()
    with pytest.raises(CheckpointError) as e:  # what claim() checks before a first write
        check_shared("run", lock.token if ctx.rank == 0 else None)
    assert str(e.value).startswith(f"out_dir run is not shared: rank 1 on "
                                   f"{socket.gethostname()} cannot see the run/.lock")
    cfg = load_config(None, ["out_dir=run", "resume=auto"]).validate(2)
    with pytest.raises(CheckpointError, match=r"not shared: rank 1 .* cannot see the "
                                              r"run/checkpoints/step_000002 "):
        chosen_checkpoint(cfg, ctx)  # what a resume checks first
    os.chdir(Path(base) / "node0")  # once every rank sees one directory, both pass
    check_shared("run", lock.token if ctx.rank == 0 else None)
    assert chosen_checkpoint(cfg, ctx) == Path("run/checkpoints/step_000002")
    lock.release()


def test_a_node_local_out_dir_is_refused_at_start_up(tmp_path):
    (tmp_path / "node1" / "run").mkdir(parents=True)
    _save(tmp_path / "node0" / "run", 2)  # a checkpoint only rank 0's node has
    run_distributed(_node_local, world=2, tp=1, args=(str(tmp_path),))


# ---------------------------------------------------------------------------
# under torchrun: an injected fault, a real kill -9, the curve of an uninterrupted run

ARGS = ["model.name=gpt-tiny", "model.seq_len=32", "data.kind=synthetic", "eval.interval=0",
        "wandb.mode=disabled", "train.log_interval=1", "train.micro_batch_size=2",
        "parallel.tp=2", "train.steps=6", "checkpoint.interval=2", "checkpoint.keep=2",
        "checkpoint.async_save=true", "resume=auto"]


def _torchrun(out: Path, fault: dict | None = None) -> subprocess.CompletedProcess:
    env = subprocess_env()
    if fault is not None:
        env["OASES_TEST_FAULT"] = json.dumps({**fault, "root": str(ckpt_root(out))})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--max-restarts=0", "--monitor-interval=0.1", "tests/support/fault_train.py", *ARGS,
           f"out_dir={out}"]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def _losses(out: Path) -> dict[int, float]:
    recs = [r for r in metrics(out) if "loss" in r]
    assert [r["step"] for r in recs] == sorted({r["step"] for r in recs})  # once each
    return {r["step"]: r["loss"] for r in recs}


@pytest.mark.slow
def test_fault_and_kill_then_resume_give_the_uninterrupted_curve(tmp_path):
    out = tmp_path / "run"
    root = ckpt_root(out)

    # disk full on rank 1 while it writes step 4 in the background: at the next save
    # (step 6, the last) every rank stops with one line and status 6; latest still names
    # step 2. Training itself went on undisturbed: its steps 1-6 are the reference curve.
    proc = _torchrun(out, {"rank": 1, "match": ["write", "step_000004.tmp/__1_0.distcp"],
                           "err": "ENOSPC"})
    text = proc.stdout + proc.stderr
    errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, text[-4000:]
    assert errors[0].startswith("error: checkpoint step_000004 could not be written (rank 1:")
    assert "No space left on device" in errors[0], errors
    assert not re.search(r'File ".*/oases/', text), text[-4000:]  # no worker traceback
    assert re.search(r"exitcode\s*:\s*6\b", text), text[-3000:]
    assert (root / "latest").read_text().strip() == step_name(2)
    uninterrupted = _losses(out)
    assert sorted(uninterrupted) == list(range(1, 7))

    # resumed, then rank 0 killed (SIGKILL) as it replaces `latest` for step 4
    proc = _torchrun(out, {"rank": 0, "match": ["rename", "latest.tmp"], "sigkill": True})
    assert proc.returncode != 0 and "resumed from" in proc.stdout, proc.stdout[-3000:]
    assert (root / "latest").read_text().strip() == step_name(2)
    assert ckpt.is_complete(root / step_name(4))  # renamed, never named by latest

    proc = _torchrun(out)  # resumed from step 2 again, to the end
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resumed from {root / step_name(2)} at step 2" in proc.stdout
    assert _losses(out) == uninterrupted  # bit-exact on CPU
    assert sorted(p.name for p in root.iterdir()) == ["latest", step_name(4), step_name(6)]
