"""Corpora of several files (oases.runtime.tokens): shards read as one corpus, Megatron's
``.bin``/``.idx`` (written here by an independent minimal writer of its documented
format, never by oases), exact resume on shards and blends of shards, attention that
stays inside documents, and training on such corpora."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from oases.config import DataConfig, load_config
from oases.errors import DataError
from oases.runtime.data import TrainBatches
from oases.runtime.tokens import open_corpus

ROOT = Path(__file__).resolve().parents[1]


def megatron_write(prefix: Path, docs: list[list[list[int]]], code: int = 8) -> None:
    """Megatron-LM's indexed dataset, from its documentation: ``.bin`` the sequences'
    ids back to back; ``.idx`` = b"MMIDIDX\\0\\0", <Q version 1, <B dtype code, <Q
    sequence count, <Q document count (+1), <i4 lengths, <i8 byte pointers, <i8 document
    index (first sequence of each document, then the sequence count)."""
    dt = {4: "<i4", 8: "<u2"}[code]
    seqs = [s for d in docs for s in d]
    lengths = np.array([len(s) for s in seqs], "<i4")
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * np.dtype(dt).itemsize
    doc_idx = np.cumsum([0] + [len(d) for d in docs]).astype("<i8")
    prefix.with_suffix(".bin").write_bytes(np.concatenate(seqs).astype(dt).tobytes())
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def shards(d: Path, ids: np.ndarray, n_shards: int) -> Path:
    """``ids`` as ``train-0000k.bin`` shards with the meta.json oases.prepare writes."""
    d.mkdir(parents=True, exist_ok=True)
    entries = []
    for k, part in enumerate(np.array_split(ids.astype("<u2"), n_shards)):
        part.tofile(d / f"train-{k:05d}.bin")
        entries.append({"file": f"train-{k:05d}.bin", "tokens": len(part),
                        "max_id": int(part.max()), "docs": 0})
    (d / "meta.json").write_text(json.dumps({
        "vocab_size": 256, "dtype": "uint16", "eos_id": 0, "train_tokens": len(ids),
        "shards": {"train": entries, "val": []}}))
    return d / "train"


def batches(cfg: DataConfig, n: int, dp_rank=0, dp=1, state=None):
    tb = TrainBatches(cfg, seq_len=16, vocab_size=256, micro_batch_size=2, dp_rank=dp_rank,
                      dp=dp, seed=3)
    if state is not None:
        tb.load_state_dict(state)
    return [tb.next_batch()[0] for _ in range(n)], tb.state_dict()


def test_shards_read_as_one_corpus_with_exact_resume(tmp_path):
    """Five shards give the very batches of one file with their tokens (one sample space,
    windows across shard cuts), on every DP rank; a resume continues them exactly."""
    ids = np.random.default_rng(0).integers(1, 256, 2000).astype("<u2")
    one = tmp_path / "one" / "train.bin"
    one.parent.mkdir()
    ids.tofile(one)
    split = shards(tmp_path / "sh", ids, 5)
    for path in (split, tmp_path / "sh" / "train.bin", tmp_path / "sh" / "train-*.bin"):
        for r in range(2):
            want, _ = batches(DataConfig(kind="tokens", train_path=str(one)), 30, r, 2)
            got, _ = batches(DataConfig(kind="tokens", train_path=str(path)), 30, r, 2)
            assert all(torch.equal(a, b) for a, b in zip(want, got))
    cfg = DataConfig(kind="tokens", train_path=str(split))
    whole, _ = batches(cfg, 20)
    _, state = batches(cfg, 7)
    rest, _ = batches(cfg, 13, state=state)
    assert all(torch.equal(a, b) for a, b in zip(whole[7:], rest))
    assert open_corpus(split, "uint16", 256).eos_id == 0
    with pytest.raises(DataError, match="holds token id 255 .* vocab_size is 200"):
        open_corpus(split, "uint16", 200)


def test_many_shards_read_meta_json_a_bounded_number_of_times(tmp_path, monkeypatch):
    """Start-up of a corpus of many shards reads its meta.json twice (resolving the
    split, opening the shards), not once or twice per shard."""
    from oases.runtime import tokens as TK

    split = shards(tmp_path / "sh", np.random.default_rng(2).integers(1, 256, 4000), 40)
    reads = []
    real = TK.read_meta
    monkeypatch.setattr(TK, "read_meta", lambda p: reads.append(p) or real(p))
    corpus = open_corpus(split, "uint16", 256)
    assert len(corpus.files) == 40 and len(reads) == 2


def test_blend_of_sharded_corpora_resumes_exactly(tmp_path):
    rng = np.random.default_rng(1)
    a = shards(tmp_path / "a", rng.integers(1, 256, 1500), 3)
    b = shards(tmp_path / "b", rng.integers(1, 256, 700), 2)
    cfg = DataConfig(kind="tokens", train_paths=[{"path": str(a), "weight": 3},
                                                 {"path": str(b), "weight": 1}])
    whole, _ = batches(cfg, 40)
    _, state = batches(cfg, 15)
    assert [e["consumed"] for e in state["blend"]] == [23, 7]  # 30 samples at 3:1 (+- 1)
    rest, _ = batches(cfg, 25, state=state)
    assert all(torch.equal(x, y) for x, y in zip(whole[15:], rest))


def test_megatron_corpus_documents_intact(tmp_path):
    docs = [[[5, 6, 7], [8]], [[9, 10]], [[11] * 40, [12, 13]]]  # sequences per document
    megatron_write(tmp_path / "c_text_document", docs)
    c = open_corpus(tmp_path / "c_text_document", "uint16", 256)
    flat = [t for d in docs for s in d for t in s]
    assert c.num_docs == 3 and np.asarray(c.tokens).tolist() == flat
    megatron_write(tmp_path / "wide", docs, code=4)  # int32 ids, the .bin path named
    assert np.asarray(open_corpus(tmp_path / "wide.bin", "uint16", 256).tokens).tolist() == flat
    with pytest.raises(DataError, match="holds token id 40 but the model's vocab_size is 20"):
        megatron_write(tmp_path / "big", [[[40, 1]]])
        open_corpus(tmp_path / "big", "uint16", 20)
    (tmp_path / "cut.idx").write_bytes((tmp_path / "c_text_document.idx").read_bytes()[:40])
    (tmp_path / "cut.bin").write_bytes(b"")
    with pytest.raises(DataError, match="truncated"):
        open_corpus(tmp_path / "cut", "uint16", 256)


def test_attention_stays_inside_documents():
    """With the document mask, a LLaMA's logits for the second document of a packed row
    are those of that document alone (rotary positions are relative); without an EOS
    in the row the mask changes nothing."""
    from oases.models import build_model
    from oases.models.documents import Documents, document_mask

    cfg = load_config(str(ROOT / "configs" / "llama-tiny.yaml"),
                      ["model.seq_len=24", "model.vocab_size=64", "parallel.tp=1"]).validate()
    model = build_model(cfg.model, cfg.padded_vocab_size, None, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randint(1, 64, (1, 9), generator=gen), torch.randint(1, 64, (1, 15), generator=gen)
    row = torch.cat([a[:, :-1], torch.zeros(1, 1, dtype=torch.long), b], dim=1)  # a, EOS, b
    alone = model.full_logits(b)
    with model.documents.use(Documents.from_eos(row, 0)):
        packed = model.full_logits(row)
    torch.testing.assert_close(packed[:, 9:], alone, rtol=1e-4, atol=1e-5)
    no_eos = torch.randint(1, 64, (2, 24), generator=gen)
    with model.documents.use(Documents.from_eos(no_eos, 0)):
        masked = model.full_logits(no_eos)
    torch.testing.assert_close(masked, model.full_logits(no_eos), rtol=1e-5, atol=1e-6)
    m = document_mask(torch.tensor([[1, 0, 2, 3]]), 0)[0, 0]
    assert m.tolist() == [[True, False, False, False], [True, True, False, False],
                          [False, False, True, False], [False, False, True, True]]


def test_training_on_a_sharded_and_a_megatron_corpus(tmp_path):
    """train.py's path on a blend of a prepared sharded corpus and a Megatron corpus,
    attention reset at each EOS: the loss is finite and the blend's counts advance."""
    from tests.support.distributed import run_distributed
    from tests.support.loop import train_worker
    from tests.support.runs import REPO
    from tests.support.torchrun_procs import metrics

    rng = np.random.default_rng(2)
    sharded = shards(tmp_path / "sh", rng.integers(1, 256, 3000), 3)
    docs = [[list(rng.integers(1, 256, 60)) + [0]] for _ in range(30)]
    megatron_write(tmp_path / "mg", docs)
    out = tmp_path / "run"
    blend = f"[{{path: {sharded}, weight: 1}}, {{path: {tmp_path / 'mg'}, weight: 1}}]"
    run_distributed(train_worker, world=1, tp=None, args=([
        f"out_dir={out}", "parallel.tp=1", "train.steps=3", "train.micro_batch_size=2",
        "model.seq_len=32", "eval.interval=0", "wandb.mode=disabled", "data.train_path=",
        f"data.train_paths={blend}", "data.val_path=", "data.eos_id=0",
        "data.reset_attention_at_eos=true"], str(REPO / "configs" / "gpt-tiny.yaml")))
    losses = [r["loss"] for r in metrics(out) if "loss" in r]
    assert losses and np.isfinite(losses).all()
    state = json.loads((out / "checkpoints/step_000003/meta.json").read_text())["data"]
    assert state["consumed"] == 6 and [e["consumed"] for e in state["blend"]] == [3, 3]
