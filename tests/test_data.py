"""Data layer: ``python -m oases.prepare`` and ``oases.runtime.data``.

Token files here are tiny and built in the test (``np.arange`` ids make each
window identify itself by its first token), so the whole file runs in seconds
with no network.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from oases.config import DataConfig
from oases.errors import CheckpointError, DataError
from oases.runtime import data as D
from oases.runtime import tokens as TK

ROOT = Path(__file__).resolve().parents[1]

TEXT = ("Hello, wörld! Ünïcödé bytes ✓ and plain ascii.\n"
        "The quick brown fox jumps over the lazy dog.\n") * 40


def run_prepare(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oases.prepare", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def write_tokens(path: Path, ids, dtype: str = "uint16") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def tokens_cfg(path: Path, dtype: str = "uint16") -> DataConfig:
    return DataConfig(kind="tokens", train_path=str(path), dtype=dtype)


def window_ids(x: torch.Tensor, seq_len: int) -> list[int]:
    """With tokens = arange, row i of x starts at token w*T: its window is x[i,0]//T."""
    return (x[:, 0] // seq_len).tolist()


# ---------------------------------------------------------------------------
# prepare

def test_prepare_bytes_round_trip(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    r = run_prepare("--input", str(src), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and "uint16" in r.stdout

    raw = TEXT.encode("utf-8") + b"\0"  # one document, then its EOS (byte 0)
    train = np.fromfile(out / "train.bin", dtype=np.uint16)
    val = np.fromfile(out / "val.bin", dtype=np.uint16)
    assert bytes(np.concatenate([train, val]).astype(np.uint8)) == raw
    assert len(val) == round(len(raw) * 0.1)  # one document: its last tenth of tokens

    meta = json.loads((out / "meta.json").read_text())
    shard = {"tokens": len(train), "max_id": int(train.max()), "docs": 0}
    assert meta == {"vocab_size": 256, "dtype": "uint16", "tokenizer": "bytes",
                    "tokenizer_kind": "bytes", "tokenizer_sha256": None, "eos_id": 0,
                    "bos_id": None, "separator": "eos",
                    "train_tokens": len(train), "train_docs": 0,
                    "train_max_id": int(train.max()), "val_tokens": len(val), "val_docs": 1,
                    "val_max_id": int(val.max()), "documents": 1, "val_split": "tokens",
                    "shards": {"train": [{"file": "train.bin", **shard}],
                               "val": [{"file": "val.bin", "tokens": len(val),
                                        "max_id": int(val.max()), "docs": 1}]},
                    "source": [str(src.resolve())], "text_key": "text", "split_on": None}


def test_prepare_dtype_override_and_val_fraction(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    r = run_prepare("--input", str(src), "--out", str(out), "--dtype", "uint32",
                    "--val-fraction", "0.25")
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32"
    assert (out / "val.bin").stat().st_size == 4 * meta["val_tokens"]
    assert meta["val_tokens"] == round((len(TEXT.encode()) + 1) * 0.25)


def test_prepare_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer=trainer)
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))

    src = tmp_path / "in.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    r = run_prepare("--input", str(src), "--out", str(out), "--tokenizer", str(tok_path))
    assert r.returncode == 0, r.stderr

    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == str(tok_path.resolve()) and meta["tokenizer_kind"] == "hf"
    assert meta["tokenizer_sha256"] == hashlib.sha256(tok_path.read_bytes()).hexdigest()
    ids = np.concatenate([np.fromfile(out / "train.bin", dtype=np.uint16),
                          np.fromfile(out / "val.bin", dtype=np.uint16)])
    assert len(ids) == meta["train_tokens"] + meta["val_tokens"]
    assert len(ids) < len(TEXT.encode())  # merges happened: not byte-level
    assert ids[-1] == meta["eos_id"] == tok.token_to_id("<|endoftext|>")
    assert tok.decode(ids[:-1].tolist()) == TEXT


def test_prepare_refuses_overwrite(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    assert run_prepare("--input", str(src), "--out", str(out)).returncode == 0
    before = (out / "train.bin").read_bytes()

    r = run_prepare("--input", str(src), "--out", str(out), "--val-fraction", "0.5")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--force" in r.stderr
    assert "Traceback" not in r.stderr
    assert (out / "train.bin").read_bytes() == before

    r = run_prepare("--input", str(src), "--out", str(out), "--val-fraction", "0.5", "--force")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "meta.json").read_text())["val_tokens"] == \
        round((len(TEXT.encode()) + 1) * 0.5)


