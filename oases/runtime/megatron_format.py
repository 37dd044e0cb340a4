"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``) as a token source.

The ``.bin`` is the corpus's token ids, sequence after sequence, with no header; the
``.idx`` says how to cut it (``megatron/core/datasets/indexed_dataset.py``)::

    offset  field
    0       b"MMIDIDX\\x00\\x00"            9-byte magic
    9       version               <u8      1
    17      dtype code            <u1      1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                           6 float64, 7 float32, 8 uint16
    18      sequence count S      <u8
    26      document count D      <u8      entries of the document index (documents + 1)
    34      sequence lengths      <i4[S]   tokens per sequence
    ..      sequence pointers     <i8[S]   byte offset of each sequence in the .bin
    ..      document index        <i8[D]   first sequence of each document; the last
                                           entry is S
    ..      sequence modes        <i1[S]   multimodal datasets only (ignored)

oases reads the ``.bin`` as one memmapped token stream (sequences are contiguous, as
Megatron writes them; checked) and the document index as the token offsets where the
documents start. A Megatron corpus records no largest id, so start-up scans it once in
bounded chunks, like any token file without ``meta.json``.
"""

from __future__ import annotations

import struct
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import numpy as np

from oases.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequence count, document count

# Read-only on purpose: Megatron's dtype codes (integer token ids only).
DTYPE_CODES: Mapping[int, np.dtype] = types.MappingProxyType({
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 8: np.dtype("<u2")})


def idx_path(path: Path) -> Optional[Path]:
    """The Megatron ``.idx`` that goes with ``path`` (``PREFIX.bin`` or ``PREFIX``), if
    one is there and starts with Megatron's magic."""
    base = path.with_suffix("") if path.suffix == ".bin" else path
    idx = base.with_name(base.name + ".idx")
    try:
        with open(idx, "rb") as f:
            return idx if f.read(len(MAGIC)) == MAGIC else None
    except OSError:
        return None


class MegatronCorpus:
    """One ``.bin``/``.idx`` pair: ``tokens`` (a read-only memmap of the whole stream)
    and ``doc_starts`` (the token offset of every document, ascending)."""

    def __init__(self, idx: Path) -> None:
        self.idx = idx
        self.bin = idx.with_suffix(".bin")
        raw = self._read_idx()
        off = len(MAGIC) + _HEADER.size
        if len(raw) < off:
            raise DataError(f"{idx} is truncated: {len(raw)} bytes, shorter than the "
                            f"{off}-byte Megatron index header")
        version, code, n_seq, n_doc = _HEADER.unpack_from(raw, len(MAGIC))
        if version != 1:
            raise DataError(f"{idx}: Megatron index version {version} is not 1")
        if code not in DTYPE_CODES:
            raise DataError(f"{idx}: dtype code {code} is not an integer token dtype "
                            f"({', '.join(map(str, DTYPE_CODES))})")
        self.dtype = DTYPE_CODES[code]
        need = off + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if len(raw) < need:
            raise DataError(f"{idx} is truncated: {len(raw)} bytes, its header promises "
                            f"{need}")
        sizes = np.frombuffer(raw, "<i4", n_seq, off)
        pointers = np.frombuffer(raw, "<i8", n_seq, off + 4 * n_seq)
        doc_idx = np.frombuffer(raw, "<i8", n_doc, off + 12 * n_seq)
        ends = np.cumsum(sizes, dtype=np.int64)
        starts = ends - sizes
        if n_seq and not np.array_equal(pointers, starts * self.dtype.itemsize):
            raise DataError(f"{idx}: the sequences are not contiguous in {self.bin.name}; "
                            f"oases reads a Megatron corpus as one token stream")
        if n_doc == 0 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
            raise DataError(f"{idx}: malformed document index (it must rise from 0 to the "
                            f"sequence count {n_seq})")
        self.num_tokens = int(ends[-1]) if n_seq else 0
        self.doc_starts = np.append(starts, self.num_tokens)[doc_idx[:-1]]
        self.num_docs = n_doc - 1
        self.tokens = self._map()

    def _read_idx(self) -> bytes:
        try:
            return self.idx.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {self.idx}: {e.strerror or e}") from None

    def _map(self) -> np.ndarray:
        if not self.bin.is_file():
            raise DataError(f"{self.bin} does not exist (its index {self.idx} does)")
        size = self.bin.stat().st_size
        if size != self.num_tokens * self.dtype.itemsize:
            raise DataError(f"{self.bin} holds {size} bytes but {self.idx.name} describes "
                            f"{self.num_tokens} tokens of {self.dtype.itemsize} bytes")
        if size == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.bin, dtype=self.dtype, mode="r")
