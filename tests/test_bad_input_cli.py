"""Bad input that reached a traceback: each is one ``error:`` line with exit status 2.

One case per input, through the command a user runs (``train.py``, ``oases.prepare``,
``oases.export``), called in this process through its ``main`` (a data, plan or HF
weights case joins a process group of one, as ``python train.py`` does); only the W&B
case runs ``python train.py`` in a subprocess, with a timeout, because ``wandb.init``
starts its own service. Every case checks: status 2; stderr exactly one non-empty line,
``error: ...`` with the key facts; no traceback; the inputs unchanged and no output left
where the command failed.

W&B: no network exists here and none is needed: the run is online with no API key
(``HOME`` and W&B's directories are empty ones, the server an unused local port), which
must fail at once instead of prompting or retrying.
"""

from __future__ import annotations

import errno
import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from oases.cli import export as export_cli
from oases.cli import prepare as prepare_cli
from oases.cli import train as train_cli
from oases.errors import ConfigError
from oases.runtime import sinks
from tests.support.runs import REPO, subprocess_env
from tests.support.distributed import run_distributed

CONFIG = str(REPO / "configs" / "gpt-tiny.yaml")
COMMANDS = {"train": train_cli.main, "prepare": prepare_cli.main, "export": export_cli.main}


def train_args(ws: Path, *extra: str) -> list[str]:
    """A 1-step gpt-tiny run in ``ws/run`` on synthetic data, a world of one."""
    return ["--config", CONFIG, f"out_dir={ws / 'run'}", "parallel.tp=1", "train.steps=1",
            "train.micro_batch_size=1", "model.seq_len=16", "eval.interval=0",
            "data.kind=synthetic", "data.val_path=", "wandb.mode=disabled", "resume=none",
            *extra]


def token_file(path: Path, n: int = 2000) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (np.arange(n) % 256).astype("<u2").tofile(path)
    return path


def tokens_args(ws: Path, path: Path) -> list[str]:
    return train_args(ws, "data.kind=tokens", f"data.train_path={path}")


def _world_of_one(mp: pytest.MonkeyPatch) -> None:
    """What ``python train.py`` sets for a world of one (``mp`` restores it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(port)).items():
        mp.setenv(k, v)
    mp.delenv("TORCHELASTIC_RUN_ID", raising=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A run directory with one checkpoint (gpt-tiny, 1 step), trained in this process."""
    ws = tmp_path_factory.mktemp("trained")
    mp = pytest.MonkeyPatch()
    try:
        _world_of_one(mp)
        assert train_cli.main(train_args(ws)) == 0
    finally:
        mp.undo()
    return ws / "run"


# ---------------------------------------------------------------------------
# the cases: setup(ws, monkeypatch, checkpoint) -> dict(command, args, needles[, watch,
# absent, subprocess, env]); watch: paths whose content must not change; absent: paths
# the failed command must not leave behind

CASES: dict[str, Callable] = {}


def case(fn: Callable) -> Callable:
    CASES[fn.__name__] = fn
    return fn


@case
def timeout_s_inf(ws, mp, ck):
    return dict(command="train", args=train_args(ws, "parallel.timeout_s=inf"),
                needles=["parallel.timeout_s=inf must be a number of seconds in (0, 1e+08]"],
                absent=[ws / "run"])


@case
def config_file_not_utf8(ws, mp, ck):
    cfg = ws / "latin1.yaml"
    cfg.write_bytes("# caf\xe9\ntrain:\n  steps: 1\n".encode("latin-1"))
    args = train_args(ws)
    args[1] = str(cfg)
    return dict(command="train", args=args, needles=[str(cfg), "is not UTF-8 text",
                                                     "byte 0xe9 at offset 5"])


@case
def hf_config_value_not_a_number(ws, mp, ck):
    d = ws / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": "two", "n_embd": 32, "n_head": 2,
         "vocab_size": 256, "n_positions": 64}))
    return dict(command="train", args=train_args(ws, f"model.init_from=hf:{d}"),
                needles=[f"init_from hf:{d}", "config.json's n_layer=\"two\" is not an integer"])


@case
def hf_index_names_a_file_outside_its_directory(ws, mp, ck):
    d = ws / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 256,
         "n_positions": 64}))
    outside = ws / "elsewhere.safetensors"
    outside.write_bytes(b"\0" * 64)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"transformer.wte.weight": str(outside)}}))
    return dict(command="train", args=train_args(ws, f"model.init_from=hf:{d}"),
                needles=[f"init_from hf:{d}", f"transformer.wte.weight in '{outside}'",
                         f"outside {d}"], pg=True)


