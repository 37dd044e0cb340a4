"""NCCL point-to-point semantics over gloo, so that a CPU test fails where NCCL would hang.

gloo forgives what NCCL does not. gloo matches a message by (peer, tag) and moves
each one on its own; ProcessGroupNCCL runs the sends and receives of a process
group on one communicator and one stream, in issue order, both directions, and
ignores tags. A receive holds that stream until its send runs, and a send holds it
until its receive runs. With the communicator initialised eagerly
(``init_process_group(device_id=...)``), unbatched p2p ops of a group share the
group's stream with every peer, and its collectives ("serialized with all other
ops on this ProcessGroup" in torch's warning); created lazily, each rank pair of a
group gets its own. Ops posted together by ``batch_isend_irecv`` progress together.

:func:`install` replaces ``dist.isend``/``irecv``/``send``/``recv``/
``batch_isend_irecv`` in this process with that model:

* one FIFO **channel** per process group (``per="group"``, eager init, the
  default and the stricter) or per process group and peer (``per="pair"``);
  a channel is a thread that runs its units (one op, or one batch) in issue order;
* the n-th send from a to b on a group meets the n-th receive on b from a
  (tags are ignored: the data moves with gloo tag 2n);
* a send completes only when its receive *runs* (the receiver's channel acks,
  gloo tag 2n+1), a receive when the data is in;
* a unit that cannot complete within ``timeout_s`` is a deadlock: ``wait()``
  raises ``NcclDeadlock`` naming the rank, the peer, the op and what the peer's
  channel is doing, instead of hanging.

Collectives stay gloo's; :mod:`tests.support.collective_order` checks their order.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_ORIG = {name: getattr(c10d, name) for name in ("isend", "irecv", "send", "recv",
                                                  "batch_isend_irecv")}
_PATCHED: list[tuple[object, str, object]] = []


class NcclDeadlock(RuntimeError):
    """A point-to-point op that NCCL would never complete."""


def _group(g) -> dist.ProcessGroup:
    return g if g is not None else c10d._get_default_group()


def _name(g: dist.ProcessGroup) -> str:
    return "world" if g is c10d._get_default_group() else g.group_name


@dataclass
class _Op:
    kind: str                  # "send" | "recv"
    tensor: torch.Tensor
    peer: int                  # global rank
    group: dist.ProcessGroup
    tag: int                   # the caller's, ignored as NCCL does
    seq: int = -1              # n-th op of this direction on this group

    def __str__(self) -> str:
        verb, prep = ("isend", "to") if self.kind == "send" else ("irecv", "from")
        return (f"{verb} #{self.seq} {prep} rank {self.peer} on group {_name(self.group)} "
                f"(shape {tuple(self.tensor.shape)}, tag {self.tag} ignored)")


@dataclass
class _Unit:
    ops: list
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None


class _Work:
    """What the patched functions return: ``wait()`` blocks the host until the unit ran."""

    def __init__(self, unit: _Unit, timeout_s: float) -> None:
        self._unit, self._timeout = unit, timeout_s

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self._unit.done.wait(self._timeout * 2 + 5):
            raise NcclDeadlock(f"rank {dist.get_rank()}: {self._unit.ops[0]} never ran: its "
                               f"channel is stuck behind an earlier op")
        if self._unit.error:
            raise NcclDeadlock(self._unit.error)
        return True

    def is_completed(self) -> bool:
        return self._unit.done.is_set()

    def is_success(self) -> bool:
        return self._unit.done.is_set() and not self._unit.error


class _Channel:
    """One NCCL stream: runs its units in issue order on its own thread."""

    def __init__(self, emu: "_Emulator", key: tuple) -> None:
        self.emu, self.key, self.q = emu, key, queue.Queue()
        self.broken: Optional[str] = None
        threading.Thread(target=self._loop, daemon=True, name=f"nccl-sem {key}").start()

    def _loop(self) -> None:
        while True:
            unit = self.q.get()
            if self.broken:
                unit.error = self.broken
            else:
                try:
                    self._run(unit)
                except Exception as e:  # a deadlock, or gloo's own failure
                    unit.error = self.broken = str(e)
            unit.done.set()

    def _run(self, unit: _Unit) -> None:
        emu, rank = self.emu, dist.get_rank()
        emu.publish(self.key, " + ".join(map(str, unit.ops)))
        works = []   # (what, work, op): every op of the unit is posted before any wait
        for op in unit.ops:
            ack = torch.zeros(1)
            data_tag, ack_tag = 2 * op.seq, 2 * op.seq + 1
            if op.kind == "send":
                works.append(("data", _ORIG["isend"](op.tensor.contiguous(), op.peer,
                                                     op.group, data_tag), op))
                works.append(("ack", _ORIG["irecv"](ack, op.peer, op.group, ack_tag), op))
            else:   # the ack says: this receive runs now
                works.append(("ack", _ORIG["isend"](ack, op.peer, op.group, ack_tag), op))
                works.append(("data", _ORIG["irecv"](op.tensor, op.peer, op.group,
                                                     data_tag), op))
        deadline = time.monotonic() + emu.timeout_s
        for what, w, op in works:
            left = max(deadline - time.monotonic(), 0.001)
            try:
                w.wait(timedelta(seconds=left))
            except RuntimeError as e:
                if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                    raise
                peer_is = emu.peer_state(op)
                raise NcclDeadlock(
                    f"NCCL semantics: deadlock at rank {rank}: {op} did not complete within "
                    f"{emu.timeout_s:g}s; peer rank {op.peer} is at: {peer_is}") from None
        emu.publish(self.key, "idle")


class _Emulator:
    def __init__(self, per: str, timeout_s: float) -> None:
        if per not in ("group", "pair"):
            raise ValueError(f"per={per!r} must be 'group' or 'pair'")
        self.per, self.timeout_s = per, timeout_s
        self.channels: dict[tuple, _Channel] = {}
        self.seq: dict[tuple, itertools.count] = {}
        self.lock = threading.Lock()
        self.store = c10d._get_default_store()

    def channel_key(self, op: _Op, rank: int) -> tuple:
        return (_name(op.group),) if self.per == "group" else (_name(op.group), op.peer)

    def publish(self, key: tuple, what: str) -> None:
        self.store.set(f"nccl_sem/{dist.get_rank()}/{'/'.join(map(str, key))}", what)

    def peer_state(self, op: _Op) -> str:
        rank = dist.get_rank()
        key = (_name(op.group),) if self.per == "group" else (_name(op.group), rank)
        k = f"nccl_sem/{op.peer}/{'/'.join(map(str, key))}"
        try:
            if self.store.check([k]):
                return self.store.get(k).decode()
        except Exception:   # the store itself may be gone while the test fails
            pass
        return "nothing posted on this channel"

    def post(self, ops: list) -> list:
        rank = dist.get_rank()
        units: dict[tuple, _Unit] = {}
        with self.lock:   # sequence numbers and channel order follow issue order
            for op in ops:
                direction = (_name(op.group), rank, op.peer) if op.kind == "send" else \
                    (_name(op.group), op.peer, rank)
                op.seq = next(self.seq.setdefault(direction, itertools.count()))
                key = self.channel_key(op, rank)
                units.setdefault(key, _Unit([])).ops.append(op)
            for key, unit in units.items():
                if key not in self.channels:
                    self.channels[key] = _Channel(self, key)
                self.channels[key].q.put(unit)
        by_op = {id(op): unit for unit in units.values() for op in unit.ops}
        return [_Work(by_op[id(op)], self.timeout_s) for op in ops]


_EMU: Optional[_Emulator] = None


def _op(kind: str, tensor, peer, group, tag, group_peer) -> _Op:
    g = _group(group)
    if peer is None:
        peer = dist.get_global_rank(g, group_peer)
    return _Op(kind, tensor, peer, g, tag)


def _isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _EMU.post([_op("send", tensor, dst, group, tag, group_dst)])[0]


def _irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return _EMU.post([_op("recv", tensor, src, group, tag, group_src)])[0]


def _send(tensor, dst=None, group=None, tag=0, group_dst=None):
    _isend(tensor, dst, group, tag, group_dst).wait()


def _recv(tensor, src=None, group=None, tag=0, group_src=None):
    _irecv(tensor, src, group, tag, group_src).wait()
    return src


def _batch_isend_irecv(p2p_op_list):
    ops = [_op("send" if p.op in (_isend, _ORIG["isend"]) else "recv", p.tensor, p.peer,
               p.group, p.tag, None) for p in p2p_op_list]
    return _EMU.post(ops)


def install(per: str = "group", timeout_s: float = 15.0) -> None:
    """Give this process NCCL's p2p semantics (call after ``init_process_group``)."""
    global _EMU
    if _EMU is not None:
        raise RuntimeError("NCCL semantics are installed already")
    _EMU = _Emulator(per, timeout_s)
    new = {"isend": _isend, "irecv": _irecv, "send": _send, "recv": _recv,
           "batch_isend_irecv": _batch_isend_irecv}
    for mod in (dist, c10d):
        for name, fn in new.items():
            _PATCHED.append((mod, name, getattr(mod, name)))
            setattr(mod, name, fn)


def uninstall() -> None:
    global _EMU
    while _PATCHED:
        mod, name, fn = _PATCHED.pop()
        setattr(mod, name, fn)
    _EMU = None
