"""The inputs of ``python -m oases.prepare``: files and globs of text, jsonl (plain, .gz,
.zst), parquet and HF ``datasets`` directories, read as a stream of *chunks* of bounded
size that the tokenizer workers turn into ids (:mod:`oases.cli.prepare_encode`).

A chunk is a plain tuple (it crosses to a worker process):

* ``("texts", texts, starts, ends)``: pieces of text; ``starts[i]`` / ``ends[i]`` say
  whether piece i begins / ends a document (None: every piece is a whole document). A
  plain text file is one document cut into pieces after newlines, unless a separator
  (``--split-on``) cuts it into documents.
* ``("jsonl", data, where, first_line, text_key)``: whole lines of a jsonl file, parsed
  in the worker so that JSON decoding runs in parallel too; ``where`` names the file
  and ``first_line`` numbers its first line, for the one-line error of a bad line.

Every reader yields ``(chunk, consumed)``: the chunk and the bytes of input it used up
(compressed bytes for .gz/.zst), which drive the progress bar.
"""

from __future__ import annotations

import glob
import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from oases.errors import DataError, first_line

# text handed to a worker at a time: big enough to amortise the hand-over, small
# enough that (2 x workers) chunks in flight stay well under the memory target
CHUNK_BYTES = 4 << 20
# rows asked of pyarrow / datasets at a time (a record batch inside a row group)
_ROWS = 1024


@dataclass(frozen=True)
class Input:
    path: Path
    kind: str  # "txt" | "jsonl" | "parquet" | "hf" | "builtin"

    def size(self) -> int:
        if self.kind == "builtin":
            return 0
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.path.rglob("*.arrow"))
        return self.path.stat().st_size


def _kind(p: Path) -> str:
    name = p.name.lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "hf"
    return "txt"


def _is_hf_dir(p: Path) -> bool:
    return any((p / f).is_file() for f in ("dataset_info.json", "state.json",
                                            "dataset_dict.json")) or any(p.glob("*.arrow"))


def expand(patterns: list[str]) -> list[Input]:
    """Each ``--input`` (a file, a directory or a glob), in order; a glob's matches sorted."""
    out: list[Input] = []
    for pat in patterns:
        if glob.has_magic(pat):
            hits = sorted(Path(h) for h in glob.glob(pat, recursive=True) if Path(h).is_file())
            if not hits:
                raise DataError(f"--input {pat} matches no file")
        else:
            hits = [Path(pat)]
        for p in hits:
            if p.is_dir():
                if not _is_hf_dir(p):
                    raise DataError(f"--input {p} is a directory but not a saved HF datasets "
                                    f"directory (no dataset_info.json, state.json or .arrow)")
                out.append(Input(p, "hf"))
            elif p.is_file():
                out.append(Input(p, _kind(p)))
            else:
                raise DataError(f"--input {p} does not exist")
    return out


def read(inp: Input, text_key: str, split_on: Optional[str], skip_bad: bool
         ) -> Iterator[tuple[tuple, int]]:
    """The chunks of one input (see the module docstring)."""
    if inp.kind == "builtin":
        yield from _pydoc()
    elif inp.kind == "jsonl":
        yield from _jsonl(inp.path, text_key)
    elif inp.kind == "parquet":
        yield from _parquet(inp.path, text_key, skip_bad)
    elif inp.kind == "hf":
        yield from _hf(inp.path, text_key, skip_bad)
    else:
        yield from _txt(inp.path, split_on)


def _pydoc() -> Iterator[tuple[tuple, int]]:
    """CPython's documentation topics, one document each, in sorted key order so the
    corpus is identical on every run of one Python version."""
    from pydoc_data.topics import topics  # deferred: 0.5 MB of text, --builtin only

    texts = [topics[k] for k in sorted(topics)]
    yield ("texts", texts, None, None), 0


