"""Token corpora on disk: what ``data.train_path`` (or a blend entry, or ``data.val_path``)
names, opened as one token stream with its vocabulary checked.

A path names, in this order:

1. a token file: raw little-endian ``uint16``/``uint32`` ids with no header, as
   ``python -m oases.prepare`` writes ``train.bin`` (its ``meta.json`` alongside);
   with a Megatron ``.idx`` beside it, a Megatron corpus (:mod:`.megatron_format`);
2. a Megatron prefix ``PREFIX`` (``PREFIX.bin`` + ``PREFIX.idx``);
3. a split of a prepared directory, ``DIR/train`` or ``DIR/train.bin`` when
   ``DIR/meta.json`` lists that split's shards (``train-00000.bin``, ...);
4. a glob (``data/c/train-*.bin``): its matches in sorted order.

Several files read as ONE corpus: the shards are concatenated, in order, into one
token stream (:class:`ShardedTokens`), so the windows, the sample space and the
resume state are those of a single file; a window may straddle two shards.

Every file's ids are checked against the vocabulary: from the largest id that
``oases.prepare`` recorded (per shard) plus a bounded sample of the stream, or by one
chunked scan where nothing is recorded (a foreign or Megatron corpus).

A chat corpus (``oases.prepare --chat``; ``meta.json``'s ``chat``) has a per-token
``uint8`` flags file beside each token shard (``train.flags`` beside ``train.bin``, its
name in the shard's ``flags`` record), memory-mapped and read as one stream alongside
the tokens: :data:`FLAG_COUNTS` (the token is a target that counts: an assistant
token), :data:`FLAG_START` (the token starts a document: a conversation, or a row's
padding), :data:`FLAG_PAD` (the token is padding).
"""

from __future__ import annotations

import glob
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional, Union

import numpy as np

from oases.errors import DataError
from oases.runtime.megatron_format import MegatronCorpus, idx_path

PathLike = Union[str, Path]

