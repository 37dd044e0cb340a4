"""What a checkpoint is trusted with: no code runs when it is loaded, its own model is the
one rebuilt, and a resume refuses another architecture or another corpus.

In-process (a world of one, :mod:`tests.support.single_world`), through the trainer's loop:

* an ``rng/rank0.pt`` that would create a marker file when unpickled creates nothing
  through a resume (refused: it is not plain tensors), ``generate`` (which reads no RNG
  state), ``export`` and ``consolidate``;
* a resume with another RoPE theta (or norm eps, RoPE scaling, sliding window...) is
  refused, naming the field, and ``config.yaml`` is left as it was; export and generate
  take the model section the checkpoint records, not the run's current ``config.yaml``;
* a resume that points a single ``data.train_path`` at another corpus is refused,
  naming it; the same corpus moved elsewhere resumes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from oases.cli.consolidate import consolidate
from oases.cli.export import export_checkpoint
from oases.config import load_config
from oases.errors import CheckpointError
from oases.parallel.groups import ParallelContext
from oases.runtime import checkpoint as ckpt
from oases.runtime import trainer
from oases.runtime.ckpt_files import ckpt_root, step_name
from oases.runtime.generate import checkpoint_model_config, generate, model_from_checkpoint
from oases.runtime.resume import model_section, model_shape
from tests.support.single_world import world_of_one
from tests.support.torchrun_procs import metrics

BASE = ["model.seq_len=16", "model.n_layer=1", "eval.interval=0", "wandb.mode=disabled",
        "train.log_interval=1", "train.micro_batch_size=1", "checkpoint.interval=2"]
LLAMA = ["model.name=llama-tiny", "data.kind=synthetic", *BASE]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    with world_of_one(tmp_path_factory.mktemp("world")) as c:
        yield c


def _train(out: Path, ctx, *args: str) -> None:
    cfg = load_config(None, [*args, f"out_dir={out}"]).validate(1).freeze()
    trainer.check_out_dir(cfg)
    trainer.train(cfg, ctx)


@pytest.fixture(scope="module")
def llama(ctx, tmp_path_factory) -> Path:
    """A llama-tiny run of 2 steps (RoPE theta 10000), its checkpoint at step 2."""
    out = tmp_path_factory.mktemp("llama") / "run"
    _train(out, ctx, *LLAMA, "train.steps=2")
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


# ---------------------------------------------------------------------------
# loading runs no code


class _Marker:
    """Unpickled, it creates the file ``path`` (what a hostile checkpoint could do)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant(out: Path, marker: Path) -> None:
    rng = ckpt_root(out) / step_name(2) / "rng" / "rank0.pt"
    torch.save({"cpu": _Marker(marker), "default": None, "tp": None}, rng)


def test_loading_a_checkpoint_runs_no_code(llama, ctx, tmp_path):
    out = _copy(llama, tmp_path / "run")
    marker = tmp_path / "marker"

    _plant(out, marker)
    with pytest.raises(CheckpointError, match=r"unreadable rank0\.pt"):
        _train(out, ctx, *LLAMA, "train.steps=3", "resume=auto")
    assert not marker.exists(), "resume ran the checkpoint's code"

    model, _, _ = model_from_checkpoint(out, ParallelContext.single("cpu"))
    assert len(generate(model, [[1, 2, 3]], 2).rows()[0]) == 2
    assert not marker.exists(), "generate ran the checkpoint's code"

    export_checkpoint(out, tmp_path / "hf", tokenizer="none")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    consolidate(out, tmp_path / "model.pt")
    assert not marker.exists(), "export or consolidate ran the checkpoint's code"


# ---------------------------------------------------------------------------
# the checkpoint's own model


def test_resume_refuses_another_rope_theta_naming_it(llama, ctx, tmp_path):
    out = _copy(llama, tmp_path / "run")
    config = (out / "config.yaml").read_text()
    with pytest.raises(CheckpointError, match=r"another model shape or architecture "
                                              r"\(rope_theta: 10000\.0 -> 500000\.0\)"):
        _train(out, ctx, *LLAMA, "train.steps=3", "resume=auto", "model.rope_theta=500000")
    assert (out / "config.yaml").read_text() == config  # not rewritten
    _train(out, ctx, *LLAMA, "train.steps=3", "resume=auto", "model.dropout=0.1")  # free


