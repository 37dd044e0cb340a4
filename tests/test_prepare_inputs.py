"""``python -m oases.prepare`` on every input kind (text, jsonl, .gz, .zst, parquet, HF
datasets directories and arrow files, globs), tokenizers (bytes, HF, tiktoken), the
document split and every bad input the command reports in one line with exit status 2.
All inputs are small files made here; the command runs in this process (``main``)."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from oases.cli.prepare import main

DOCS = [f"document {i}: " + "héllo wörld " * (i % 7 + 1) for i in range(40)]


def prep(*args) -> int:
    return main([*map(str, args), "--workers", "1"])


def tokens(out: Path, split: str) -> np.ndarray:
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / e["file"], dtype=np.uint16)
                           for e in meta["shards"][split]] or [np.zeros(0, np.uint16)])


def docs_of(ids: np.ndarray) -> list[str]:
    """Byte-level ids -> the documents between EOS (byte 0) tokens."""
    assert len(ids) and ids[-1] == 0
    return bytes(ids[:-1].astype(np.uint8)).decode().split("\0")


def write_jsonl(path: Path, docs, key="text") -> Path:
    text = "".join(json.dumps({key: d, "n": 1}) + "\n" for d in docs)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    elif path.name.endswith(".zst"):
        zstd = pytest.importorskip("zstandard")
        path.write_bytes(zstd.ZstdCompressor().compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_every_input_kind_one_corpus_eos_between_documents(tmp_path):
    """Ten documents from each kind, in input order; an EOS after every one; the val
    documents are whole (the EOS count in val equals its documents)."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    parts = [DOCS[i:i + 8] for i in range(0, 40, 8)]
    write_jsonl(tmp_path / "a.jsonl", parts[0])
    write_jsonl(tmp_path / "b.jsonl.gz", parts[1])
    write_jsonl(tmp_path / "c.jsonl.zst", parts[2])
    pq.write_table(pa.table({"text": parts[3], "x": list(range(8))}), tmp_path / "d.parquet",
                   row_group_size=3)
    datasets.Dataset.from_dict({"text": parts[4]}).save_to_disk(str(tmp_path / "hf"))
    (tmp_path / "e.txt").write_text("one\n\ntwo\n\n\n\nthree")
    out = tmp_path / "out"
    assert prep("--input", tmp_path / "a.jsonl", tmp_path / "[bc].jsonl.*",
                tmp_path / "d.parquet", tmp_path / "hf", tmp_path / "e.txt",
                "--split-on", r"\n\n", "--out", out, "--val-docs", "3") == 0
    meta = json.loads((out / "meta.json").read_text())
    expect = [d for p in parts for d in p] + ["one", "two", "three"]
    val, train = docs_of(tokens(out, "val")), docs_of(tokens(out, "train"))
    assert val == expect[:3] and train == expect[3:]
    assert (tokens(out, "val") == 0).sum() == meta["val_docs"] == 3
    assert (tokens(out, "train") == 0).sum() == meta["train_docs"] == len(expect) - 3
    assert meta["documents"] == len(expect) and meta["val_split"] == "documents"
    assert meta["eos_id"] == 0 and meta["separator"] == "eos" and len(meta["source"]) == 6


