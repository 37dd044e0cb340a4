"""Read an offline W&B run's records (``<dir>/run-<id>.wandb``) without the network.

The file is W&B's LevelDB-style log: a 7-byte header (``:W&B``, magic, version), then
32 KiB blocks of chunks, each a 7-byte header (CRC32, length, type: 1 full, 2 first,
3 middle, 4 last) and a piece of one serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32768


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb  # deferred: the W&B tests only

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and n == 0):  # the block's padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def history(path: Path) -> list[dict]:
    """Each ``wandb.log`` call's values by key."""
    return [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def step_metrics(path: Path) -> dict[str, str]:
    """``define_metric`` glob or name -> its step metric."""
    return {(r.metric.glob_name or r.metric.name): r.metric.step_metric
            for r in records(path) if r.WhichOneof("record_type") == "metric"}