@pytest.mark.parametrize("args", [
    ["--input", "{tmp}/missing.txt", "--out", "{tmp}/o"],
    ["--out", "{tmp}/o"],                                       # no source
    ["--input", "{tmp}/in.txt", "--builtin", "pydoc", "--out", "{tmp}/o"],
    ["--input", "{tmp}/in.txt"],                                # no --out
    ["--input", "{tmp}/in.txt", "--out", "{tmp}/o", "--val-fraction", "1.5"],
    ["--input", "{tmp}/in.txt", "--out", "{tmp}/o", "--tokenizer", "{tmp}/nope.json"],
    ["--input", "{tmp}/in.txt", "--out", "{tmp}/o", "--dtype", "int8"],
])
def test_prepare_bad_args_exit_2(tmp_path, args):
    (tmp_path / "in.txt").write_text(TEXT, encoding="utf-8")
    r = run_prepare(*[a.format(tmp=tmp_path) for a in args])
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o" / "train.bin").exists()


def test_prepare_builtin_pydoc(tmp_path):
    out = tmp_path / "pydoc"
    t0 = time.perf_counter()
    r = run_prepare("--builtin", "pydoc", "--out", str(out))
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"] == "builtin:pydoc" and meta["vocab_size"] == 256
    assert meta["train_tokens"] + meta["val_tokens"] > 400_000
    assert meta["documents"] == meta["train_docs"] + meta["val_docs"] > 70  # one per topic
    assert elapsed < 10.0
    # and the result loads as training data
    tb = D.TrainBatches(tokens_cfg(out / "train.bin"), seq_len=64, vocab_size=256,
                        micro_batch_size=4, dp_rank=0, dp=1, seed=0)
    x, _ = tb.next_batch()
    assert x.shape == (4, 64)


# ---------------------------------------------------------------------------
# TrainBatches

T = 8


@pytest.fixture
def arange_file(tmp_path) -> Path:
    """24 windows of T+1 tokens; token i has id i, so windows identify themselves."""
    return write_tokens(tmp_path / "d" / "train.bin", np.arange(24 * T + 1))


def make(path: Path, mbs: int = 2, dp_rank: int = 0, dp: int = 1, seed: int = 7,
         vocab: int = 1000, kind: str = "tokens") -> D.TrainBatches:
    cfg = tokens_cfg(path) if kind == "tokens" else DataConfig(kind="synthetic")
    return D.TrainBatches(cfg, seq_len=T, vocab_size=vocab, micro_batch_size=mbs,
                          dp_rank=dp_rank, dp=dp, seed=seed)


def test_train_batches_shapes_and_shift(arange_file):
    tb = make(arange_file, mbs=3)
    assert tb.num_windows == 24
    for _ in range(10):
        x, y = tb.next_batch()
        assert x.shape == y.shape == (3, T) and x.dtype == y.dtype == torch.int64
        assert x.device.type == "cpu"
        assert torch.equal(y, x + 1)                     # arange: y is x shifted by one
        assert torch.all(x[:, 0] % T == 0)               # windows start at w*T
    assert tb.state_dict() == {"consumed": 30}


@pytest.mark.parametrize("mbs,dp", [(2, 3), (4, 2), (3, 1)])
def test_train_batches_epochs_cover_windows_once_across_dp(arange_file, mbs, dp):
    ranks = [make(arange_file, mbs=mbs, dp_rank=r, dp=dp) for r in range(dp)]
    steps_per_epoch = 24 // (mbs * dp)
    epochs = []
    for _ in range(2):
        seen = []
        for _ in range(steps_per_epoch):
            per_rank = [window_ids(rk.next_batch()[0], T) for rk in ranks]
            flat = [w for ids in per_rank for w in ids]
            assert len(set(flat)) == len(flat)           # dp ranks disjoint in a step
            seen += flat
        assert sorted(seen) == list(range(24))           # each window once per epoch
        epochs.append(seen)
    assert epochs[0] != epochs[1]                        # a fresh permutation per epoch
    assert epochs[0] != list(range(24))                  # and actually shuffled


def test_train_batches_sample_index_semantics(arange_file):
    """Rank r's batch is slice r of the dp=1 global batch: the order depends only on
    the global sample index, so dp=2 x mbs=2 consumes what dp=1 x mbs=4 does."""
    one = make(arange_file, mbs=4)
    two = [make(arange_file, mbs=2, dp_rank=r, dp=2) for r in range(2)]
    for _ in range(15):                                  # crosses epoch boundaries
        x, _ = one.next_batch()
        assert torch.equal(torch.cat([t.next_batch()[0] for t in two]), x)


def test_train_batches_straddles_epoch_and_seed_matters(tmp_path):
    path = write_tokens(tmp_path / "train.bin", np.arange(5 * T + 1))
    tb = make(path, mbs=2)                               # 5 windows, batches of 2
    seen = [w for _ in range(5) for w in window_ids(tb.next_batch()[0], T)]
    assert sorted(seen[:5]) == sorted(seen[5:]) == list(range(5))
    other = make(path, mbs=2, seed=8)
    assert [w for _ in range(5) for w in window_ids(other.next_batch()[0], T)] != seen