@case
def plan_file_tp_not_an_integer(ws, mp, ck):
    plan = ws / "plan.yaml"
    plan.write_text("degrees: [1, 1, 1, 1, 1, 1, 1, 1]\ntp: abc\n")
    return dict(command="train", args=train_args(ws, f"parallel.plan={plan}"),
                needles=[f"plan file {plan}: tp must be an integer >= 1, got 'abc'"], pg=True)


@case
def megatron_idx_shorter_than_its_header(ws, mp, ck):
    token_file(ws / "mega" / "corpus.bin", 8)
    idx = ws / "mega" / "corpus.idx"
    idx.write_bytes(b"MMIDIDX\x00\x00\x01\x00")  # the magic, then 2 of 25 header bytes
    return dict(command="train", args=tokens_args(ws, ws / "mega" / "corpus"),
                needles=[f"{idx} is truncated: 11 bytes", "34-byte Megatron index header"],
                pg=True)


def _meta_case(ws, shards, *needles):
    token_file(ws / "c" / "train.bin")
    meta = ws / "c" / "meta.json"
    meta.write_text(json.dumps({"dtype": "uint16", "shards": shards}))
    return dict(command="train", args=tokens_args(ws, ws / "c" / "train"),
                needles=[f"{meta}: ", *needles], pg=True)


@case
def meta_json_shards_a_string(ws, mp, ck):
    return _meta_case(ws, "train.bin", "'shards' must map each split", "a str \"train.bin\"")


@case
def meta_json_shards_a_list_of_strings(ws, mp, ck):
    return _meta_case(ws, ["train.bin", "val.bin"], "'shards' must map each split",
                      "a list of str")


@case
def meta_json_shard_outside_its_directory(ws, mp, ck):
    outside = token_file(ws / "secret.bin")
    return _meta_case(ws, {"train": [{"file": str(outside), "tokens": 2000}]},
                      f"shard file '{outside}' is outside {ws / 'c'}")


@case
def meta_json_shard_up_out_of_its_directory(ws, mp, ck):
    token_file(ws / "secret.bin")
    return _meta_case(ws, {"train": [{"file": "../secret.bin"}]},
                      "shard file '../secret.bin' is outside")


def _text(ws: Path) -> Path:
    src = ws / "in.txt"
    src.write_text("one\n\ntwo\n\nthree\n")
    return src


@case
def prepare_split_on_a_bad_escape(ws, mp, ck):
    return dict(command="prepare", args=["--input", str(_text(ws)), "--out", str(ws / "out"),
                                         "--split-on", "\\x"],
                needles=["--split-on '\\x' has a bad escape"], absent=[ws / "out"])


@case
def prepare_bos_not_an_id(ws, mp, ck):
    return dict(command="prepare", args=["--input", str(_text(ws)), "--out", str(ws / "out"),
                                         "--bos", "abc"],
                needles=["--bos abc is not auto, none or a token id"], absent=[ws / "out"])