def _txt(path: Path, split_on: Optional[str]) -> Iterator[tuple[tuple, int]]:
    """One document (or one per ``split_on``; empty ones dropped), in pieces cut after
    a newline so that no piece holds more than about a chunk."""
    chunk: tuple[list, list, list] = ([], [], [])  # texts, starts, ends
    size, used, carry, at_start, any_text = 0, 0, "", True, False
    limit = CHUNK_BYTES // 4
    try:
        f = open(path, encoding="utf-8", newline="")
    except OSError as e:
        raise DataError(f"cannot read input file {path}: {e.strerror or e}") from None
    with f:
        while True:
            try:
                block = f.read(limit)
            except UnicodeDecodeError as e:
                raise DataError(f"input file {path} is not UTF-8 text (bad byte near offset "
                                f"{f.buffer.tell() - len(e.object) + e.start})") from None
            eof, buf = not block, carry + block
            any_text = any_text or bool(block)
            if split_on:
                docs = buf.split(split_on)
                carry = "" if eof else docs.pop()
            else:
                docs, carry = ([buf], "") if eof else ([], buf)
            pieces = [(d, True) for i, d in enumerate(docs) if d or (i == 0 and not at_start)]
            if len(carry) >= limit:  # a long document: hand on a piece of it
                keep = len(split_on) if split_on else 0  # never cut inside a separator
                nl = carry.rfind("\n", 0, len(carry) - keep) + 1 or len(carry) - keep
                pieces.append((carry[:nl], False))
                carry = carry[nl:]
            for text, ends in pieces:
                for part, v in zip(chunk, (text, at_start, ends)):
                    part.append(v)
                size += len(text)
                at_start = ends
            if chunk[0] and (size >= limit or eof):
                pos = f.buffer.tell()  # bytes read so far (the progress bar counts bytes)
                yield ("texts", *chunk), pos - used
                chunk, size, used = ([], [], []), 0, pos
            if eof:
                break
    if not any_text:
        raise DataError(f"input file {path} is empty")


def open_bytes(path: Path):
    """A binary stream of the file's (decompressed) contents, its raw file, and the
    exceptions its reads raise for a corrupt or truncated file."""
    raw = open(path, "rb")
    if path.name.endswith(".gz"):  # zlib.error: a corrupt deflate stream
        return gzip.GzipFile(fileobj=raw), raw, (OSError, EOFError, zlib.error)
    if path.name.endswith(".zst"):
        try:
            import zstandard  # deferred: optional, .zst inputs only
        except ImportError:
            raw.close()
            raise DataError(f"{path} needs the 'zstandard' package: pip install zstandard"
                            ) from None
        # ZstdError is neither an OSError nor a ValueError
        return (zstandard.ZstdDecompressor().stream_reader(raw), raw,
                (OSError, zstandard.ZstdError))
    return raw, raw, (OSError,)


def _jsonl(path: Path, text_key: str) -> Iterator[tuple[tuple, int]]:
    """Whole lines, about CHUNK_BYTES at a time; the workers parse them."""
    try:
        stream, raw, corrupt = open_bytes(path)
    except OSError as e:
        raise DataError(f"cannot read input file {path}: {e.strerror or e}") from None
    line, carry, pos = 1, b"", 0
    with stream, raw:
        while True:
            try:
                block = stream.read(CHUNK_BYTES)
            except corrupt as e:
                raise DataError(f"{path}: cannot decompress: {first_line(e)}") from None
            data = carry + block
            if block:
                cut = data.rfind(b"\n") + 1
                data, carry = data[:cut], data[cut:]
            else:
                carry = b""
            if data:
                done = raw.tell()
                yield ("jsonl", data, str(path), line, text_key), done - pos
                pos = done
                line += data.count(b"\n")
            if not block:
                break


def _texts_of(column, where: str, row0: int, skip_bad: bool) -> tuple[list[str], int]:
    texts, bad = [], 0
    for i, t in enumerate(column):
        if isinstance(t, str):
            texts.append(t)
        elif skip_bad:
            bad += 1
        else:
            raise DataError(f"{where}: row {row0 + i} has no text ({t!r}); pass --skip-bad "
                            f"to skip such rows")
    return texts, bad


def _batched(batches, where: str, total_rows: int, size: int, skip_bad: bool
             ) -> Iterator[tuple[tuple, int]]:
    """Record batches of one text column -> chunks; ``consumed`` spreads ``size`` bytes
    over the rows. A skipped row's count rides along as the chunk's 5th field."""
    texts: list[str] = []
    nbytes, rows, bad, given = 0, 0, 0, 0
    for b in batches:
        col = b.column(0).to_pylist()
        t, nb = _texts_of(col, where, rows, skip_bad)
        texts += t
        bad += nb
        rows += len(col)
        nbytes += sum(len(s) for s in t)
        if nbytes >= CHUNK_BYTES:
            part = size * rows // max(total_rows, 1) - given
            given += part
            yield ("texts", texts, None, None, bad), part
            texts, nbytes, bad = [], 0, 0
    if texts or bad:
        yield ("texts", texts, None, None, bad), size - given


def arrow_errors() -> tuple:
    """What pyarrow raises for a damaged file: ArrowException (ArrowInvalid, ...),
    OSError (ArrowIOError), and UnicodeDecodeError for a string column that is not
    UTF-8."""
    import pyarrow as pa  # deferred: optional, parquet and HF inputs only

    return pa.ArrowException, OSError, UnicodeDecodeError