@pytest.mark.parametrize("kind", ["tokens", "synthetic"])
def test_train_batches_resume(arange_file, kind):
    ref = make(arange_file, mbs=2, dp_rank=1, dp=2, kind=kind)
    seq = [ref.next_batch() for _ in range(20)]
    tb = make(arange_file, mbs=2, dp_rank=1, dp=2, kind=kind)
    for _ in range(7):
        tb.next_batch()
    state = tb.state_dict()
    resumed = make(arange_file, mbs=2, dp_rank=1, dp=2, kind=kind)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives serialization
    for x, y in seq[7:]:
        rx, ry = resumed.next_batch()
        assert torch.equal(rx, x) and torch.equal(ry, y)
    with pytest.raises(CheckpointError):
        resumed.load_state_dict({"step": 3})


def test_synthetic_determinism():
    a = make(Path(), mbs=4, vocab=50, kind="synthetic", seed=3)
    b = make(Path(), mbs=4, vocab=50, kind="synthetic", seed=3)
    c = make(Path(), mbs=4, vocab=50, kind="synthetic", seed=4)
    xa, ya = a.next_batch()
    xb, _ = b.next_batch()
    xc, _ = c.next_batch()
    assert xa.shape == (4, T) and xa.dtype == torch.int64
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)
    assert torch.equal(xa[:, 1:], ya[:, :-1])            # y is x shifted by one
    assert int(xa.min()) >= 0 and int(xa.max()) < 50
    assert not torch.equal(xa, a.next_batch()[0])        # advances
    # depends only on the sample index: dp rank 1 of 2 gets samples 2, 3 of step 0
    r1 = make(Path(), mbs=2, dp_rank=1, dp=2, vocab=50, kind="synthetic", seed=3)
    assert torch.equal(r1.next_batch()[0], xa[2:])


# ---------------------------------------------------------------------------
# val_batches

def test_val_batches_contiguous_in_order(tmp_path):
    path = write_tokens(tmp_path / "val.bin", np.arange(20 * T + 1 + 3))  # 20 windows
    mbs, dp = 2, 2
    per_rank = [list(D.val_batches(path, "uint16", T, 1000, mbs, r, dp, max_batches=100))
                for r in range(dp)]
    assert [len(b) for b in per_rank] == [5, 5]           # 20 // (2*2)
    assert D.num_val_batches(path, "uint16", T, 1000, mbs, dp, max_batches=100) == 5
    for b in range(5):
        for r in range(dp):
            x, y = per_rank[r][b]
            assert x.shape == (mbs, T) and torch.equal(y, x + 1)
            assert window_ids(x, T) == [(b * dp + r) * mbs + j for j in range(mbs)]
    # max_batches caps; iterating again starts over from the file's start
    vb = D.ValBatches(path, "uint16", T, 1000, mbs, 0, dp, max_batches=2)
    assert len(vb) == 2
    first = [window_ids(x, T) for x, _ in vb]
    assert first == [[0, 1], [4, 5]] == [window_ids(x, T) for x, _ in vb]


def test_val_batches_partial_last_batch(tmp_path):
    """3 windows for a global batch of 4 (mbs 2 x dp 2): one batch, whose missing row is
    padding (input 0, every target IGNORE_INDEX); the eval loss counts only real targets."""
    path = write_tokens(tmp_path / "val.bin", np.arange(3 * T + 1 + 2))
    assert D.num_val_batches(path, "uint16", T, 1000, 2, 2, max_batches=4) == 1
    (x0, y0), = D.val_batches(path, "uint16", T, 1000, 2, 0, 2, max_batches=4)
    (x1, y1), = D.val_batches(path, "uint16", T, 1000, 2, 1, 2, max_batches=4)
    assert window_ids(x0, T) == [0, 1] and torch.equal(y0, x0 + 1)
    assert window_ids(x1[:1], T) == [2] and torch.equal(y1[:1], x1[:1] + 1)
    assert x1.shape == y1.shape == (2, T)
    assert torch.equal(x1[1], torch.zeros(T, dtype=torch.int64))
    assert bool((y1[1] == -100).all())


def test_val_batches_too_short(tmp_path):
    path = write_tokens(tmp_path / "val.bin", np.arange(T))  # not one window of T + 1
    with pytest.raises(DataError, match=rf"has {T} tokens, fewer than one window of "
                                        rf"seq_len \+ 1 = {T + 1}"):
        D.val_batches(path, "uint16", T, 1000, 2, 0, 2, max_batches=4)  # eager


