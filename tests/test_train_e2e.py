"""End to end: ``train.py`` on the shipped configs, metrics, W&B, checkpoints, resume.

gpt-tiny, the README's job, runs as users start it: ``torchrun train.py`` with 2 processes
(tp=2, dp=1) on CPU/gloo. The other runs are ``train.py``'s ``main`` on 2 forked ranks (the
``run_train`` and ``run_single`` fixtures: the same code after the imports,
tests/conftest.py); the checkpoint and resume cases start from one reference run A.
The error-exit cases run as a world of one (``parallel.tp=1``), as ``python train.py``,
whose exit status (2 for bad input) is ``main``'s; they load checkpoints written at tp=2
(DCP re-shards). All of them read the session's prepared pydoc corpus (conftest.py).

Measured on the 2-core CI machine (seed 1234, 20 steps, lr warmup 20 steps): the
byte-level loss starts at ~5.4-5.6 (ln 256 = 5.55) and reaches ~3.0 at step 20 for both
gpt-tiny and llama-tiny, so "last < first - 1.0" has a wide margin while a model that
does not learn (wrong gradients, lr never applied) stays near 5.5.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest

from oases.config import load_config
from tests.support import wandb_records
from tests.support.runs import resume_copy
from tests.support.runs import run_train as torchrun_train

pytestmark = pytest.mark.slow

STEPS = 20
TRAIN_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")


# ---------------------------------------------------------------------------
# helpers


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    """(training records, eval records) of ``out/metrics.jsonl``; every line must be JSON."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines, "metrics.jsonl is empty"
    recs = []
    for i, ln in enumerate(lines):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:  # pragma: no cover - failure message only
            raise AssertionError(f"metrics.jsonl line {i + 1} is not JSON: {ln!r} ({e})")
        assert isinstance(rec, dict) and isinstance(rec.get("step"), int), ln
        recs.append(rec)
    train = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "val_loss" in r]
    assert len(train) + len(evals) == len(recs), "a record is neither training nor eval"
    return train, evals


def by_step(recs: list[dict]) -> dict[int, dict]:
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"duplicate steps in {steps}"
    return {r["step"]: r for r in recs}


def check_train_records(train: list[dict], steps: int) -> None:
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for r in train:
        for k in TRAIN_KEYS:
            assert k in r, (k, r)
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (k, r)
        assert r["lr"] > 0 and r["grad_norm"] > 0, r
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0, r


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and directory under root: (kind, mtime_ns, size, sha256)."""
    snap = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        if p.is_dir():
            snap[str(p.relative_to(root))] = ("dir", st.st_mtime_ns)
        else:
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            snap[str(p.relative_to(root))] = ("file", st.st_mtime_ns, st.st_size, digest)
    return snap


def error_line(proc, *needles: str) -> str:
    """Bad input: exit status 2, exactly one ``error: ...`` line, no traceback."""
    out = f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2, out
    assert "Traceback" not in proc.stderr, out
    errs = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errs) == 1, out
    for n in needles:
        assert n in errs[0], (n, errs[0])
    return errs[0]


def gpt_args(out: Path, data_args: list[str], *extra: str) -> list[str]:
    return ["--config", "configs/gpt-tiny.yaml", f"out_dir={out}", f"train.steps={STEPS}",
            "train.log_interval=1", "eval.interval=10", "wandb.mode=disabled", *data_args,
            *extra]


def single(args: list[str]) -> list[str]:
    """The same run as a world of one (python train.py, no torchrun)."""
    return [*args, "parallel.tp=1"]


# ---------------------------------------------------------------------------
# the shipped configs


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_shipped_config_trains(name, tmp_path, data_args, run_train):
    """gpt-tiny, the README's job, as a user starts it (torchrun); llama-tiny on forked ranks."""
    out = tmp_path / "run"
    launch = torchrun_train if name == "gpt-tiny" else run_train
    proc = launch(["--config", f"configs/{name}.yaml", f"out_dir={out}",
                      f"train.steps={STEPS}", "train.log_interval=1", "eval.interval=10",
                      "wandb.mode=disabled", *data_args])
    # the shipped configs say resume: auto; a fresh out_dir starts at step 0
    assert "no checkpoint" in proc.stdout and "starting from step 0" in proc.stdout
    assert "world 2 = dp 1 x tp 2" in proc.stdout

    train, evals = read_metrics(out)
    check_train_records(train, STEPS)
    first, last = train[0]["loss"], train[-1]["loss"]
    assert 5.0 < first < 6.0, first  # ~ln(256) for an untrained byte-level model
    assert last < first - 1.0, (first, last)
    assert [r["lr"] for r in train] == sorted(r["lr"] for r in train)  # warmup: rising lr
    assert [r["step"] for r in evals] == [10, 20]
    assert all(math.isfinite(r["val_loss"]) for r in evals)
    assert evals[1]["val_loss"] < evals[0]["val_loss"] < first

    cfg = load_config(str(out / "config.yaml"))
    assert cfg.model.name == name and cfg.train.steps == STEPS and cfg.out_dir == str(out)
    assert cfg.parallel.tp == 2 and cfg.eval.interval == 10 and cfg.wandb.mode == "disabled"
    cfg.validate(2)

    root = out / "checkpoints"
    name_ = (root / "latest").read_text().strip()
    assert name_ == "step_000020"
    ck = root / name_
    assert (ck / ".metadata").is_file()
    assert {p.name for p in (ck / "rng").iterdir()} == {"rank0.pt", "rank1.pt"}
    meta = json.loads((ck / "meta.json").read_text())
    assert meta["step"] == STEPS and meta["tp"] == 2 and meta["world_size"] == 2
    assert meta["model_shape"]["n_layer"] == cfg.model.n_layer
    assert meta["data"]["consumed"] == STEPS * cfg.global_batch_size
    assert not list(root.glob("*.tmp")), "a save left a .tmp behind"
    assert f"saved checkpoint {ck}" in proc.stdout


