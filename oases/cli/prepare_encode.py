"""Tokenizers of ``python -m oases.prepare`` and the work each worker process does: turn
a chunk (:mod:`oases.cli.prepare_sources`) into token ids, an EOS after every document
(and a BOS before it, where the tokenizer's template puts one).

Tokenizers: ``bytes`` (every UTF-8 byte a token, vocab 256; EOS is byte 0, which text
does not contain), a local HF ``tokenizer.json`` (or a directory holding one), or a
local tiktoken BPE file (``tiktoken.load``: base64 token and rank per line; nothing is
downloaded), with ``<|endoftext|>`` added after its ranks as the EOS.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from oases.cli.prepare_sources import parse_jsonl
from oases.errors import DataError

# the split pattern of OpenAI's cl100k encodings, for a tiktoken file (its ranks carry none)
TIKTOKEN_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?"""
                    r"""[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+""")
# HF tokenizer tokens that end a document, in the order they are looked for
_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


@dataclass(frozen=True)
class TokenizerSpec:
    """What a worker needs to load the tokenizer (picklable), and meta.json's record."""
    kind: str                  # "bytes" | "hf" | "tiktoken"
    path: str                  # "" for bytes
    vocab_size: int
    eos_id: int
    bos_id: Optional[int]
    sha256: Optional[str]

    def describe(self) -> str:
        return "bytes" if self.kind == "bytes" else self.path


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load_hf(path: str):
    try:
        from tokenizers import Tokenizer  # deferred: optional, HF tokenizers only
    except ImportError:
        raise DataError("--tokenizer PATH needs the 'tokenizers' package: "
                        "pip install tokenizers") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust side raises plain Exception for a bad file
        raise DataError(f"--tokenizer {path} is not a valid tokenizers file: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def load_tiktoken(path: str):
    try:
        import tiktoken  # deferred: optional, tiktoken files only
        from tiktoken.load import load_tiktoken_bpe  # deferred: as above
    except ImportError:
        raise DataError("a tiktoken BPE file needs the 'tiktoken' package: "
                        "pip install tiktoken") from None
    try:
        ranks = load_tiktoken_bpe(path)
    except Exception as e:  # a malformed line raises ValueError or binascii.Error
        raise DataError(f"--tokenizer {path} is not a tiktoken BPE file: {e}") from None
    return tiktoken.Encoding(Path(path).stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


def _is_tiktoken(path: Path) -> bool:
    """A tiktoken file is lines of ``base64 rank``; a tokenizer.json starts with ``{``."""
    with open(path, "rb") as f:
        head = f.read(256).lstrip()
    return bool(head) and not head.startswith(b"{") and head.split(b"\n")[0].count(b" ") == 1


def resolve_tokenizer(name: str, eos_id: Optional[int], bos: str) -> TokenizerSpec:
    """``--tokenizer`` (bytes, a tokenizer.json or its directory, a tiktoken file),
    ``--eos-id`` and ``--bos`` (auto | none | an id) into a spec; vocab_size covers an
    EOS/BOS id given beyond the tokenizer's own vocabulary."""
    if bos not in ("auto", "none") and not bos.isdigit():
        raise DataError(f"--bos {bos} is not auto, none or a token id (an integer >= 0)")
    if name == "bytes":
        kind, path, vocab, eos, tbos, sha = "bytes", "", 256, 0, None, None
    else:
        p = Path(name)
        if p.is_dir() and (p / "tokenizer.json").is_file():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise DataError(f"--tokenizer {name} is neither 'bytes' nor an existing "
                            f"tokenizer.json, tokenizer directory or tiktoken BPE file")
        path, sha = str(p.resolve()), file_sha256(p)
        if _is_tiktoken(p):
            kind, enc = "tiktoken", load_tiktoken(path)
            vocab, eos, tbos = enc.n_vocab, enc.eot_token, None
        else:
            kind, tok = "hf", load_hf(path)
            vocab = tok.get_vocab_size(with_added_tokens=True)
            eos = next((tok.token_to_id(t) for t in _EOS_TOKENS
                        if tok.token_to_id(t) is not None), None)
            tbos = template_bos(tok)
    if eos_id is not None:
        eos = eos_id
    if eos is None:
        raise DataError(f"--tokenizer {name} has no end-of-text token "
                        f"({', '.join(_EOS_TOKENS)}); pass --eos-id")
    bos_id = tbos if bos == "auto" else None if bos == "none" else int(bos)
    if eos < 0 or (bos_id is not None and bos_id < 0):
        raise DataError(f"--eos-id {eos} / --bos {bos_id} must be >= 0")
    vocab = max(vocab, eos + 1, (bos_id or 0) + 1)
    return TokenizerSpec(kind, path, vocab, eos, bos_id, sha)


def template_bos(tok) -> Optional[int]:
    """The special token the tokenizer's template puts before a text (LLaMA's ``<s>``),
    if any: what ``add_special_tokens=True`` adds in front of an empty text."""
    enc = tok.encode("", add_special_tokens=True)
    return enc.ids[0] if enc.ids and enc.special_tokens_mask[0] else None


class Encoder:
    """One process's tokenizer: ``encode(chunk, skip_bad)`` -> (ids, tokens of each
    piece, whether each piece ends a document, bad lines skipped, text bytes)."""

    def __init__(self, spec: TokenizerSpec, parallel: bool) -> None:
        if not parallel:  # one worker per core already: no thread pool inside each
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.spec = spec
        self._hf = load_hf(spec.path) if spec.kind == "hf" else None
        self._tt = load_tiktoken(spec.path) if spec.kind == "tiktoken" else None

    def _ids(self, texts: list[str]) -> list[np.ndarray]:
        if self._hf is not None:
            # no template here: it would wrap every piece; BOS/EOS are added per document
            return [np.asarray(e.ids, dtype=np.uint32)
                    for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        if self._tt is not None:
            return [np.asarray(ids, dtype=np.uint32)
                    for ids in self._tt.encode_ordinary_batch(texts, num_threads=1)]
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.uint32)
                for t in texts]

    def encode(self, chunk: tuple, skip_bad: bool):
        if chunk[0] == "jsonl":
            _, data, where, line, key = chunk
            texts, bad = parse_jsonl(data, where, line, key, skip_bad)
            starts = ends = None
            nbytes = len(data)
        else:
            texts, starts, ends = chunk[1:4]
            bad = chunk[4] if len(chunk) > 4 else 0
            nbytes = sum(len(t) for t in texts)
        n = len(texts)
        starts = np.ones(n, bool) if starts is None else np.asarray(starts, bool)
        ends = np.ones(n, bool) if ends is None else np.asarray(ends, bool)
        eos = np.array([self.spec.eos_id], dtype=np.uint32)
        bos = None if self.spec.bos_id is None else np.array([self.spec.bos_id], np.uint32)
        parts, lengths = [], np.empty(n, dtype=np.int64)
        for i, ids in enumerate(self._ids(texts)):
            piece = [bos] if bos is not None and starts[i] else []
            piece += [ids, eos] if ends[i] else [ids]
            parts += piece
            lengths[i] = sum(len(a) for a in piece)
        out = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
        return out, lengths, ends, bad, nbytes


# A worker process's encoder, made once by the pool's initializer (per process, not
# shared: each worker loads its own tokenizer).
_WORKER: dict = {}


def worker_init(spec: TokenizerSpec) -> None:
    _WORKER["encoder"] = Encoder(spec, parallel=False)


def worker_encode(args: tuple):
    """Pool task: encode one chunk; a DataError (a bad line) comes back as its message."""
    chunk, skip_bad = args
    try:
        return _WORKER["encoder"].encode(chunk, skip_bad)
    except DataError as e:
        return str(e)