def test_val_fraction_takes_whole_documents_spread_over_the_corpus(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    out = tmp_path / "out"
    assert prep("--input", tmp_path / "a.jsonl", "--out", out, "--val-fraction", "0.1",
                "--shard-tokens", "100") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert docs_of(tokens(out, "val")) == [DOCS[i] for i in (9, 19, 29, 39)]
    assert len(meta["shards"]["train"]) > 3 and (out / "train-00000.bin").is_file()
    assert all(e["tokens"] <= 100 for e in meta["shards"]["train"])


def test_arrow_files_and_a_worker_pool(tmp_path):
    """A directory of .arrow files, tokenized by two worker processes, gives the same
    files as one in-process worker."""
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"body": DOCS})
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = tmp_path / "arrow"
    arrow.mkdir()
    for f in (tmp_path / "saved").glob("*.arrow"):
        (arrow / f.name).write_bytes(f.read_bytes())
    args = ["--input", arrow, "--text-key", "body", "--val-fraction", "0"]
    assert main([*map(str, args), "--out", str(tmp_path / "one"), "--workers", "1"]) == 0
    assert main([*map(str, args), "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    assert docs_of(tokens(tmp_path / "one", "train")) == DOCS
    assert (tmp_path / "one/train.bin").read_bytes() == (tmp_path / "two/train.bin").read_bytes()


def test_tiktoken_file(tmp_path):
    """A local tiktoken BPE file (base64 token, rank per line): every byte plus a few
    merges; ``<|endoftext|>`` follows the ranks as the EOS."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    path = tmp_path / "tok.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {i}\n" for i, t in enumerate(ranks)))
    write_jsonl(tmp_path / "a.jsonl", ["hello world", "hello"])
    out = tmp_path / "out"
    assert prep("--input", tmp_path / "a.jsonl", "--tokenizer", path, "--out", out,
                "--val-fraction", "0") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer_kind"] == "tiktoken" and meta["eos_id"] == 260
    assert meta["vocab_size"] == 261 and len(meta["tokenizer_sha256"]) == 64
    enc = tiktoken.Encoding("t", pat_str=r"\S+|\s+",
                            mergeable_ranks=dict(zip(ranks, range(len(ranks)))),
                            special_tokens={})
    ids = tokens(out, "train").tolist()
    assert ids[0] == 259 and ids.count(260) == 2 and enc.decode(ids[:1]) == "hello"


def one_line_error(capsys, rc: int, *needles: str) -> str:
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def test_bad_inputs_one_line_exit_2(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "out"
    one_line_error(capsys, prep("--input", tmp_path / "nope.jsonl", "--out", out),
                   "nope.jsonl does not exist")
    one_line_error(capsys, prep("--input", tmp_path / "*.jsonl", "--out", out),
                   "matches no file")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{"text": "b"\n{"other": "c"}\n{"text": "d"}\n')
    one_line_error(capsys, prep("--input", bad, "--out", out), f"{bad}:2:", "not JSON")
    assert not out.exists() or not any(out.iterdir())
    assert prep("--input", bad, "--out", out, "--skip-bad", "--val-fraction", "0") == 0
    assert "2 bad skipped" in capsys.readouterr().out
    assert docs_of(tokens(out, "train")) == ["a", "d"]
    nokey = write_jsonl(tmp_path / "nokey.jsonl", ["x"], key="body")
    one_line_error(capsys, prep("--input", nokey, "--out", tmp_path / "o2"),
                   f"{nokey}:1:", "no text key 'text'")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    one_line_error(capsys, prep("--input", tmp_path / "p.parquet", "--out", tmp_path / "o3"),
                   "has no column 'text'", "body")
    one_line_error(capsys, prep("--input", bad, "--skip-bad", "--out", tmp_path / "o4",
                                "--eos-id", "70000", "--dtype", "uint16"),
                   "cannot hold the vocab of 70001")


def test_existing_or_partial_output_is_kept_without_force(tmp_path, capsys):
    write_jsonl(tmp_path / "a.jsonl", DOCS)
    out = tmp_path / "out"
    out.mkdir()
    stale = out / "train-00003.bin.tmp"  # an interrupted run's shard
    stale.write_bytes(b"\1\0")
    one_line_error(capsys, prep("--input", tmp_path / "a.jsonl", "--out", out),
                   "partial shard set", "--force")
    assert sorted(p.name for p in out.iterdir()) == [stale.name]
    assert prep("--input", tmp_path / "a.jsonl", "--out", out, "--force") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert stale.name not in before and "train.bin" in before
    one_line_error(capsys, prep("--input", tmp_path / "a.jsonl", "--out", out),
                   "holds a prepared corpus")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("where", ["shards", "meta.json"])
def test_force_that_fails_half_way_keeps_the_old_corpus_whole(tmp_path, capsys, monkeypatch,
                                                              where):
    """``--force`` over a prepared corpus fails with a full disk while writing the new
    shards, or after them while writing meta.json: ``--out`` still holds the old corpus,
    byte for byte, and it reads as before; nothing is left beside it. Then a forced run
    that succeeds replaces the corpus whole (a shard layout of other names, none of the
    old files left) and keeps what else ``--out`` held."""
    from oases.cli import prepare_write
    from oases.runtime.tokens import open_corpus

    write_jsonl(tmp_path / "old.jsonl", DOCS[:20])
    write_jsonl(tmp_path / "new.jsonl", DOCS[20:])
    out = tmp_path / "out"
    assert prep("--input", tmp_path / "old.jsonl", "--out", out) == 0
    (out / "NOTES.txt").write_text("the user's own file\n")
    before = _files(out)
    old_train = np.asarray(open_corpus(out / "train", "uint16", 256).tokens)
    beside = sorted(p.name for p in tmp_path.iterdir())
    enospc = OSError(28, "No space left on device")
    if where == "shards":  # the third piece written of the new corpus
        real, calls = prepare_write.ShardWriter.write, []

        def write(self, ids, docs_ended):
            calls.append(1)
            if len(calls) == 3:
                raise enospc
            return real(self, ids, docs_ended)
        monkeypatch.setattr(prepare_write.ShardWriter, "write", write)
    else:  # every shard of the new corpus is complete by then
        def dumps(*a, **k):
            raise enospc
        monkeypatch.setattr(json, "dumps", dumps)
    args = ("--input", tmp_path / "new.jsonl", "--out", out, "--force", "--shard-tokens", "150")
    one_line_error(capsys, prep(*args), f"cannot write to {out}", "No space left on device")
    monkeypatch.undo()
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == beside
    assert np.array_equal(open_corpus(out / "train", "uint16", 256).tokens, old_train)
    assert docs_of(tokens(out, "train")) + docs_of(tokens(out, "val")) != []

    assert prep(*args) == 0
    meta = json.loads((out / "meta.json").read_text())
    listed = {e["file"] for s in ("train", "val") for e in meta["shards"][s]}
    assert sorted(p.name for p in out.iterdir()) == sorted(listed | {"meta.json", "NOTES.txt"})
    assert "train.bin" not in listed and len(listed) > 2  # old names gone, not overwritten
    assert (out / "NOTES.txt").read_text() == "the user's own file\n"
    assert sorted(docs_of(tokens(out, "train")) + docs_of(tokens(out, "val"))) == \
        sorted(DOCS[20:])
    assert sorted(p.name for p in tmp_path.iterdir()) == beside


def test_force_swaps_by_two_renames_where_there_is_no_atomic_exchange(tmp_path, monkeypatch):
    """Without renameat2's exchange (another C library, or a filesystem without it) the
    new corpus still replaces the old one whole and the other files stay."""
    from oases.cli import prepare_write

    monkeypatch.setattr(prepare_write, "_exchange", lambda a, b: False)
    write_jsonl(tmp_path / "a.jsonl", DOCS[:20])
    write_jsonl(tmp_path / "b.jsonl", DOCS[20:])
    out = tmp_path / "out"
    assert prep("--input", tmp_path / "a.jsonl", "--out", out, "--shard-tokens", "150") == 0
    (out / "NOTES.txt").write_text("kept\n")
    assert prep("--input", tmp_path / "b.jsonl", "--out", out, "--force") == 0
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.txt", "meta.json", "train.bin",
                                                     "val.bin"]
    assert sorted(docs_of(tokens(out, "train")) + docs_of(tokens(out, "val"))) == \
        sorted(DOCS[20:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "out"]