def _row_groups(pf, key: str, where: str) -> Iterator:
    """The record batches of column ``key``, a row group at a time (memory is a row
    group, not the file); a damaged row group is a DataError naming it."""
    errors = arrow_errors()
    for rg in range(pf.num_row_groups):
        try:
            yield from pf.iter_batches(batch_size=_ROWS, columns=[key], row_groups=[rg])
        except errors as e:
            raise DataError(f"{where}: row group {rg} of {pf.num_row_groups} cannot be read: "
                            f"{first_line(e)}") from None


def _parquet(path: Path, key: str, skip_bad: bool) -> Iterator[tuple[tuple, int]]:
    try:
        import pyarrow.parquet as pq  # deferred: optional, parquet inputs only
    except ImportError:
        raise DataError(f"{path} needs the 'pyarrow' package: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid (an Exception) for a bad file
        raise DataError(f"{path} is not a readable parquet file: {first_line(e)}") from None
    names = pf.schema_arrow.names
    if key not in names:
        raise DataError(f"parquet file {path} has no column {key!r} (columns: "
                        f"{', '.join(names)}); pass --text-key")
    yield from _batched(_row_groups(pf, key, str(path)), str(path), pf.metadata.num_rows,
                        path.stat().st_size, skip_bad)


def open_hf_parts(path: Path) -> list:
    """An HF ``datasets`` saved directory's datasets (each split), or one DataError."""
    try:
        import datasets  # deferred: optional and slow to import, HF dataset inputs only
    except ImportError:
        raise DataError(f"{path} needs the 'datasets' package: pip install datasets") from None
    try:
        return hf_parts(datasets, path)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow: any failure is a bad file
        raise DataError(f"HF dataset {path} cannot be read: {first_line(e)}") from None


def _hf(path: Path, key: str, skip_bad: bool) -> Iterator[tuple[tuple, int]]:
    parts = open_hf_parts(path)
    size = Input(path, "hf").size() or 1
    total = sum(len(d) for d in parts)
    for ds in parts:
        if key not in ds.column_names:
            raise DataError(f"HF dataset {path} has no column {key!r} (columns: "
                            f"{', '.join(ds.column_names)}); pass --text-key")
    errors = arrow_errors()
    for ds in parts:
        share = size * len(ds) // max(total, 1)
        table = ds.with_format("arrow").select_columns([key])
        try:
            yield from _batched((table[i:i + _ROWS] for i in range(0, len(ds), _ROWS)),
                                str(path), len(ds), share, skip_bad)
        except errors as e:
            raise DataError(f"HF dataset {path} cannot be read: {first_line(e)}") from None


def hf_parts(datasets, path: Path) -> list:
    """The datasets of an HF input: an .arrow file, a save_to_disk directory (its train
    split), or a directory of .arrow files."""
    if path.is_file():
        return [datasets.Dataset.from_file(str(path))]
    if any((path / f).is_file() for f in ("dataset_info.json", "state.json",
                                          "dataset_dict.json")):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            splits = sorted(ds)
            if "train" not in ds and len(splits) != 1:
                raise DataError(f"{path} holds the splits {', '.join(splits)} but no 'train'; "
                                f"pass the split's own directory")
            ds = ds["train" if "train" in ds else splits[0]]
        return [ds]
    return [datasets.Dataset.from_file(str(f)) for f in sorted(path.glob("*.arrow"))]


def parse_jsonl(data: bytes, where: str, first_line: int, key: str, skip_bad: bool
                ) -> tuple[list[str], int]:
    """The texts of whole jsonl lines (blank lines skipped), and how many lines were
    skipped as bad under ``skip_bad``; otherwise a bad line is a one-line DataError."""
    texts, bad = [], 0
    for i, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            problem = None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            rec, problem = None, f"is not JSON ({e.msg if hasattr(e, 'msg') else e})"
        if problem is None:
            text = rec.get(key) if isinstance(rec, dict) else None
            if isinstance(text, str):
                texts.append(text)
                continue
            problem = (f"has no text key {key!r}" if not isinstance(rec, dict) or key not in rec
                       else f"has a {type(text).__name__} at {key!r}, not text")
        if not skip_bad:
            raise DataError(f"{where}:{first_line + i}: the line {problem}; pass --skip-bad "
                            f"to skip bad lines" + ("" if "key" not in problem else
                                                    " or --text-key to choose the field"))
        bad += 1
    return texts, bad
