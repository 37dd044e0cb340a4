"""The conversations of ``python -m oases.prepare --chat``: rows of jsonl (plain, .gz,
.zst), parquet or a saved HF ``datasets`` directory, each either ``messages`` (a list
of ``{role, content}``, the OpenAI / HF form) or a ``prompt``/``completion`` pair (text,
or lists of messages: TRL's conversational form), checked and made into one list of
``{"role", "content"}`` messages per conversation (other keys of a message are not
kept).

A bad row (not JSON, neither form, an unknown role, no assistant message, a content
that is not text) is a DataError naming the file and its line (jsonl) or row (parquet,
HF, counted from 0)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from oases.cli.prepare_sources import Input, arrow_errors, open_bytes, open_hf_parts
from oases.errors import DataError, first_line

ROLES = ("system", "user", "assistant", "tool")
# rows asked of pyarrow / datasets at a time
_ROWS = 1024


@dataclass(frozen=True)
class Conversation:
    messages: list[dict]
    where: str  # "FILE:LINE" (jsonl) or "FILE: row N": what a one-line error names


def conversations(inp: Input, key: str) -> Iterator[tuple[Conversation, int]]:
    """Each row of ``inp`` as a checked conversation, with the input bytes it used up
    (the progress bar's unit). ``key``: the messages field (``--messages-key``)."""
    if inp.kind == "jsonl":
        yield from _jsonl(inp.path, key)
    elif inp.kind == "parquet":
        yield from _parquet(inp.path, key)
    elif inp.kind == "hf":
        yield from _hf(inp.path, key)
    else:
        raise DataError(f"--input {inp.path} is not jsonl, parquet or an HF datasets "
                        f"directory: --chat reads rows of messages")


def messages_of(row, key: str, where: str) -> list[dict]:
    """A row's conversation: ``row[key]``, else ``prompt`` + ``completion``; checked."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: the row is a {type(row).__name__}, not an object")
    if row.get(key) is not None:
        msgs = message_list(row[key], key, where)
    elif row.get("prompt") is not None and row.get("completion") is not None:
        msgs = (_turns(row["prompt"], "user", "prompt", where)
                + _turns(row["completion"], "assistant", "completion", where))
    else:
        raise DataError(f"{where}: the row has neither {key!r} nor 'prompt' and 'completion' "
                        f"(keys: {', '.join(map(str, row)) or 'none'}); pass --messages-key")
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: the conversation has no assistant message: nothing in it "
                        f"would count in the loss")
    return msgs


def _turns(v, role: str, name: str, where: str) -> list[dict]:
    """A prompt or completion: a text (one ``role`` message) or a list of messages."""
    if isinstance(v, str):
        return [{"role": role, "content": v}]
    return message_list(v, name, where)


def message_list(v, name: str, where: str) -> list[dict]:
    """``v`` (the row's ``name`` field) as a list of {role, content} messages, or one
    DataError naming ``where``: prepare's rows and generate's conversations alike."""
    if not isinstance(v, list) or not v:
        what = "an empty list" if isinstance(v, list) else f"a {type(v).__name__}"
        raise DataError(f"{where}: {name!r} is {what}, not a list of {{role, content}} messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise DataError(f"{where}: {name}[{i}] is a {type(m).__name__}, not a "
                            f"{{role, content}} message")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: {name}[{i}] has the role {role!r}, not one of "
                            f"{', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: {name}[{i}] ({role}) has a {type(content).__name__} "
                            f"content, not text")
        out.append({"role": role, "content": content})
    return out


def _jsonl(path: Path, key: str) -> Iterator[tuple[Conversation, int]]:
    try:
        stream, raw, corrupt = open_bytes(path)
    except OSError as e:
        raise DataError(f"cannot read input file {path}: {e.strerror or e}") from None
    pos = 0
    with stream, raw:
        try:
            for n, line in enumerate(_lines(stream), start=1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{where}: the line is not JSON "
                                    f"({getattr(e, 'msg', e)})") from None
                done = raw.tell()
                yield Conversation(messages_of(row, key, where), where), done - pos
                pos = done
        except corrupt as e:
            raise DataError(f"{path}: cannot decompress: {first_line(e)}") from None


def _lines(stream, block: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a binary stream (a .zst reader iterates no lines of its own)."""
    carry = b""
    while True:
        data = stream.read(block)
        if not data:
            break
        parts = (carry + data).split(b"\n")
        carry = parts.pop()
        yield from parts
    if carry:
        yield carry


def _columns(names: list[str], key: str, where: str) -> list[str]:
    if key in names:
        return [key]
    if "prompt" in names and "completion" in names:
        return ["prompt", "completion"]
    raise DataError(f"{where} has no column {key!r} nor 'prompt' and 'completion' (columns: "
                    f"{', '.join(names)}); pass --messages-key")


def _rows(batches, where: str, key: str, total_rows: int, size: int
          ) -> Iterator[tuple[Conversation, int]]:
    """Record batches -> conversations; ``size`` bytes spread over the rows."""
    row, given = 0, 0
    for b in batches:
        for rec in b.to_pylist():
            here = f"{where}: row {row}"
            row += 1
            part = size * row // max(total_rows, 1) - given
            given += part
            yield Conversation(messages_of(rec, key, here), here), part


def _parquet(path: Path, key: str) -> Iterator[tuple[Conversation, int]]:
    try:
        import pyarrow.parquet as pq  # deferred: optional, parquet inputs only
    except ImportError:
        raise DataError(f"{path} needs the 'pyarrow' package: pip install pyarrow") from None
    errors = arrow_errors()
    try:
        pf = pq.ParquetFile(path)
    except errors as e:
        raise DataError(f"{path} is not a readable parquet file: {first_line(e)}") from None
    cols = _columns(pf.schema_arrow.names, key, f"parquet file {path}")
    try:
        yield from _rows(pf.iter_batches(batch_size=_ROWS, columns=cols), str(path), key,
                         pf.metadata.num_rows, path.stat().st_size)
    except errors as e:
        raise DataError(f"{path} cannot be read: {first_line(e)}") from None


def _hf(path: Path, key: str) -> Iterator[tuple[Conversation, int]]:
    parts = open_hf_parts(path)
    size = Input(path, "hf").size() or 1
    total = sum(len(d) for d in parts)
    errors = arrow_errors()
    for k, ds in enumerate(parts):
        cols = _columns(ds.column_names, key, f"HF dataset {path}")
        where = str(path) if len(parts) == 1 else f"{path} (file {k})"
        table = ds.with_format("arrow").select_columns(cols)
        try:
            yield from _rows((table[i:i + _ROWS] for i in range(0, len(ds), _ROWS)), where,
                             key, len(ds), size * len(ds) // max(total, 1))
        except errors as e:
            raise DataError(f"HF dataset {path} cannot be read: {first_line(e)}") from None