def test_wandb_offline(tmp_path, data_args, run_train):
    """Real offline W&B records of a run preempted after step 4 whose step-4 checkpoint
    never landed: the resumed attempt replays 3 and 4 from step 2's checkpoint. Each
    attempt is an offline run of its own (synced together), and over both each step is
    logged once, with the values of metrics.jsonl."""
    out = tmp_path / "run"
    wb = tmp_path / "wandb-home"
    env = {"WANDB_CONFIG_DIR": str(wb / "config"), "WANDB_CACHE_DIR": str(wb / "cache"),
           "WANDB_DATA_DIR": str(wb / "data"),
           # wandb.init waits 30 s for its service process by default: too short on a
           # loaded 2-core CI machine (the run then dies in wandb.init, exit status 1)
           "WANDB__SERVICE_WAIT": "300", "WANDB_INIT_TIMEOUT": "300"}
    extra = ("train.steps=4", "eval.interval=0", "wandb.mode=offline", "checkpoint.interval=2")
    run_train(gpt_args(out, data_args, *extra), env=env)
    b = resume_copy(out, tmp_path / "b")  # preempted before step 4's save
    run_train(gpt_args(b, data_args, *extra, "train.steps=5", "resume=auto"), env=env)
    runs = sorted((b / "wandb").glob("offline-run-*"))  # the first attempt's came with the copy
    assert len(runs) == 2, list((b / "wandb").iterdir())
    run_id = json.loads((b / "wandb_run.json").read_text())["id"]
    assert run_id and all(r.name.endswith(f"-{run_id}") for r in runs)
    logs = [next(r.glob("run-*.wandb")) for r in runs]
    train, _ = read_metrics(b)
    check_train_records(train, 5)
    # the offline records: grouped keys, each group against its own step, jsonl's values
    hist = [h for log in logs for h in wandb_records.history(log)]
    assert [h["eval/step"] for h in hist if "eval/loss" in h] == [4, 5]  # final evaluations
    hist = [h for h in hist if "train/step" in h]
    assert [h["train/step"] for h in hist] == [1, 2, 3, 4, 5]
    for h, r in zip(hist, train):  # the replay is exact; its timings are not the first's
        assert (h["train/loss"], h["train/grad_norm"]) == (r["loss"], r["grad_norm"])
        if r["step"] not in (3, 4):
            assert h["perf/tokens_per_s"] == r["tokens_per_s"]
            assert h["perf/tp_comm_hidden_frac"] == r["tp_comm_hidden_frac"]
    assert wandb_records.step_metrics(logs[0])["perf/*"] == "perf/step"


# ---------------------------------------------------------------------------
# checkpoint / resume, all from one reference run A


@pytest.fixture(scope="module")
def run_a(tmp_path_factory, data_args, run_train):
    """gpt-tiny with dropout (so the restored RNG matters), 20 steps, a checkpoint
    every 10 steps (keep=2: step_000010 and step_000020 stay)."""
    out = tmp_path_factory.mktemp("run_a") / "a"
    args = gpt_args(out, data_args, "model.dropout=0.1", "checkpoint.interval=10")
    run_train(args)
    root = out / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_000020"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000010", "step_000020"]
    return out, args


