"""Check that every rank issues the same collectives on each group in the same order.

NCCL runs a group's collectives in issue order on one stream: two ranks that
issue them in different orders (or one rank an extra one) hang or exchange the
wrong tensors; gloo often survives it by luck of sizes. :func:`install` wraps
``torch.distributed``'s collectives in this process and records, per process
group (by name: groups are named in creation order, the same on every rank), each
call's op, shapes and dtype (of an object list its length: its objects are the
source's alone), from whichever thread issues it (autograd hooks included).
:func:`dump` writes the log; :func:`compare` reads every rank's log and names the
first divergence.
"""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
               "reduce", "gather", "scatter", "barrier", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list", "new_group",
               "destroy_process_group")
_GROUP_ARG = {"new_group": None, "destroy_process_group": "group"}

LOG: dict[str, list] = {}
_LOCK = threading.Lock()
_PATCHED: list[tuple[object, str, object]] = []
_DEPTH = threading.local()   # a collective implemented by another records once


def _describe(x) -> object:
    if isinstance(x, torch.Tensor):
        return [list(x.shape), str(x.dtype).replace("torch.", "")]
    if isinstance(x, (list, tuple)):
        return [_describe(v) for v in x]
    return None


def _group_of(name: str, args, kwargs):
    if name == "new_group":   # collective over the world
        return None
    if name == "destroy_process_group":
        return kwargs.get("group", args[0] if args else None)
    return kwargs.get("group")


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if getattr(_DEPTH, "n", 0):
            return fn(*args, **kwargs)
        g = _group_of(name, args, kwargs)
        if name == "destroy_process_group" and g is None:
            return fn(*args, **kwargs)   # the whole world's teardown, after dump()
        gname = "world" if g is None or g is c10d._get_default_group() else g.group_name
        entry = [name, _describe(args[0]) if args and name not in _GROUP_ARG else None]
        if name.endswith(("_object", "_object_list")):  # objects: what only the source holds
            entry[1] = len(args[0]) if name.endswith("_list") and args else None
        if name == "new_group":
            entry[1] = list(kwargs.get("ranks", args[0] if args else []) or [])
        with _LOCK:
            LOG.setdefault(gname, []).append(entry)
        _DEPTH.n = 1
        try:
            return fn(*args, **kwargs)
        finally:
            _DEPTH.n = 0

    return call


def install() -> None:
    """Record this process's collectives from now on (after ``init_process_group``)."""
    if _PATCHED:
        raise RuntimeError("the collective-order recorder is installed already")
    LOG.clear()
    for name in COLLECTIVES:
        orig = getattr(c10d, name)
        wrapped = _wrap(name, orig)
        for mod in (dist, c10d):
            _PATCHED.append((mod, name, getattr(mod, name)))
            setattr(mod, name, wrapped)


def uninstall() -> None:
    while _PATCHED:
        mod, name, fn = _PATCHED.pop()
        setattr(mod, name, fn)


def members() -> dict[str, list[int]]:
    """Global ranks of every group this rank belongs to, by name."""
    out = {"world": list(range(dist.get_world_size()))}
    for g in c10d._world.pg_group_ranks:   # non-members hold a placeholder int
        if isinstance(g, dist.ProcessGroup) and g is not c10d._get_default_group():
            out[g.group_name] = sorted(c10d._world.pg_group_ranks[g])
    return out


def dump(path: Path) -> None:
    with _LOCK:
        log = {k: list(v) for k, v in LOG.items()}
    Path(path).write_text(json.dumps({"rank": dist.get_rank(), "log": log,
                                      "members": members()}))


def compare(paths: list[Path]) -> None:
    """Raise AssertionError at the first collective where two ranks of a group differ."""
    logs = [json.loads(Path(p).read_text()) for p in paths]
    groups: dict[str, dict[int, list]] = {}
    ranks_of: dict[str, list[int]] = {}
    for d in logs:
        for gname, ranks in d["members"].items():
            ranks_of[gname] = ranks
            groups.setdefault(gname, {})[d["rank"]] = d["log"].get(gname, [])
    for gname, by_rank in sorted(groups.items()):
        ranks = sorted(by_rank)
        if len(ranks) < 2:
            continue
        ref_rank = ranks[0]
        ref = by_rank[ref_rank]
        for r in ranks[1:]:
            seq = by_rank[r]
            for i in range(max(len(ref), len(seq))):
                a = ref[i] if i < len(ref) else "nothing"
                b = seq[i] if i < len(seq) else "nothing"
                if a != b:
                    raise AssertionError(
                        f"collective order differs on group {gname} (ranks "
                        f"{ranks_of[gname]}) at call {i}: rank {ref_rank} issued {a}, "
                        f"rank {r} issued {b}")