# Read-only on purpose (no module-level mutable state): the supported file dtypes.
DTYPES: Mapping[str, np.dtype] = types.MappingProxyType(
    {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")})
FLAGS_DTYPE = np.dtype("u1")

# Tokens checked per step of the vocabulary scan: 16M tokens is 32-64 MB of RAM,
# which keeps the scan of a multi-GB file bounded in memory yet vectorized.
_SCAN_CHUNK_TOKENS = 1 << 24
# With the largest id recorded in meta.json, start-up reads only this sample of each
# token file: 16 chunks of 64K tokens (a few MB per file), whatever its size.
SAMPLE_CHUNKS = 16
SAMPLE_CHUNK_TOKENS = 1 << 16

# The bits of a chat corpus's per-token flags (see the module docstring).
FLAG_COUNTS = 1
FLAG_START = 2
FLAG_PAD = 4

PREPARE_HINT = "create it with `python -m oases.prepare --input FILE --out DIR`"


def np_dtype(dtype: str) -> np.dtype:
    if dtype not in DTYPES:
        raise DataError(f"data dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def read_meta(path: Path) -> dict:
    """``meta.json`` next to ``path``, or {} if there is none (or it is not a mapping);
    its ``shards`` checked (:func:`_check_shards`)."""
    meta_path = path.parent / "meta.json"
    if not meta_path.is_file():
        return {}
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path} (next to {path}) is not readable JSON: {e}") from None
    if not isinstance(meta, dict):
        return {}
    _check_shards(meta.get("shards"), meta_path)
    return meta


def _inside(name: str) -> bool:
    """Whether the file name ``name``, read from a data file, stays in the directory it is
    joined to: relative, without ``..`` and not empty. Checked on the name alone, not
    the resolved path: a symlink inside the directory is its owner's choice."""
    parts = PurePosixPath(name).parts
    return bool(parts) and not name.startswith("/") and ".." not in parts and "\0" not in name


def _check_shards(shards, meta_path: Path) -> None:
    """``shards`` (absent, or split -> a list of ``{"file": NAME, ...}``, every NAME a
    file beside ``meta.json``) or a one-line DataError naming what it holds instead."""
    if shards is None:
        return
    if isinstance(shards, dict):
        bad = next((v for v in shards.values() if not isinstance(v, list)), None)
        bad = bad if bad is not None else next(
            (e for v in shards.values() for e in v
             if not isinstance(e, dict) or not isinstance(e.get("file"), str)), None)
        what = None if bad is None else f"a split holding {_kind(bad)}"
    else:
        what = _kind(shards)
    if what is not None:
        raise DataError(f"{meta_path}: 'shards' must map each split to a list of "
                        f"{{\"file\": NAME, ...}} records, but it is {what}")
    for entries in shards.values():
        for e in entries:
            if not _inside(e["file"]):
                raise DataError(f"{meta_path}: shard file {e['file']!r} is outside "
                                f"{meta_path.parent}; meta.json lists files beside it")


def _kind(v) -> str:
    """How a wrong JSON value reads in a message: "a str 'x'", "a list of str"."""
    if isinstance(v, list):
        inner = sorted({type(e).__name__ for e in v})
        return f"a list of {' and '.join(inner)}" if inner else "an empty list"
    return f"a {type(v).__name__} {json.dumps(v)[:40]}"


def _check_meta(path: Path, dtype: str, meta: dict) -> None:
    """Catch the classic silent failure: reading a uint32 file as uint16 (or back)
    gives garbage token ids that may well still be inside the vocabulary."""
    meta_dtype = meta.get("dtype")
    if meta_dtype is not None and meta_dtype != dtype:
        raise DataError(f"{path} was written as {meta_dtype} (per {path.parent / 'meta.json'}) "
                        f"but data.dtype={dtype}; set data.dtype={meta_dtype}")


def _shard_entries(meta: dict) -> dict[str, dict]:
    """``meta.json``'s shard records by file name (every split's; checked by
    :func:`read_meta`)."""
    out: dict[str, dict] = {}
    for entries in (meta.get("shards") or {}).values():
        for e in entries:
            out.setdefault(e["file"], e)
    return out


def _recorded_max_id(meta: dict, shards: dict[str, dict], path: Path,
                     n_tokens: int) -> Optional[int]:
    """The largest token id ``oases.prepare`` recorded for this file: its entry in
    ``shards`` (:func:`_shard_entries`) or ``<stem>_max_id`` (``train_max_id`` for
    train.bin), if the entry's token count says the record is about this very file."""
    e = shards.get(path.name)
    if e is not None:
        rec, count = e.get("max_id"), e.get("tokens")
        return rec if _is_int(rec) and count == n_tokens else None
    rec, count = meta.get(f"{path.stem}_max_id"), meta.get(f"{path.stem}_tokens")
    return rec if _is_int(rec) and count == n_tokens else None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sample_max(tokens: np.ndarray, samples: int = SAMPLE_CHUNKS,
                chunk_tokens: int = SAMPLE_CHUNK_TOKENS) -> int:
    """The largest id in ``samples`` chunks spread evenly over the stream (first and last
    included): a bounded read that catches a file changed after ``meta.json``."""
    n = len(tokens)
    starts = np.linspace(0, max(n - chunk_tokens, 0), samples).astype(np.int64)
    return max(int(tokens[a:a + chunk_tokens].max()) for a in np.unique(starts))


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: PathLike,
                     chunk_tokens: int = _SCAN_CHUNK_TOKENS) -> None:
    """Raise if any id is >= vocab_size (or negative, in a signed Megatron file). Scans
    in chunks: the embedding would otherwise fail much later with an opaque CUDA index
    error, and loading a multi-GB memmap at once would defeat the memmap."""
    max_id, min_id = -1, 0
    for start in range(0, len(tokens), chunk_tokens):
        chunk = tokens[start:start + chunk_tokens]
        if len(chunk):
            max_id = max(max_id, int(chunk.max()))
            if tokens.dtype.kind == "i":
                min_id = min(min_id, int(chunk.min()))
    if min_id < 0:
        raise DataError(f"{path} holds the negative token id {min_id}")
    if max_id >= vocab_size:
        raise DataError(f"{path} holds token id {max_id} but the model's vocab_size is "
                        f"{vocab_size}; use a model with vocab_size > {max_id} or "
                        f"re-tokenize the data")


def _map_raw(p: Path, dtype: str) -> np.ndarray:
    np_dt = np_dtype(dtype)
    size = p.stat().st_size
    if size % np_dt.itemsize:
        raise DataError(f"{p} is not a {dtype} token file: size {size} is not a multiple "
                        f"of {np_dt.itemsize}")
    if size == 0:
        return np.zeros(0, dtype=np_dt)
    try:
        return np.memmap(p, dtype=np_dt, mode="r")
    except OSError as e:
        raise DataError(f"cannot read data file {p}: {e.strerror or e}") from None


def _check_recorded(tokens, recorded: int, vocab_size: int, where: PathLike) -> None:
    sampled = sample_max(tokens)
    if sampled > recorded:
        raise DataError(f"{where} holds token id {sampled} above the largest id {recorded} "
                        f"that meta.json records for it: the file changed after "
                        f"oases.prepare wrote meta.json; re-run oases.prepare")
    if recorded >= vocab_size:
        raise DataError(f"{where} holds token id {recorded} (per meta.json) but the model's "
                        f"vocab_size is {vocab_size}; use a model with vocab_size > "
                        f"{recorded} or re-tokenize the data")


def open_tokens(path: PathLike, dtype: str, vocab_size: int,
                meta: Optional[tuple[dict, dict]] = None) -> np.ndarray:
    """Open and validate one raw token file; returns a read-only 1-D memmap (or an empty
    array for an empty file, which ``np.memmap`` cannot map). The ids are checked from
    the largest id ``oases.prepare`` recorded in ``meta.json`` and a bounded sample of
    the file (a 100 GB corpus opens in milliseconds); a file without that record is
    scanned whole. ``meta``: the directory's ``meta.json`` and its
    :func:`_shard_entries`, when the caller has read them (a corpus of many shards
    reads its ``meta.json`` once)."""
    p = Path(path)
    np_dtype(dtype)
    if not p.is_file():
        what = "is a directory, not a token file" if p.is_dir() else "does not exist"
        raise DataError(f"data file {p} {what}; {PREPARE_HINT}")
    if meta is None:
        raw = read_meta(p)
        meta = (raw, _shard_entries(raw))
    _check_meta(p, dtype, meta[0])
    tokens = _map_raw(p, dtype)
    recorded = _recorded_max_id(*meta, p, len(tokens))
    if recorded is None:
        check_token_ids(tokens, vocab_size, p)
    elif len(tokens):
        _check_recorded(tokens, recorded, vocab_size, p)
    return tokens


class ShardedTokens:
    """Several token arrays read as one stream: ``len`` is the total, and indexing with
    an integer array of global offsets (any shape) gathers across shard boundaries."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self.parts = parts
        self.starts = np.cumsum([0] + [len(a) for a in parts], dtype=np.int64)
        self.dtype = np.result_type(*[a.dtype for a in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, offsets) -> np.ndarray:
        flat = np.asarray(offsets, dtype=np.int64).ravel()
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(len(flat), dtype=self.dtype)
        for k in np.unique(shard):
            sel = shard == k
            out[sel] = self.parts[int(k)][flat[sel] - self.starts[k]]
        return out.reshape(np.shape(offsets))


@dataclass
class Corpus:
    """An opened corpus: ``tokens`` (a memmap, or :class:`ShardedTokens` over several),
    the files it reads, and the EOS id that ends each document (None: not recorded)."""

    tokens: Union[np.ndarray, ShardedTokens]
    files: list[Path]
    eos_id: Optional[int] = None
    num_docs: Optional[int] = None
    # chat data: the per-token flags (FLAG_*), read alongside ``tokens``, and meta.json's
    # ``chat`` record (the seq_len its rows were packed for, the template, the counts)
    flags: Optional[Union[np.ndarray, ShardedTokens]] = None
    chat: Optional[dict] = None


def _split_shards(p: Path) -> Optional[tuple[list[Path], dict]]:
    """The shard files that ``DIR/meta.json`` lists for the split named by ``p``'s stem."""
    meta = read_meta(p)
    entries = (meta.get("shards") or {}).get(p.name.split(".")[0])
    if not entries:
        return None
    return [p.parent / e["file"] for e in entries], meta


def resolve(path: PathLike) -> list[Path]:
    """The files ``path`` names (see the module docstring), or a DataError."""
    p = Path(path)
    if p.is_file() or idx_path(p) is not None:
        return [p]
    split = _split_shards(p)
    if split is not None:
        return split[0]
    if glob.has_magic(str(path)):
        hits = sorted(Path(h) for h in glob.glob(str(path))
                      if not h.endswith((".idx", ".tmp", ".flags")))
        if not hits:
            raise DataError(f"data path {path} matches no file; {PREPARE_HINT}")
        return hits
    what = "is a directory, not a token file" if p.is_dir() else "does not exist"
    raise DataError(f"data file {p} {what}; {PREPARE_HINT}")


def _open_one(p: Path, dtype: str, vocab_size: int,
              metas: dict) -> tuple[np.ndarray, Optional[int], dict]:
    """One file's tokens, checked; its Megatron document count or None; its meta.json
    (``metas``: those read so far, by directory)."""
    idx = idx_path(p)
    if idx is None:
        if p.parent not in metas:
            raw = read_meta(p)
            metas[p.parent] = (raw, _shard_entries(raw))
        return open_tokens(p, dtype, vocab_size, metas[p.parent]), None, metas[p.parent][0]
    mc = MegatronCorpus(idx)
    check_token_ids(mc.tokens, vocab_size, mc.bin)
    return mc.tokens, mc.num_docs, {}


def open_corpus(path: PathLike, dtype: str, vocab_size: int,
                eos_id: Optional[int] = None) -> Corpus:
    """Open what ``path`` names (:func:`resolve`) as one checked token stream. ``eos_id``
    (``data.eos_id``) overrides the EOS id that ``meta.json`` records."""
    files = resolve(path)
    parts, docs, metas, read = [], [], [], {}
    for f in files:
        tokens, n_docs, meta = _open_one(f, dtype, vocab_size, read)
        parts.append(tokens)
        docs.append(n_docs)
        metas.append(meta)
    dtypes = {a.dtype for a in parts if len(a)}
    if len(dtypes) > 1:
        raise DataError(f"data path {path} mixes token dtypes "
                        f"({', '.join(sorted(str(d) for d in dtypes))}); read it as one")
    tokens = parts[0] if len(parts) == 1 else ShardedTokens(parts)
    recorded = metas[0].get("eos_id")
    eos = eos_id if eos_id is not None and eos_id >= 0 else \
        (recorded if _is_int(recorded) else None)
    split_docs = metas[0].get(f"{Path(path).name.split('.')[0]}_docs")
    if all(_is_int(d) for d in docs):  # Megatron files count their documents
        n_docs = sum(docs)
    else:
        n_docs = split_docs if _is_int(split_docs) else None
    chat = metas[0].get("chat")
    flags = open_flags(path, files, parts, read) if isinstance(chat, dict) else None
    return Corpus(tokens, files, eos, n_docs, flags, chat if flags is not None else None)


def open_flags(path: PathLike, files: list[Path], parts: list[np.ndarray],
               metas: dict) -> Union[np.ndarray, ShardedTokens]:
    """The flags of a chat corpus's token files ``files`` (their tokens ``parts``;
    ``metas``: their directories' meta.json and shard records, by directory): the file
    each one's shard record names, one uint8 per token; a token file without one
    (a chat corpus read with a raw or a foreign file among it) is a DataError."""
    out = []
    for f, tokens in zip(files, parts):
        entry = metas.get(f.parent, ({}, {}))[1].get(f.name, {})
        name = entry.get("flags")
        if not isinstance(name, str) or not _inside(name):
            raise DataError(f"data path {path}: {f} is in a chat corpus (meta.json 'chat') "
                            f"but its shard record names no flags file beside it; re-run "
                            f"oases.prepare --chat")
        fp = f.parent / name
        if not fp.is_file():
            raise DataError(f"chat corpus {path}: the flags file {fp} of {f.name} does not "
                            f"exist; re-run oases.prepare --chat")
        flags = (np.memmap(fp, dtype=FLAGS_DTYPE, mode="r") if fp.stat().st_size
                 else np.zeros(0, FLAGS_DTYPE))
        if len(flags) != len(tokens):
            raise DataError(f"chat corpus {path}: {fp} holds {len(flags)} flags but {f.name} "
                            f"{len(tokens)} tokens (one each); re-run oases.prepare --chat")
        out.append(flags)
    return out[0] if len(out) == 1 else ShardedTokens(out)