def copy_run(run_a, dest: Path) -> tuple[Path, list[str]]:
    """A copy of run A's out_dir, and A's arguments pointed at it."""
    a, args = run_a
    shutil.copytree(a, dest)
    return dest, [f"out_dir={dest}" if x.startswith("out_dir=") else x for x in args]


def test_resume_after_crash_is_exact(run_a, tmp_path, run_train):
    a, _ = run_a
    b, args = copy_run(run_a, tmp_path / "b")
    # simulate a crash a few steps after the step-10 checkpoint: latest names step 10,
    # step 20 was never written, metrics.jsonl has records past step 10 (incl. a bogus one)
    root = b / "checkpoints"
    (root / "latest").write_text("step_000010\n")
    shutil.rmtree(root / "step_000020")
    metrics = b / "metrics.jsonl"
    kept = [ln for ln in metrics.read_text().splitlines() if json.loads(ln)["step"] <= 13]
    kept.append(json.dumps({"step": 15, "loss": 999.0, "lr": 1.0, "grad_norm": 1.0,
                            "tokens_per_s": 1.0, "step_time_s": 1.0}))
    metrics.write_text("".join(ln + "\n" for ln in kept))

    proc = run_train([*args, "resume=auto"])
    assert f"resumed from {root / 'step_000010'} at step 10" in proc.stdout

    train_a, eval_a = read_metrics(a)
    train_b, eval_b = read_metrics(b)
    check_train_records(train_b, STEPS)  # steps 1..20 once each: 11..15 and the bogus 15 trimmed
    assert all(r["loss"] != 999.0 for r in train_b)
    for ra, rb in zip(train_a, train_b):
        for k in ("step", "loss", "grad_norm", "lr"):
            assert ra[k] == rb[k], (k, ra, rb)  # bit-exact: CPU + gloo are deterministic
    assert [(r["step"], r["val_loss"]) for r in eval_b] == \
        [(r["step"], r["val_loss"]) for r in eval_a]
    assert (root / "latest").read_text().strip() == "step_000020"
    assert json.loads((root / "step_000020" / "meta.json").read_text())["step"] == 20


def test_resume_none_refuses_a_run(run_a, tmp_path, run_single):
    b, args = copy_run(run_a, tmp_path / "b")
    before = snapshot(b)
    proc = run_single(single([*args, "resume=none"]))
    assert proc.returncode != 0
    line = error_line(proc, "already holds a run", str(b), "resume=auto")
    assert "metrics.jsonl" in line and "checkpoints" in line
    assert snapshot(b) == before, "a refused run modified the out_dir"