@case
def prepare_corrupt_jsonl_zst(ws, mp, ck):
    zstd = pytest.importorskip("zstandard")
    raw = bytearray(zstd.ZstdCompressor().compress(
        "".join(json.dumps({"text": f"document {i} " * 20}) + "\n"
                for i in range(2000)).encode()))
    raw[len(raw) // 3:len(raw) // 3 + 64] = bytes(b ^ 0xFF for b in
                                                  raw[len(raw) // 3:len(raw) // 3 + 64])
    src = ws / "c.jsonl.zst"
    src.write_bytes(bytes(raw))
    return dict(command="prepare", args=["--input", str(src), "--out", str(ws / "out")],
                needles=[f"{src}: cannot decompress: zstd decompress error"],
                absent=[ws / "out"])


@case
def prepare_broken_parquet_row_group(ws, mp, ck):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    src = ws / "c.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(600)]}), src,
                   row_group_size=100, compression="none")
    start = pq.ParquetFile(src).metadata.row_group(2).column(0).data_page_offset
    raw = bytearray(src.read_bytes())
    raw[start:start + 64] = b"\xab" * 64  # the page header of row group 2
    src.write_bytes(bytes(raw))
    return dict(command="prepare", args=["--input", str(src), "--out", str(ws / "out")],
                needles=[f"{src}: row group 2 of 6 cannot be read"], absent=[ws / "out"])


@case
def prepare_truncated_arrow_file(ws, mp, ck):
    datasets = pytest.importorskip("datasets")
    saved = ws / "saved"
    datasets.Dataset.from_dict({"text": [f"document {i} " * 20 for i in range(600)]}
                               ).save_to_disk(str(saved))
    whole = next(saved.glob("*.arrow")).read_bytes()
    src = ws / "c.arrow"
    src.write_bytes(whole[:len(whole) // 2])
    return dict(command="prepare", args=["--input", str(src), "--out", str(ws / "out")],
                needles=[f"HF dataset {src} cannot be read"], absent=[ws / "out"])


@case
def export_to_an_unwritable_destination(ws, mp, ck):
    """/proc/self: nobody, root included, creates a directory there."""
    return dict(command="export", args=[str(ck), "--to-hf", "/proc/self/hf",
                                        "--tokenizer", "none"],
                needles=["--to-hf /proc/self/hf cannot be created"])


@case
def export_to_a_full_destination(ws, mp, ck):
    """The disk fills while model.safetensors is written (its first tensor's bytes)."""
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.writes += 1
            if self.writes > 1:  # the header went through
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

    mp.setattr(export_cli, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    out = ws / "hf"
    return dict(command="export", args=[str(ck), "--to-hf", str(out), "--tokenizer", "none"],
                needles=[f"cannot write --to-hf {out}: No space left on device"], absent=[out])


@case
def wandb_online_without_a_key(ws, mp, ck):
    home = ws / "home"
    home.mkdir()
    with socket.socket() as s:  # a port nothing listens on: no W&B server, no network
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HOME": str(home), "WANDB_CONFIG_DIR": str(home), "WANDB_CACHE_DIR": str(home),
           "WANDB_DATA_DIR": str(home), "WANDB_BASE_URL": f"http://127.0.0.1:{port}",
           "WANDB_INIT_TIMEOUT": "20"}
    return dict(command="train", args=train_args(ws, "wandb.mode=online"), subprocess=True,
                env=env, needles=["wandb.mode=online: W&B did not start", "wandb login"])


def _digest(paths: list[Path]) -> dict:
    out = {}
    for root in paths:
        for p in [root, *sorted(root.rglob("*"))] if root.is_dir() else [root]:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


# the case that starts train.py (and W&B) in a process of its own is in the slow tier
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n == "wandb_online_without_a_key" else n
    for n in CASES])
def test_bad_input_is_one_line_and_exit_2(name, tmp_path, monkeypatch, capsys, request):
    ck = request.getfixturevalue("checkpoint") if name.startswith("export_") else None
    c = CASES[name](tmp_path, monkeypatch, ck)
    inputs = sorted(tmp_path.iterdir()) + ([ck] if ck else [])
    before = _digest(inputs)
    capsys.readouterr()  # what making the inputs printed
    if c.get("subprocess"):
        env = {k: v for k, v in subprocess_env().items()
               if k not in ("WANDB_API_KEY", "NETRC", "WANDB_MODE")}
        proc = subprocess.run([sys.executable, "train.py", *c["args"]], cwd=REPO,
                              env={**env, **c["env"]}, capture_output=True, text=True,
                              timeout=120)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    else:
        if c.get("pg"):
            _world_of_one(monkeypatch)
        rc = COMMANDS[c["command"]](c["args"])
        out, err = capsys.readouterr()
    text = f"exit {rc}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
    assert rc == 2, text
    assert "Traceback" not in out + err, text
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    for needle in c["needles"]:
        assert needle in lines[0], (needle, lines[0])
    assert _digest(inputs) == before, "a failed command changed its inputs"
    new = {p.name for p in tmp_path.iterdir()} - {p.name for p in inputs}
    assert new <= ({"run"} if c["command"] == "train" else set()), f"left behind: {new}"
    for p in c.get("absent", []):
        assert not p.exists(), f"{p} left behind"


def _failing_sink(*args, **kwargs):
    raise ConfigError("wandb.mode=online: W&B did not start (UsageError: no key)")


def _open_wandb_body(ctx, results: str):
    """Rank 0's W&B fails; every rank must raise the ConfigError at the same all-reduce."""
    sinks.WandbSink = _failing_sink
    cfg = type("W", (), {"mode": "online"})()
    try:
        sinks.open_wandb(cfg, results, None, False, "", ctx.rank == 0, torch.device("cpu"))
    except ConfigError as e:
        Path(results, f"rank{ctx.rank}").write_text(str(e))


def test_wandb_that_does_not_start_stops_every_rank_alike(tmp_path):
    """Rank 0's failure reaches the other ranks (one all-reduce) as the same ConfigError,
    so under torchrun they wait for rank 0's line instead of reporting a dead peer."""
    run_distributed(_open_wandb_body, world=2, tp=1, args=(str(tmp_path),))
    assert (tmp_path / "rank0").read_text().endswith("(UsageError: no key)")
    assert (tmp_path / "rank1").read_text() == "wandb.mode=online: W&B did not start on rank 0"
