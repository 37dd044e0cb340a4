"""Chat data's batches (``oases.prepare --chat`` corpora): which targets count, where
documents start, ``data.loss_on``, validation, blends, an exact resume, and the
settings refused against the kind of data. The corpora are written here, tokens and
flags by hand, in the layout prepare writes (rows of T tokens, one final pad)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from oases.config import DataConfig
from oases.errors import ConfigError, DataError
from oases.parallel.loss import IGNORE_INDEX
from oases.runtime.chat_batches import ChatFraming
from oases.runtime.data import TrainBatches, ValBatches
from oases.runtime.tokens import FLAG_COUNTS as C
from oases.runtime.tokens import FLAG_PAD as P
from oases.runtime.tokens import FLAG_START as S

VOCAB = 1000
I = IGNORE_INDEX


def write_chat(out: Path, splits: dict, seq_len: int) -> Path:
    """``splits``: split -> (ids, flags) arrays; a one-shard chat corpus with meta.json."""
    out.mkdir(parents=True, exist_ok=True)
    shards = {}
    for split, (ids, flags) in splits.items():
        np.asarray(ids, np.uint16).tofile(out / f"{split}.bin")
        np.asarray(flags, np.uint8).tofile(out / f"{split}.flags")
        shards[split] = [{"file": f"{split}.bin", "tokens": len(ids), "max_id": int(max(ids)),
                          "docs": 0, "flags": f"{split}.flags"}]
    (out / "meta.json").write_text(json.dumps({"dtype": "uint16", "shards": shards,
                                               "chat": {"seq_len": seq_len}}))
    return out


# Two rows of T = 8 and the final pad. Row 0: conversation A (5 tokens, the last three
# assistant's), B (3 tokens, the last two). Row 1: C (6 tokens, the last three), two pads.
T = 8
IDS = [10, 11, 12, 13, 14, 20, 21, 22, 30, 31, 32, 33, 34, 35, 0, 0, 0]
FLAGS = [S, 0, C, C, C, S, C, C, S, 0, 0, C, C, C, S | P, P, S | P]


def cfg_for(path, **kw) -> DataConfig:
    return DataConfig(kind="tokens", train_path=str(path), **kw)


def all_windows(tb: TrainBatches, n: int) -> dict:
    """One epoch of single-row batches, keyed by their first token."""
    out = {}
    for _ in range(n):
        b = tb.next_batch()
        out[int(b[0][0, 0])] = b
    return out


@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_targets_and_documents(tmp_path, loss_on):
    """y is IGNORE_INDEX exactly where the next token is not counted (assistant: a
    non-assistant token; all: a pad) or starts a document (the cross-document target
    at the row's end included); documents start at the flagged tokens and positions
    restart there under data.reset_position_ids."""
    path = write_chat(tmp_path / "c", {"train": (IDS, FLAGS)}, T) / "train"
    tb = TrainBatches(cfg_for(path, loss_on=loss_on, reset_position_ids=True), T, VOCAB, 1,
                      0, 1, seed=3)
    assert tb.masked and tb.num_windows == 2
    w = all_windows(tb, 2)
    x0, y0 = w[10]
    x1, y1 = w[30]
    assert x0.tolist() == [IDS[:8]] and x1.tolist() == [IDS[8:16]]
    if loss_on == "assistant":
        assert y0.tolist() == [[I, 12, 13, 14, I, 21, 22, I]]
        assert y1.tolist() == [[I, I, 33, 34, 35, I, I, I]]
    else:
        assert y0.tolist() == [[11, 12, 13, 14, I, 21, 22, I]]
        assert y1.tolist() == [[31, 32, 33, 34, 35, I, I, I]]
    assert w[10].docs.doc.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2]]
    assert w[30].docs.doc.tolist() == [[1, 1, 1, 1, 1, 1, 2, 2]]
    assert w[10].docs.positions().tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    plain = TrainBatches(cfg_for(path), T, VOCAB, 1, 0, 1, seed=3).next_batch()
    assert plain.docs.positions() is None  # positions 0..T-1 without reset_position_ids


def test_val_counts_the_training_targets(tmp_path):
    """Val windows in order, the training data's framing (loss_on=all here), and the
    padding row of a partial batch counting nothing; a plain val file with chat training
    data is refused."""
    path = write_chat(tmp_path / "c", {"train": (IDS, FLAGS), "val": (IDS, FLAGS)}, T)
    tb = TrainBatches(cfg_for(path / "train", loss_on="all"), T, VOCAB, 1, 0, 1, 0)
    (b,) = ValBatches(path / "val", "uint16", T, VOCAB, 3, 0, 1, 4, documents=tb.documents)
    x, y = b
    assert y.tolist() == [[11, 12, 13, 14, I, 21, 22, I], [31, 32, 33, 34, 35, I, I, I], [I] * T]
    assert b.docs.doc[:2].tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1, 2, 2]]
    (b,) = ValBatches(path / "val", "uint16", T, VOCAB, 2, 0, 1, 4)  # default: assistant
    assert b[1].tolist() == [[I, 12, 13, 14, I, 21, 22, I], [I, I, 33, 34, 35, I, I, I]]
    np.asarray(IDS, np.uint16).tofile(tmp_path / "plain.bin")
    with pytest.raises(DataError, match="plain tokens but the training data is chat data"):
        ValBatches(tmp_path / "plain.bin", "uint16", T, VOCAB, 1, 0, 1, 4,
                   documents=tb.documents)


def random_chat(rng, rows: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` rows of random conversations and padding, plus the final pad."""
    ids = rng.integers(1, VOCAB, rows * seq_len + 1)
    flags = np.where(rng.random(len(ids)) < 0.5, C, 0).astype(np.uint8)
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), 3, replace=False))
        flags[r * seq_len + np.r_[0, cuts[:2]]] |= S
        flags[r * seq_len + cuts[2]:(r + 1) * seq_len] = P
        flags[r * seq_len + cuts[2]] |= S
    flags[-1] = S | P
    return ids, flags


