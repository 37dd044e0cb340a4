"""The checkpoint directory: pruning, which checkpoint a resume takes, the saves in flight
on every way out of the loop, one run per out_dir, an out_dir every rank sees.

In-process (a world of one, :mod:`tests.support.single_world`), through the trainer's own loop
(``trainer.train``) where the behaviour is the loop's:

* pruning orders steps as integers (``step_1000000`` after ``step_999999``) and removes
  only checkpoints older than the one just published (``keep=1`` with a stray newer
  directory keeps the published one); ``keep=1`` with async saves is refused;
* ``latest`` missing or naming an unreadable checkpoint: the newest complete one is
  resumed, with one line, and ``metrics.jsonl`` is trimmed to it (not emptied);
* an async save in flight is published when the loop ends by a non-finite stop, Ctrl-C
  or an OSError; the saver's group and its wait have the run's timeout;
* a second run in a locked out_dir exits 2 naming the holder's host and pid, writing
  nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs

from oases.config import load_config
from oases.errors import CheckpointError, CheckpointWriteError, ConfigError, NonFiniteError
from oases.runtime import checkpoint as ckpt
from oases.runtime import run as run_module
from oases.runtime import trainer
from oases.runtime.ckpt_files import ckpt_root, step_name
from oases.runtime.run_dir import RunLock
from tests.support.single_world import world_of_one
from tests.support.torchrun_procs import metrics

TINY = ["model.name=gpt-tiny", "model.seq_len=16", "model.n_layer=1", "data.kind=synthetic",
        "eval.interval=0", "wandb.mode=disabled", "train.log_interval=1",
        "train.micro_batch_size=1"]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    with world_of_one(tmp_path_factory.mktemp("world")) as c:
        yield c


def _cfg(out: Path, *extra: str):
    return load_config(None, [*TINY, f"out_dir={out}", *extra]).validate(1).freeze()


def _train(out: Path, ctx, *extra: str) -> None:
    cfg = _cfg(out, *extra)
    trainer.check_out_dir(cfg)
    trainer.train(cfg, ctx)


def _tiny_save(out: Path, step: int, ctx, keep: int) -> Path:
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    return ckpt.save(str(out), step, model, opt, ctx, {"step": step, "data": {"consumed": 0}},
                     {}, keep=keep)


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in ckpt_root(out).iterdir())


# ---------------------------------------------------------------------------
# pruning


def test_pruning_orders_steps_as_integers(ctx, tmp_path):
    for step in (999_998, 999_999, 1_000_000):
        _tiny_save(tmp_path, step, ctx, keep=2)
    assert _names(tmp_path) == ["latest", step_name(1_000_000), step_name(999_999)]
    assert ckpt.latest_checkpoint(str(tmp_path)) == ckpt_root(tmp_path) / "step_1000000"


def test_keep_1_with_a_stray_newer_directory_keeps_the_published_one(ctx, tmp_path):
    """A crash between the rename and latest's replacement left step 5 unnamed; the run
    resumed from step 2 and now saves step 3 with keep=1."""
    _tiny_save(tmp_path, 2, ctx, keep=1)
    _tiny_save(tmp_path, 5, ctx, keep=1)
    (ckpt_root(tmp_path) / "latest").write_text(step_name(2) + "\n")  # the crash's state
    _tiny_save(tmp_path, 3, ctx, keep=1)
    assert _names(tmp_path) == ["latest", step_name(3), step_name(5)]
    assert ckpt.latest_checkpoint(str(tmp_path)) == ckpt_root(tmp_path) / step_name(3)


def test_keep_1_with_async_saves_is_refused():
    with pytest.raises(ConfigError, match="checkpoint.keep=1 with checkpoint.async_save=true"):
        load_config(None, ["checkpoint.async_save=true", "checkpoint.keep=1"]).validate(1)
    load_config(None, ["checkpoint.async_save=true", "checkpoint.keep=2"]).validate(1)


# ---------------------------------------------------------------------------
# which checkpoint a resume takes


@pytest.fixture(scope="module")
def run4(ctx, tmp_path_factory) -> Path:
    """A run of 4 steps with checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("run4") / "run"
    _train(out, ctx, "train.steps=4", "checkpoint.interval=2")
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


@pytest.mark.parametrize("damage", ["no-latest", "empty-meta", "truncated-metadata",
                                    "latest-names-missing"])
def test_resume_falls_back_to_the_newest_complete_checkpoint(damage, run4, ctx, tmp_path,
                                                             capsys):
    out = _copy(run4, tmp_path / "run")
    root = ckpt_root(out)
    if damage == "no-latest":
        (root / "latest").unlink()
        fallback = 4
    elif damage == "empty-meta":  # a power loss where fsync is not honoured
        (root / step_name(4) / "meta.json").write_text("")
        fallback = 2
    elif damage == "truncated-metadata":
        (root / step_name(4) / ".metadata").write_bytes(b"\x80")
        fallback = 2
    else:
        (root / "latest").write_text(step_name(6) + "\n")
        fallback = 4
    capsys.readouterr()
    _train(out, ctx, "train.steps=5", "checkpoint.interval=0", "resume=auto")
    said = capsys.readouterr().out
    notes = [ln for ln in said.splitlines() if ln.startswith("resume: ")]
    assert len(notes) == 1 and notes[0].endswith(
        f"resuming from the newest complete checkpoint {root / step_name(fallback)}"), said
    assert f"resumed from {root / step_name(fallback)} at step {fallback}" in said
    # metrics.jsonl trimmed to the checkpoint and continued, never emptied
    assert [r["step"] for r in metrics(out) if "loss" in r] == list(range(1, 6))
    assert [r["loss"] for r in metrics(out)][:fallback] == \
        [r["loss"] for r in metrics(run4)][:fallback]