# ---------------------------------------------------------------------------
# DataError cases

def test_error_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"missing\.bin does not exist.*oases\.prepare"):
        make(tmp_path / "missing.bin")


def test_error_file_shorter_than_one_batch(tmp_path):
    path = write_tokens(tmp_path / "train.bin", np.arange(5 * T + 1))
    with pytest.raises(DataError, match=r"has 5 windows of 9 tokens, fewer than one global "
                                        r"micro-batch \(mbs x dp = 3 x 2 = 6\)"):
        make(path, mbs=3, dp=2)


def test_error_token_id_out_of_vocab(tmp_path):
    ids = np.zeros(10 * T + 1, dtype=np.uint16)
    ids[-2] = 300
    path = write_tokens(tmp_path / "train.bin", ids)
    with pytest.raises(DataError, match=r"token id 300 .*vocab_size is 256") as e:
        make(path, vocab=256)
    assert str(path) in str(e.value)
    make(path, vocab=301)                                 # fits: fine
    # the chunked scan finds an id in a late chunk
    with pytest.raises(DataError, match="token id 300"):
        TK.check_token_ids(np.fromfile(path, dtype=np.uint16), 256, path, chunk_tokens=7)


def test_error_odd_size_for_uint32(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(b"\0" * 42)
    with pytest.raises(DataError, match=r"is not a uint32 token file: size 42 is not a "
                                        r"multiple of 4"):
        D.TrainBatches(tokens_cfg(path, dtype="uint32"), T, 1000, 1, 0, 1, 0)


def test_error_meta_dtype_mismatch(tmp_path):
    path = write_tokens(tmp_path / "train.bin", np.arange(10 * T + 1), dtype="uint32")
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 256}))
    with pytest.raises(DataError, match=r"written as uint32 .*data\.dtype=uint16"):
        make(path)                                        # configured uint16
    tb = D.TrainBatches(tokens_cfg(path, dtype="uint32"), T, 1000, 2, 0, 1, 0)
    x, y = tb.next_batch()
    assert torch.equal(y, x + 1)


def test_error_messages_are_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        make(tmp_path / "missing.bin")
    assert "\n" not in str(e.value)


def _prepared(tmp_path, n: int, vocab: int = 256):
    """train.bin of n tokens with a meta.json as oases.prepare writes it."""
    d = tmp_path / "prep"
    d.mkdir()
    ids = (np.arange(n) % 200).astype("<u2")
    ids.tofile(d / "train.bin")
    meta = {"vocab_size": vocab, "dtype": "uint16", "train_tokens": n,
            "train_max_id": int(ids.max())}
    (d / "meta.json").write_text(json.dumps(meta))
    return d / "train.bin", meta


def test_recorded_max_id_is_trusted_with_a_bounded_sample(tmp_path, monkeypatch):
    """With meta.json's largest id, start-up reads a bounded sample (16 x 64K tokens),
    never the whole file; without it, the whole file is scanned."""
    path, meta = _prepared(tmp_path, 4_000_000)
    scanned, sampled = [], []
    real_scan, real_sample = TK.check_token_ids, TK.sample_max
    monkeypatch.setattr(TK, "check_token_ids", lambda t, *a, **k: (scanned.append(len(t)),
                                                                    real_scan(t, *a, **k)))
    monkeypatch.setattr(TK, "sample_max", lambda t, *a, **k: (sampled.append(len(t)),
                                                              real_sample(t, *a, **k))[1])
    TK.open_tokens(path, "uint16", 256)
    assert scanned == [] and sampled == [4_000_000]
    meta.pop("train_max_id")
    (path.parent / "meta.json").write_text(json.dumps(meta))
    TK.open_tokens(path, "uint16", 256)
    assert scanned == [4_000_000]
    assert real_sample(np.arange(4_000_000) % 200) == 199
    assert TK.SAMPLE_CHUNKS * TK.SAMPLE_CHUNK_TOKENS <= 1 << 20


def test_recorded_max_id_outside_the_vocabulary(tmp_path):
    path, _ = _prepared(tmp_path, 10_000)
    with pytest.raises(DataError, match=r"holds token id 199 \(per meta.json\) but the model's "
                                         r"vocab_size is 150"):
        TK.open_tokens(path, "uint16", 150)


def test_file_changed_after_meta_json_is_caught(tmp_path):
    path, _ = _prepared(tmp_path, 1_000_000)
    ids = np.fromfile(path, dtype="<u2")
    ids[0] = 250  # the first sampled chunk starts at the file's first token
    ids.tofile(path)
    with pytest.raises(DataError, match="token id 250 above the largest id 199 that meta.json "
                                        "records"):
        TK.open_tokens(path, "uint16", 256)