def test_exact_resume_is_bit_identical(tmp_path):
    """A stream restored from state_dict gives the batches (tokens, targets, documents)
    the uninterrupted one gives, across an epoch boundary, at dp = 2."""
    rng = np.random.default_rng(0)
    path = write_chat(tmp_path / "c", {"train": random_chat(rng, 12, 16)}, 16) / "train"
    cfg = cfg_for(path, reset_position_ids=True)
    runs = [TrainBatches(cfg, 16, VOCAB, 2, r, 2, seed=9) for r in range(2)]
    for _ in range(4):
        for tb in runs:
            tb.next_batch()
    state = runs[0].state_dict()
    resumed = [TrainBatches(cfg, 16, VOCAB, 2, r, 2, seed=9) for r in range(2)]
    for tb in resumed:
        tb.load_state_dict(state)
    counted = 0
    for _ in range(6):  # 12 windows per epoch, 4 per global batch: crosses into epoch 2
        for a, b in zip(runs, resumed):
            ba, bb = a.next_batch(), b.next_batch()
            for u, v in zip((*ba, ba.docs.doc, ba.docs.positions()),
                            (*bb, bb.docs.doc, bb.docs.positions())):
                assert torch.equal(u, v)
            counted += int((ba[1] != I).sum())
    assert counted > 0 and runs[0].epoch > 1


def test_blends_of_chat_corpora_and_refusals(tmp_path):
    """A blend of chat corpora frames each row by its own file's flags; a blend mixing
    chat and plain tokens, reset_attention_at_eos on chat data, another seq_len and
    reset_position_ids on plain data without document ends are each one error."""
    a = write_chat(tmp_path / "a", {"train": (IDS, FLAGS)}, T) / "train"
    b = write_chat(tmp_path / "b", {"train": (IDS, FLAGS)}, T) / "train"
    np.asarray(IDS * 3, np.uint16).tofile(tmp_path / "plain.bin")
    blend = DataConfig(kind="tokens", train_paths=[{"path": str(a), "weight": 1},
                                                   {"path": str(b), "weight": 1}])
    tb = TrainBatches(blend, T, VOCAB, 4, 0, 1, seed=1)
    x, y = batch = tb.next_batch()
    assert tb.masked
    expect = {10: [I, 12, 13, 14, I, 21, 22, I], 30: [I, I, 33, 34, 35, I, I, I]}
    assert [y[r].tolist() for r in range(4)] == [expect[int(x[r, 0])] for r in range(4)]
    assert batch.docs is not None
    mixed = DataConfig(kind="tokens", train_paths=[{"path": str(a), "weight": 1},
                                                   {"path": str(tmp_path / "plain.bin"),
                                                    "weight": 1}])
    with pytest.raises(ConfigError, match="mixes chat data"):
        TrainBatches(mixed, T, VOCAB, 1, 0, 1, 0)
    with pytest.raises(ConfigError, match="reset_attention_at_eos=false"):
        TrainBatches(cfg_for(a, reset_attention_at_eos=True, eos_id=0), T, VOCAB, 1, 0, 1, 0)
    with pytest.raises(DataError, match="packed into rows of 8 tokens .* --seq-len 4"):
        TrainBatches(cfg_for(a), 4, VOCAB, 1, 0, 1, 0)
    with pytest.raises(ConfigError, match="reset_attention_at_eos=true"):
        TrainBatches(cfg_for(tmp_path / "plain.bin", reset_position_ids=True), T, VOCAB,
                     1, 0, 1, 0)
    plain = TrainBatches(cfg_for(tmp_path / "plain.bin"), T, VOCAB, 1, 0, 1, 0)
    assert not plain.masked and plain.documents is None
    with pytest.raises(ConfigError, match="data.loss_on"):
        DataConfig(loss_on="prompt").validate()


def test_framing_alone():
    """ChatFraming on one window: a target whose token starts a document never counts,
    even when flagged as counted."""
    flags = torch.tensor([[S, C, S | C, C, 0]], dtype=torch.uint8)
    x, y = torch.arange(4)[None], torch.arange(1, 5)[None]
    b = ChatFraming("assistant").batch(x, y, flags)
    assert b[1].tolist() == [[1, I, 3, I]] and b.docs.doc.tolist() == [[1, 1, 2, 2]]
