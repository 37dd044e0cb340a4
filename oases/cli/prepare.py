"""Tokenize a text into nanoGPT-style token files for ``data.kind=tokens``.

    python -m oases.prepare --input corpus.txt --out data/corpus
    python -m oases.prepare --builtin pydoc --out data/pydoc
    python -m oases.prepare --input corpus.txt --tokenizer tok/tokenizer.json --out data/c

writes ``OUT/train.bin``, ``OUT/val.bin`` (raw little-endian uint16/uint32 ids,
no header) and ``OUT/meta.json`` (vocab size, dtype, tokenizer, token counts,
source). The loader (:mod:`oases.runtime.data`) reads ``meta.json`` to catch a
``data.dtype`` that disagrees with the file.

``--builtin pydoc`` is CPython's own documentation text (``pydoc_data.topics``),
about 0.46 MB: a real-language corpus that needs no download, for smoke tests and
tiny models. The default tokenizer is byte-level (vocab 256: every UTF-8 byte is
a token), which needs no tokenizer file either.

Bad input (missing file, bad arguments, output already there) is reported as one
line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Optional

import numpy as np

from oases.errors import EXIT_USER_ERROR, DataError, UserError
from oases.progress import progress

# Texts are handed to an HF tokenizer in pieces of about this many characters
# (cut after a newline) so a large corpus is encoded in parallel by encode_batch
# and never needs one giant Python list of ids. Only the token at a cut can differ
# from encoding the whole text at once.
_ENCODE_CHUNK_CHARS = 1 << 20
# chunks per encode_batch call: enough to keep every core busy, few enough for the
# progress bar to move
_ENCODE_GROUP = 2 * (os.cpu_count() or 1)
# token files are converted and written this many tokens at a time
_WRITE_TOKENS = 1 << 24


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as ONE line (exit 2), like every other
    oases entry point, instead of the usage block plus the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m oases.prepare",
                description="Tokenize a text into train.bin / val.bin / meta.json.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", metavar="FILE", help="a local UTF-8 text file")
    src.add_argument("--builtin", choices=("pydoc",),
                     help="a built-in corpus: pydoc = CPython's documentation text")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|PATH",
                   help="'bytes' (byte-level, vocab 256; default) or a local HF "
                        "tokenizers file (tokenizer.json)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="fraction of the tokens, from the end of the text, for val.bin")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                   help="token file dtype (default: uint16 if vocab <= 65536, else uint32)")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    return p


@dataclass
class _Corpus:
    text: str
    source: str


def _builtin_pydoc() -> _Corpus:
    """CPython's documentation topics, joined in sorted key order so the corpus
    (and the token files) are identical on every run of one Python version."""
    from pydoc_data.topics import topics  # deferred: 0.5 MB of text, --builtin only

    text = "\n".join(topics[k] for k in sorted(topics))
    return _Corpus(text, "builtin:pydoc")


def _read_input(path: str) -> _Corpus:
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise DataError(f"input file {path} {what}")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read input file {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"input file {path} is not UTF-8 text (bad byte at offset "
                        f"{e.start})") from None
    if not text:
        raise DataError(f"input file {path} is empty")
    return _Corpus(text, str(p.resolve()))


def _chunks(text: str, size: int) -> list[str]:
    """Pieces of about ``size`` characters, each cut just after a newline when
    there is one, so the cuts fall where tokenizers rarely merge across."""
    out: list[str] = []
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        if end < len(text):
            nl = text.rfind("\n", start, end)
            if nl >= start:
                end = nl + 1
        out.append(text[start:end])
        start = end
    return out


def _tokenize(text: str, tokenizer: str) -> tuple[np.ndarray, int, str]:
    """Returns (ids of any integer dtype, vocab_size, tokenizer description for meta.json)."""
    if tokenizer == "bytes":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8), 256, "bytes"
    path = Path(tokenizer)
    if not path.is_file():
        raise DataError(f"--tokenizer {tokenizer} is neither 'bytes' nor an existing "
                        f"tokenizer.json file")
    try:
        from tokenizers import Tokenizer  # deferred: optional, --tokenizer only
    except ImportError:
        raise DataError("--tokenizer PATH needs the 'tokenizers' package: "
                        "pip install tokenizers") from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception for a bad file
        raise DataError(f"--tokenizer {tokenizer} is not a valid tokenizers file: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    # No special tokens: a post-processor (e.g. BERT's [CLS] ... [SEP]) would
    # otherwise be inserted around every chunk. The chunks go to encode_batch a group
    # at a time (each chunk is encoded on its own either way), so the bar can move.
    chunks = _chunks(text, _ENCODE_CHUNK_CHARS)
    parts = []
    with progress(total=len(text), desc="tokenizing", unit="char") as bar:
        for i in range(0, len(chunks), _ENCODE_GROUP):
            group = chunks[i:i + _ENCODE_GROUP]
            for enc in tok.encode_batch(group, add_special_tokens=False):
                parts.append(np.asarray(enc.ids, dtype=np.int64))
            bar.update(sum(len(c) for c in group))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(ids) and int(ids.max()) >= vocab_size:  # a malformed tokenizer file, but cheap to catch
        raise DataError(f"--tokenizer {tokenizer} produced id {int(ids.max())} >= its "
                        f"vocab size {vocab_size}")
    return ids, vocab_size, str(path.resolve())


def _write_atomic(path: Path, data: bytes) -> None:
    """Write to a temp name then rename, so an interrupted run never leaves a
    truncated token file that a later training run would read as valid."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _write_tokens(path: Path, ids: np.ndarray, dtype: np.dtype, bar) -> None:
    """``ids`` as ``dtype`` to ``path`` (atomically, like :func:`_write_atomic`), a
    slice at a time: no full-size converted copy, and ``bar`` advances by bytes."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for i in range(0, len(ids), _WRITE_TOKENS):
            data = ids[i:i + _WRITE_TOKENS].astype(dtype).tobytes()
            f.write(data)
            bar.update(len(data))
    os.replace(tmp, path)


def prepare(corpus: _Corpus, out: Path, tokenizer: str = "bytes", val_fraction: float = 0.1,
            dtype: Optional[str] = None, force: bool = False) -> dict:
    """Tokenize ``corpus`` and write the three files; returns the meta dict."""
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction={val_fraction} must be in (0, 1)")
    train_path, val_path, meta_path = out / "train.bin", out / "val.bin", out / "meta.json"
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} exists and is not a directory")
    existing = [str(p) for p in (train_path, val_path) if p.exists()]
    if existing and not force:
        raise DataError(f"{' and '.join(existing)} already exist; pass --force to overwrite")

    ids, vocab_size, tok_desc = _tokenize(corpus.text, tokenizer)
    if dtype is None:
        dtype = "uint16" if vocab_size <= 65536 else "uint32"
    if dtype == "uint16" and vocab_size > 65536:
        raise DataError(f"--dtype uint16 cannot hold the vocab of {vocab_size} tokens; "
                        f"use --dtype uint32")
    n_val = int(round(len(ids) * val_fraction))
    n_train = len(ids) - n_val
    if n_val == 0 or n_train == 0:
        raise DataError(f"{len(ids)} tokens are too few to split with "
                        f"--val-fraction={val_fraction}")
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")
    # the largest ids let the loader trust the files without scanning them
    meta = {"vocab_size": vocab_size, "dtype": dtype, "tokenizer": tok_desc,
            "train_tokens": n_train, "val_tokens": n_val,
            "train_max_id": int(ids[:n_train].max()), "val_max_id": int(ids[n_train:].max()),
            "source": corpus.source}
    try:
        out.mkdir(parents=True, exist_ok=True)
        with progress(total=len(ids) * np_dtype.itemsize, desc="writing", unit="B") as bar:
            _write_tokens(train_path, ids[:n_train], np_dtype, bar)
            _write_tokens(val_path, ids[n_train:], np_dtype, bar)
        _write_atomic(meta_path, (json.dumps(meta, indent=2) + "\n").encode())
    except OSError as e:
        raise DataError(f"cannot write to {out}: {e.strerror or e}") from None
    return meta


def main(argv: Optional[list[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        corpus = _builtin_pydoc() if args.builtin == "pydoc" else _read_input(args.input)
        out = Path(args.out)
        meta = prepare(corpus, out, args.tokenizer, args.val_fraction, args.dtype, args.force)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"prepared {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens "
          f"(vocab {meta['vocab_size']}, {meta['dtype']}, tokenizer {args.tokenizer}) -> "
          f"{out / 'train.bin'}, {out / 'val.bin'}, {out / 'meta.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