def test_no_complete_checkpoint_at_all_is_an_error(run4, ctx, tmp_path):
    out = _copy(run4, tmp_path / "run")
    for step in (2, 4):
        (ckpt_root(out) / step_name(step) / "meta.json").unlink()
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(CheckpointError, match=r"partial or missing .*, and no other checkpoint "
                                              r"in .* is complete; move .* away"):
        _train(out, ctx, "train.steps=5", "resume=auto")
    assert (out / "metrics.jsonl").read_text() == before


# ---------------------------------------------------------------------------
# the save in flight on every way out of the loop


class _SlowWrite:
    """DCP's file writes wait for ``release`` (at most 30 s): a background save is still
    in flight when the loop ends."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        real = dcp_fs._write_files_from_queue

        def slow(*args, **kw):
            self.release.wait(30)
            return real(*args, **kw)
        monkeypatch.setattr(dcp_fs, "_write_files_from_queue", slow)


@pytest.mark.parametrize("exit_by", ["nonfinite", "ctrl-c", "oserror"])
def test_the_save_in_flight_is_published_on_the_way_out(exit_by, ctx, tmp_path, monkeypatch):
    slow = _SlowWrite(monkeypatch)
    real_step, calls = run_module.train_step, []

    def step(state, batches, lr):
        calls.append(lr)
        loss, norm = real_step(state, batches, lr)
        if len(calls) == 2:  # the loop ends while step 1's checkpoint is being written
            threading.Timer(0.5, slow.release.set).start()
            if exit_by == "ctrl-c":
                raise KeyboardInterrupt
            if exit_by == "oserror":
                raise OSError(5, "Input/output error", "metrics.jsonl")
            return float("nan"), norm
        return loss, norm
    monkeypatch.setattr(run_module, "train_step", step)  # the step Run.step takes
    want = {"nonfinite": NonFiniteError, "ctrl-c": KeyboardInterrupt, "oserror": OSError}
    with pytest.raises(want[exit_by]) as e:
        _train(tmp_path, ctx, "train.steps=4", "checkpoint.interval=1",
               "checkpoint.async_save=true")
    assert _names(tmp_path) == ["latest", step_name(1)]
    assert ckpt.latest_checkpoint(str(tmp_path)) == ckpt_root(tmp_path) / step_name(1)
    if exit_by == "nonfinite":  # the line names the checkpoint just published
        assert f"last checkpoint: {ckpt_root(tmp_path) / step_name(1)}" in str(e.value)


def test_the_saver_has_the_runs_timeout(ctx, tmp_path, monkeypatch):
    """``AsyncSaver(timeout_s)``: its process group's timeout, and the longest wait for a
    background write (here one that never completes)."""
    made = []
    real_group = dist.new_group
    monkeypatch.setattr(dist, "new_group",
                        lambda *a, **kw: made.append(kw) or real_group(*a, **kw))
    never: Future = Future()
    monkeypatch.setattr(dcp, "async_save", lambda *a, **kw: never)  # what the saver calls
    saver = ckpt.AsyncSaver(0.2)
    model = torch.nn.Linear(2, 2)
    saver.save(str(tmp_path), 1, model, torch.optim.Adam(model.parameters()), ctx,
               {"step": 1, "data": {}}, {})
    assert made[0]["timeout"].total_seconds() == 0.2
    raised = []
    waiter = threading.Thread(target=lambda: raised.append(_raises(saver.wait)), daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "the wait for the background write has no timeout"
    assert isinstance(raised[0], CheckpointWriteError), raised
    assert "did not complete within parallel.timeout_s=0.2" in str(raised[0])
    assert _names(tmp_path) == []  # the unfinished save's directory removed; no latest


def _raises(fn):
    try:
        fn()
    except BaseException as e:
        return e
    return None


# ---------------------------------------------------------------------------
# one run per out_dir (an out_dir every rank sees: tests/test_checkpoint_faults.py)


def test_a_second_run_in_a_locked_out_dir_exits_2_naming_the_holder(run4, tmp_path, run_single):
    out = _copy(run4, tmp_path / "run")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    held = RunLock(out)
    held.acquire()  # the first run, still going
    try:
        proc = run_single([*TINY, f"out_dir={out}", "train.steps=6", "resume=auto"])
    finally:
        held.release()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: out_dir {out} is in use by another run (host "
                     f"{socket.gethostname()}, pid {os.getpid()}); wait for it to end, stop "
                     f"it, or choose another out_dir"], proc.stderr
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before  # nothing written: metrics.jsonl and checkpoints untouched


def test_checkpoint_meta_records_what_a_resume_checks(run4):
    meta = json.loads((ckpt_root(run4) / step_name(4) / "meta.json").read_text())
    assert meta["model"]["name"] == "gpt-tiny" and meta["model"]["n_layer"] == 1
    assert meta["corpus"] is None  # synthetic data
