"""Bad input: one ``error: ...`` line naming the problem, exit status 2, no traceback,
nothing overwritten.

Every case runs ``train.py --config configs/gpt-tiny.yaml ...`` as a world of one
(``parallel.tp=1``), pointed at a copy of a small finished run (``resume=auto``), and
checks: exit status 2; stderr is exactly one non-empty line, starting with ``error:``,
holding the key fact (path, key, values); no ``Traceback``; every file and directory of
the run (mtime, size, sha256) unchanged. Config errors never start torch; data and
checkpoint errors are raised after the process group exists and still exit 2 cleanly
(also under torchrun, one case).

Each case prepares its own directory; the module fixture then runs all the cases, and
each test checks its own result. A case runs ``train.py``'s ``main`` on a rank forked from
a server that imported it (:mod:`tests.support.forked_runs`: the same code, without
~2.5 s of imports per case). One config case and one data case (``process``) start
``python train.py`` itself, so that whatever a fresh interpreter prints before ``main``
would break their one line too, and one starts ``torchrun``.

The TP-divisibility cases for heads and kv heads need a world > 1: they set
``WORLD_SIZE=4 RANK=0``, which is what each torchrun worker sees; the config is checked
before any process group is joined, so no peers are needed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch.distributed as dist

from oases.runtime import trainer
from tests.support.distributed import run_distributed
from tests.support.forked_runs import single_forked
from tests.support.runs import REPO, subprocess_env

# every case trains or starts to (two as ``python train.py``, one under torchrun)
pytestmark = pytest.mark.slow

CONFIG = str(REPO / "configs" / "gpt-tiny.yaml")


# ---------------------------------------------------------------------------
# fixtures: token files and one finished run to copy


def write_tokens(path: Path, tokens, dtype="uint16", meta: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens, dtype=np.dtype(dtype).newbyteorder("<")).tofile(path)
    if meta is not None:
        (path.parent / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    write_tokens(d / "train.bin", rng.integers(0, 256, 20_000), meta={"dtype": "uint16"})
    write_tokens(d / "val.bin", rng.integers(0, 256, 5_000))
    return d


def base_args(out: Path, data: Path, *extra: str) -> list[str]:
    return ["--config", CONFIG, f"out_dir={out}", "parallel.tp=1", "train.steps=2",
            "train.micro_batch_size=2", "model.seq_len=64", "eval.interval=0",
            "wandb.mode=disabled", f"data.train_path={data / 'train.bin'}",
            f"data.val_path={data / 'val.bin'}", "resume=auto", *extra]


def _train(ctx, args):
    from oases.config import load_config

    cfg = load_config(args[1], args[2:]).validate(ctx.world_size)
    trainer.check_out_dir(cfg)
    dist.barrier()
    trainer.train(cfg, ctx)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, data) -> Path:
    """gpt-tiny, 2 steps, a checkpoint at the end (trained in-process, world 1)."""
    out = tmp_path_factory.mktemp("bad_input") / "run"
    run_distributed(_train, world=1, tp=1, args=(base_args(out, data),))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000002"
    return out


def snapshot(root: Path) -> dict:
    snap = {".": ("dir", root.stat().st_mtime_ns)}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        rel = str(p.relative_to(root))
        snap[rel] = (("dir", st.st_mtime_ns) if p.is_dir() else
                     ("file", st.st_mtime_ns, st.st_size, hashlib.sha256(p.read_bytes()).hexdigest()))
    return snap


def error_line(proc, *needles: str) -> str:
    """Exit status 2, stderr exactly one non-empty line ``error: ...`` with every needle."""
    out = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 2, out
    assert "Traceback" not in proc.stderr + proc.stdout, out
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---------------------------------------------------------------------------
# the cases: setup(ws, run, data) -> dict(args=..., needles=..., env=..., watch=...)
#   ws: an empty directory of the case's own; run: a copy of the finished run in it
#   watch: the directory that must stay unchanged (default: run)

CASES: dict[str, Callable] = {}


def case(fn: Callable) -> Callable:
    CASES[fn.__name__] = fn
    return fn


# 1-3: the config

@case
def unknown_config_key(ws, run, data):
    return dict(args=base_args(run, data, "train.stpes=3"), kind="process",
                needles=["unknown config key 'train.stpes'", "did you mean train.steps?"])


@case
def unknown_config_key_in_yaml(ws, run, data):
    cfg = ws / "bad.yaml"
    cfg.write_text((REPO / "configs" / "gpt-tiny.yaml").read_text() + "optimizer:\n  lr: 0.1\n")
    args = base_args(run, data)
    args[1] = str(cfg)
    return dict(args=args, needles=["unknown config key 'optimizer'"])


@case
def wrong_value_type(ws, run, data):
    return dict(args=base_args(run, data, "train.steps=abc"),
                needles=["train.steps='abc'", "expected int, got str"])


@case
def tp_not_dividing_world_size(ws, run, data):
    return dict(args=base_args(run, data, "parallel.tp=2"),
                needles=["parallel.tp=2 does not divide the world size 1"])


@case
def tp_not_dividing_heads(ws, run, data):
    return dict(args=base_args(run, data, "parallel.tp=4", "model.n_head=2"),
                needles=["parallel.tp=4 does not divide model.n_head=2"],
                env={"WORLD_SIZE": "4", "RANK": "0"})


@case
def tp_not_fitting_kv_heads(ws, run, data):
    args = base_args(run, data, "parallel.tp=4", "model.d_model=96", "model.n_head=12",
                     "model.n_kv_heads=3")
    args[1] = str(REPO / "configs" / "llama-tiny.yaml")
    return dict(args=args, needles=["parallel.tp=4 neither divides model.n_kv_heads=3 nor is "
                                    "a multiple of it"],
                env={"WORLD_SIZE": "4", "RANK": "0"})


@case
def microbatches_below_pp(ws, run, data):
    return dict(args=base_args(run, data, "parallel.pp=2", "train.grad_accum=1"),
                needles=["train.grad_accum=1 micro-batches is fewer than parallel.pp=2"],
                env={"WORLD_SIZE": "2", "RANK": "0"})


def _stage_plan(ws: Path, stages: str) -> Path:
    plan = ws / "plan.yaml"
    plan.write_text(f"stages:\n{stages}")
    return plan


@case
def plan_stages_leave_a_gap(ws, run, data):
    plan = _stage_plan(ws, "  - {layers: [0, 1], dp: 1, tp: 1}\n  - {layers: [2, 4], dp: 1, tp: 1}\n")
    return dict(args=base_args(run, data, "parallel.pp=2", "train.grad_accum=2",
                               f"parallel.plan={plan}"),
                needles=[str(plan), "stage 1 has layers [2, 4)", "without gaps"],
                env={"WORLD_SIZE": "2", "RANK": "0"})


@case
def plan_stage_layout_not_world_over_pp(ws, run, data):
    plan = _stage_plan(ws, "  - {layers: [0, 2], dp: 2, tp: 1}\n  - {layers: [2, 4], dp: 1, tp: 1}\n")
    return dict(args=base_args(run, data, "parallel.pp=2", "train.grad_accum=2",
                               f"parallel.plan={plan}"),
                needles=["stage 0 has dp 2 x tp 1 = 2 ranks", "world / pp = 1"],
                env={"WORLD_SIZE": "2", "RANK": "0"})


# 4-7: the data (raised after the process group exists)

@case
def missing_data_file(ws, run, data):
    missing = ws / "nowhere" / "train.bin"
    return dict(args=base_args(run, data, f"data.train_path={missing}"), kind="process",
                needles=[f"data file {missing} does not exist", "python -m oases.prepare"])


@case
def data_file_shorter_than_one_batch(ws, run, data):
    short = write_tokens(ws / "short" / "train.bin", np.arange(100) % 256)
    return dict(args=base_args(run, data, f"data.train_path={short}"),
                needles=[str(short), "1 windows of 65 tokens", "fewer than one global micro-batch",
                         "mbs x dp = 2 x 1 = 2"])


@case
def token_id_outside_vocab(ws, run, data):
    tokens = np.arange(2000) % 256
    tokens[1234] = 300
    bad = write_tokens(ws / "big" / "train.bin", tokens)
    return dict(args=base_args(run, data, f"data.train_path={bad}"),
                needles=[str(bad), "token id 300", "vocab_size is 256"])


@case
def uint32_file_of_odd_size(ws, run, data):
    bad = write_tokens(ws / "odd" / "train.bin", np.arange(2000) % 256, dtype="uint32")
    with open(bad, "ab") as f:
        f.write(b"\x00\x00")  # 8002 bytes: not whole uint32 tokens
    return dict(args=base_args(run, data, f"data.train_path={bad}", "data.dtype=uint32"),
                needles=[str(bad), "not a uint32 token file", "size 8002 is not a multiple of 4"])


@case
def dtype_disagrees_with_meta_json(ws, run, data):
    bad = write_tokens(ws / "u32" / "train.bin", np.arange(2000) % 256, dtype="uint32",
                       meta={"dtype": "uint32"})
    return dict(args=base_args(run, data, f"data.train_path={bad}"),
                needles=[str(bad), "written as uint32", "data.dtype=uint16",
                         "set data.dtype=uint32"])


# 8: init_from

@case
def init_from_missing_directory(ws, run, data):
    return dict(args=base_args(run, data, "model.init_from=hf:/nonexistent"),
                needles=["/nonexistent", "does not exist"])


# 11-12: checkpoints

@case
def latest_names_a_partial_checkpoint(ws, run, data):
    ck = run / "checkpoints" / "step_000002"
    (ck / ".metadata").unlink()
    return dict(args=base_args(run, data), needles=[str(ck), "partial or missing"])


@case
def truncated_checkpoint_data_file(ws, run, data):
    ck = run / "checkpoints" / "step_000002"
    shard = next(ck.glob("*.distcp"))
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    return dict(args=base_args(run, data), needles=[f"checkpoint {ck} could not be loaded"])


@case
def corrupt_checkpoint_metadata(ws, run, data):
    ck = run / "checkpoints" / "step_000002"
    md = ck / ".metadata"
    md.write_bytes(md.read_bytes()[:100])
    return dict(args=base_args(run, data), needles=[f"checkpoint {ck}", "unreadable .metadata"])


@case
def resume_into_another_model_shape(ws, run, data):
    return dict(args=base_args(run, data, "model.n_layer=2", "model.d_model=64"),
                needles=[str(run / "checkpoints" / "step_000002"), "another model shape",
                         "n_layer: 4 -> 2", "d_model: 128 -> 64"])


# 14-15: out_dir

@case
def out_dir_is_a_file(ws, run, data):
    f = ws / "out.txt"
    f.write_text("not a directory\n")
    return dict(args=base_args(f, data, "resume=none"), watch=ws,
                needles=[f"out_dir {f} exists and is not a directory"])


@case
def out_dir_below_a_file(ws, run, data):
    """A path whose parent is a regular file cannot be created, even by root."""
    f = ws / "file"
    f.write_text("x")
    out = f / "run"
    return dict(args=base_args(out, data, "resume=none"), watch=ws,
                needles=[f"out_dir {out} cannot be created", f"{f} is a file"])


@case
def out_dir_not_writable(ws, run, data):
    """/proc/self: a directory in which nobody, root included, can create files (procfs;
    chmod-based tests would not stop root)."""
    return dict(args=base_args(Path("/proc/self"), data), watch=ws,
                needles=["out_dir /proc/self is not writable"])


# debug=true, and a data error under torchrun

@case
def debug_shows_the_traceback(ws, run, data):
    missing = ws / "nowhere.bin"
    return dict(args=base_args(run, data, f"data.train_path={missing}", "debug=true"),
                kind="debug")


@case
def data_error_under_torchrun(ws, run, data):
    missing = ws / "nowhere.bin"
    return dict(args=base_args(run, data, f"data.train_path={missing}", "parallel.tp=2"),
                kind="torchrun", missing=missing)


def _launch(c: dict) -> None:
    kind = c.get("kind")
    if kind in ("process", "torchrun"):
        launcher = (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
                    if kind == "torchrun" else [])
        env = {**subprocess_env(), **c.get("env", {})}
        c["proc"] = subprocess.run([sys.executable, *launcher, "train.py", *map(str, c["args"])],
                                   cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    else:
        c["proc"] = single_forked(c["args"], timeout=180, env=c.get("env"))
    c["after"] = snapshot(c["watch"])


@pytest.fixture(scope="module")
def results(finished_run, data, tmp_path_factory) -> dict[str, dict]:
    cases = {}
    for name, setup in CASES.items():
        ws = tmp_path_factory.mktemp(name)
        run = ws / "run"
        shutil.copytree(finished_run, run)
        c = {"watch": run, **setup(ws, run, data)}
        c["before"] = snapshot(c["watch"])
        cases[name] = c
    with ThreadPoolExecutor(max_workers=2) as pool:  # one process per core
        list(pool.map(_launch, cases.values()))
    return cases


@pytest.mark.parametrize("name", [n for n, f in CASES.items()
                                  if n not in ("debug_shows_the_traceback",
                                               "data_error_under_torchrun")])
def test_bad_input(name, results):
    c = results[name]
    error_line(c["proc"], *c["needles"])
    assert c["after"] == c["before"], "a failed run modified its out_dir"


def test_debug_shows_the_traceback(results):
    proc = results["debug_shows_the_traceback"]["proc"]
    assert proc.returncode not in (0, 2), proc.stderr[-3000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert re.search(r"oases\.errors\.DataError: data file \S*nowhere\.bin does not exist",
                     proc.stderr), proc.stderr[-3000:]


def test_data_error_under_torchrun_exits_2_on_every_rank(results):
    """After init_process_group: rank 0 prints the one line and exits 2 (the process
    group destroyed, no hang); rank 1, which met the same error, waits for torchrun to
    stop it rather than print it too (tests/test_error_lines.py); torchrun then reports
    the failure with status 1, rank 0's status 2 as its first."""
    c = results["data_error_under_torchrun"]
    proc = c["proc"]
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1, text[-3000:]
    errs = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert errs == [f"error: data file {c['missing']} does not exist; create it with "
                    f"`python -m oases.prepare --input FILE --out DIR`"], text[-3000:]
    assert re.search(r"Root Cause[^\n]*\n\[0\]:\n(?:.*\n){2}\s*rank\s*:\s*0\b[^\n]*\n"
                     r"\s*exitcode\s*:\s*2\b", text), text[-3000:]
    assert "DataError" not in text  # no worker traceback
    assert c["after"] == c["before"]