MISTRAL = [*LLAMA, "model.arch=mistral", "model.bias=false", "model.sliding_window=8"]


@pytest.mark.parametrize("saved,change,field", [
    (LLAMA, ["model.norm_eps=1e-6"], "norm_eps"),
    (LLAMA, ["model.rope_type=linear", "model.rope_factor=2"], "rope_type"),
    (LLAMA, ["model.rope_type=dynamic", "model.rope_factor=2"], "rope_type"),
    (LLAMA + ["model.rope_type=linear", "model.rope_factor=2"], ["model.rope_factor=4"],
     "rope_factor"),
    (LLAMA + ["model.rope_type=llama3", "model.rope_factor=8"],
     ["model.rope_low_freq_factor=2"], "rope_low_freq_factor"),
    (LLAMA + ["model.rope_type=llama3", "model.rope_factor=8"],
     ["model.rope_original_max_len=8"], "rope_original_max_len"),
    (MISTRAL, ["model.sliding_window=4"], "sliding_window"),
])
def test_every_architecture_field_is_checked(saved, change, field, tmp_path):
    """Only ``field`` differs between the checkpoint's model and the run's."""
    was = load_config(None, saved).validate(1)
    meta = {"model_shape": model_shape(was), "model": model_section(was)}
    now = load_config(None, [*saved, *change]).validate(1)
    with pytest.raises(CheckpointError, match=rf"architecture \({field}: "):
        ckpt.check_model(tmp_path, meta, model_shape(now))
    ckpt.check_model(tmp_path, meta, model_shape(was))
    free = load_config(None, [*saved, "model.dropout=0.2", "model.init_std=0.01"]).validate(1)
    ckpt.check_model(tmp_path, meta, model_shape(free))


def test_export_and_generate_take_the_checkpoints_own_model(llama, tmp_path):
    out = _copy(llama, tmp_path / "run")
    # the run's config.yaml now says something else (a later run's, or edited by hand)
    cfg = (out / "config.yaml").read_text()
    (out / "config.yaml").write_text(cfg.replace("rope_theta: 10000.0", "rope_theta: 500000.0"))
    assert "rope_theta: 500000.0" in (out / "config.yaml").read_text()
    ck = ckpt_root(out) / step_name(2)
    assert checkpoint_model_config(ck, ckpt.read_meta(ck)).rope_theta == 10000.0
    export_checkpoint(ck, tmp_path / "hf", tokenizer="none")
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["rope_theta"] == 10000.0


# ---------------------------------------------------------------------------
# the corpus a single train_path names


def _corpus(path: Path, n: int, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(seed).integers(0, 256, n).astype("<u2").tofile(path)
    return path


def test_resume_refuses_another_corpus_naming_it(ctx, tmp_path):
    a = _corpus(tmp_path / "a" / "train.bin", 4000, 0)
    b = _corpus(tmp_path / "b" / "train.bin", 6000, 1)
    tokens = ["model.name=gpt-tiny", "data.kind=tokens", "data.dtype=uint16", *BASE]
    out = tmp_path / "run"
    _train(out, ctx, *tokens, f"data.train_path={a}", "train.steps=2")
    with pytest.raises(CheckpointError, match=rf"trained on 4000 tokens in train\.bin \(8000 "
                                              rf"bytes\), no meta\.json, but data\.train_path="
                                              rf"{b} is 6000 tokens"):
        _train(out, ctx, *tokens, f"data.train_path={b}", "train.steps=3", "resume=auto")
    moved = tmp_path / "moved" / "train.bin"  # the same corpus elsewhere resumes
    moved.parent.mkdir()
    shutil.copy(a, moved)
    _train(out, ctx, *tokens, f"data.train_path={moved}", "train.steps=3", "resume=auto")
    assert [r["step"] for r in metrics(out) if "loss" in r] == [1, 2, 3]