def test_stale_tmp_checkpoint_is_ignored(run_a, tmp_path, run_single):
    # a crash mid-save of step 30 left step_000030.tmp (even with a meta.json and a
    # .metadata in it); latest still names the complete step_000020
    b, args = copy_run(run_a, tmp_path / "b")
    root = b / "checkpoints"
    tmp = root / "step_000030.tmp"
    (tmp / "rng").mkdir(parents=True)
    (tmp / "meta.json").write_text("{not json")
    (tmp / ".metadata").write_bytes(b"\x00junk")
    (tmp / "__0_0.distcp").write_bytes(b"junk" * 100)

    proc = run_single(single([*args, "resume=auto", "train.steps=22"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from {root / 'step_000020'} at step 20" in proc.stdout
    train, _ = read_metrics(b)
    check_train_records(train, 22)
    # the next save cleaned up the stale .tmp, moved latest, and pruned to keep=2
    assert not tmp.exists()
    assert (root / "latest").read_text().strip() == "step_000022"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000020", "step_000022"]


@pytest.mark.parametrize("how", ["missing", "partial"])
def test_no_complete_checkpoint_is_an_error(how, run_a, tmp_path, run_single):
    """``latest`` names a missing or partial checkpoint and no other is complete (with
    one that is, resume=auto takes it: tests/test_checkpoint_dir.py)."""
    b, args = copy_run(run_a, tmp_path / "b")
    root = b / "checkpoints"
    if how == "missing":
        (root / "latest").write_text("step_000099\n")
        bad = root / "step_000099"
    else:  # the directory is there but DCP's .metadata never got written
        bad = root / "step_000020"
    for step in ("step_000010", "step_000020"):
        (root / step / ".metadata").unlink()
    metrics_before = (b / "metrics.jsonl").read_bytes()
    proc = run_single(single([*args, "resume=auto"]))
    error_line(proc, str(bad), "partial or missing", "no other checkpoint")
    assert (b / "metrics.jsonl").read_bytes() == metrics_before  # never silently restarted


def test_resume_into_another_model_shape_is_an_error(run_a, tmp_path, run_single):
    b, args = copy_run(run_a, tmp_path / "b")
    proc = run_single(single([*args, "resume=auto", "model.n_layer=2"]))
    error_line(proc, str(b / "checkpoints" / "step_000020"), "model shape", "n_layer: 4 -> 2")


def test_complete_run_exits_zero(run_a, tmp_path, run_single):
    b, args = copy_run(run_a, tmp_path / "b")
    metrics_before = (b / "metrics.jsonl").read_bytes()
    ckpts_before = sorted(p.name for p in (b / "checkpoints").iterdir())
    proc = run_single(single([*args, "resume=auto"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"the run in {b} is complete (step 20/20)" in proc.stdout
    assert (b / "metrics.jsonl").read_bytes() == metrics_before
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ckpts_before


def test_resume_drops_a_torn_metrics_line(run_a, tmp_path, run_single):
    """A crash while appending to metrics.jsonl leaves a torn last line; resuming must
    drop it like any other record past the checkpoint, not fail on it."""
    b, args = copy_run(run_a, tmp_path / "b")
    root = b / "checkpoints"
    (root / "latest").write_text("step_000010\n")
    shutil.rmtree(root / "step_000020")
    metrics = b / "metrics.jsonl"
    kept = [ln for ln in metrics.read_text().splitlines() if json.loads(ln)["step"] <= 12]
    metrics.write_text("".join(ln + "\n" for ln in kept) + '{"step": 13, "loss": 3.9')
    # steps=10: load step 10, trim the metrics, report the run complete
    proc = run_single(single([*args, "resume=auto", "train.steps=10"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "is complete" in proc.stdout
    train, evals = read_metrics(b)
    check_train_records(train, 10)
    assert [r["step"] for r in evals] == [10]


def test_resume_auto_without_checkpoint_restarts_metrics(run_a, tmp_path, run_single):
    """A crash before the first checkpoint leaves metrics.jsonl but no checkpoints/.
    resume=auto (the shipped configs' default) starts again from step 0; it must not
    append a second copy of steps 1.. to the old records (or, alternatively, refuse)."""
    b, args = copy_run(run_a, tmp_path / "b")
    shutil.rmtree(b / "checkpoints")
    metrics = b / "metrics.jsonl"
    kept = [ln for ln in metrics.read_text().splitlines() if json.loads(ln)["step"] <= 9]
    metrics.write_text("".join(ln + "\n" for ln in kept))
    proc = run_single(single([*args, "resume=auto", "train.steps=3", "eval.interval=0"]))
    if proc.returncode != 0:  # refusing is acceptable too, as one clear line
        error_line(proc, str(b))
        return
    assert "starting from step 0" in proc.stdout
    train, evals = read_metrics(b)
    check_train_records(train, 3)  # steps 1, 2, 3 once each: no stale 4..9, no duplicates


def test_pipeline_trains_from_train_py(tmp_path, data_args, run_train):
    """train.py with parallel.pp=2 (oases engine, eager-1F1B): the loss falls as at
    pp=1, every record carries the pipeline bubble, eval runs through the stages."""
    out = tmp_path / "run"
    proc = run_train(gpt_args(out, data_args, "parallel.tp=1", "parallel.pp=2",
                              "parallel.pp_schedule=eager-1f1b", "parallel.schedule=oases",
                              "parallel.recompute=fine", "train.grad_accum=2",
                              "train.micro_batch_size=4"))
    assert "world 2 = pp 2 x dp 1 x tp 1" in proc.stdout
    assert "pipeline: stage 0: layers 0-1 dp 1 x tp 1 | stage 1: layers 2-3" in proc.stdout
    train, evals = read_metrics(out)
    check_train_records(train, STEPS)
    assert all(0.0 <= r["pipeline_bubble"] < 1.0 for r in train)
    first, last = train[0]["loss"], train[-1]["loss"]
    assert 5.0 < first < 6.0 and last < first - 1.0, (first, last)
    assert [r["step"] for r in evals] == [10, 20] and evals[1]["val_loss"] < first
    meta = json.loads((out / "checkpoints" / "step_000020" / "meta.json").read_text())
    assert meta["pp"] == 2 and meta["stages"][1]["layers"] == [2, 4]
