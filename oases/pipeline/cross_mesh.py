"""Cross-mesh resharding: move an activation between pipeline stages whose layouts differ.

A stage runs on a :class:`Mesh` of ``dp x tp`` global ranks, TP ranks contiguous
(one replica = one TP group, in a real cluster one node's fast links)::

    Mesh(first=4, dp=2, tp=2):   replica 0 = ranks {4, 5}   rows [0, B/2)
                                 replica 1 = ranks {6, 7}   rows [B/2, B)

An activation (B, S, *tail) is split by rows over the replicas and replicated
over the tp ranks of a replica. Crossing a stage boundary, dst replica j needs
rows(j); src replica i holds rows(i). Paper 002 (sections 3.1-3.2):

* **unit tasks**: each non-empty rows(i) & rows(j) is one slice; it is cut into
  ``split`` pieces along the sequence (default src.tp, so every rank of the src
  replica can send one piece over its own link);
* **broadcast per unit task**: one sender sends the piece once over the slow
  link to a *leader* of the dst replica, which broadcasts it inside the replica
  (fast links): each byte crosses the slow link once;
* **load balance**: pieces, largest first, go to the least-loaded sender, load
  counted per host (``host_of``) since the host NIC is the bottleneck; leaders
  likewise by received bytes.

World 8, src Mesh(0, 1, 4) -> dst Mesh(4, 2, 2), batch 4, split 2 (plan_tasks)::

    task  rows    cols      sender  receivers (leader first)
    0     [0,2)   [0,S/2)   0       (4, 5)
    1     [0,2)   [S/2,S)   1       (5, 4)
    2     [2,4)   [0,S/2)   2       (6, 7)
    3     [2,4)   [S/2,S)   3       (7, 6)

Methods of :class:`CrossMeshTransfer` (bit-identical results, different traffic):

    method      slow-link bytes per dst replica     fan-out inside the replica
    broadcast   1 x its rows (balanced senders)     dist.broadcast from the leader
    send        tp x its rows (naive baseline)      none
    allgather   1 x its rows (Megatron's            dist.all_gather of tp pieces
                scatter-gather)

Sequence-sharded activations (``sharded=True``, sequence parallelism): src TP rank t
of replica i holds rows(i) x positions [t S/src.tp, (t+1) S/src.tp), and dst TP rank u
of replica j wants rows(j) x its own 1/dst.tp of the positions. Each (rows, positions)
intersection of a src rank's chunk and a dst rank's is one message between them: every
byte crosses once, from the rank that holds it to the one that wants it, with no
gather before and no fan-out after (the methods coincide).

Point-to-point and why it cannot deadlock on NCCL. ProcessGroupNCCL runs the
sends and receives of a process group in issue order on one stream per rank
(eager init: shared with every peer and the group's collectives; lazy: one per
rank pair), ignores tags, and a send or receive holds that stream until its
partner runs. So each transfer (one direction of one boundary) has **its own
process group** over src + dst ranks, on which src ranks only send and dst ranks
only receive, each in the order (call, message k): every rank's ops on the group
follow one global order, so the earliest unfinished message always has both ends
at it, however early the receives are posted and whatever runs on the other
direction's group (``python -m oases.schedule --p2p`` prints these orders). gloo
matches by (peer, tag): message k carries tag k, and successive calls of one
transfer (several in flight) arrive in posting order. Plain ``isend``/``irecv``,
not ``batch_isend_irecv`` (it hangs on gloo: pytorch/PiPPy#1130): with one
direction per group nothing needs to progress together. The fan-out collectives
run on each dst replica's group, which is that replica's TP group (one communicator),
in task order on every rank of the replica.

A transfer moves tensors in the dtype it is given (the pipeline's wire dtype,
:mod:`oases.pipeline.runner`); each message is counted by :class:`CommCounter` on both
ends (``send``, ``recv``) and each fan-out collective on the dst ranks (``fan_out``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from oases.parallel.comm import CommCounter
from oases.parallel.ranks import new_group, transfer_specs

METHODS = ("broadcast", "send", "allgather")


@dataclass(frozen=True)
class Mesh:
    """Global ranks ``first .. first + dp*tp - 1``; replica d = ``first + d*tp + t``, t < tp."""

    first: int
    dp: int
    tp: int

    def __post_init__(self) -> None:
        for k in ("first", "dp", "tp"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k == "first" else 1):
                raise ValueError(f"Mesh.{k}={v!r} must be an integer >= {0 if k == 'first' else 1}")

    @property
    def size(self) -> int:
        return self.dp * self.tp

    @property
    def ranks(self) -> list[int]:
        return list(range(self.first, self.first + self.size))

    def replica(self, d: int) -> list[int]:
        if not 0 <= d < self.dp:
            raise ValueError(f"replica {d} out of range for dp={self.dp}")
        return [self.first + d * self.tp + t for t in range(self.tp)]

    def replica_of(self, rank: int) -> Optional[int]:
        off = rank - self.first
        return off // self.tp if 0 <= off < self.size else None

    def rows(self, d: int, batch: int) -> tuple[int, int]:
        """Rows [start, stop) of a batch of ``batch`` rows held by replica d."""
        n = batch // self.dp
        return d * n, (d + 1) * n


@dataclass(frozen=True)
class Task:
    """Paper 002's unit communication task: one piece of one (src, dst) row intersection."""

    rows: tuple[int, int]           # batch rows [start, stop) of the global micro-batch
    cols: tuple[int, int]           # sequence positions [start, stop)
    src_replica: int
    dst_replica: int
    sender: int                     # one of the src replica's ranks
    receivers: tuple[int, ...]      # the dst replica's ranks; [0] = leader (gets it over the link)

    @property
    def numel(self) -> int:
        """Elements per unit of tail (rows x cols): the size the balancer compares."""
        return (self.rows[1] - self.rows[0]) * (self.cols[1] - self.cols[0])


def _check_batch(src: Mesh, dst: Mesh, batch: int, seq: int) -> None:
    if batch < 1 or batch % src.dp or batch % dst.dp:
        raise ValueError(f"batch {batch} must be a positive multiple of src dp {src.dp} "
                         f"and dst dp {dst.dp}")
    if seq < 1:
        raise ValueError(f"seq {seq} must be >= 1")


def _overlaps(src: Mesh, dst: Mesh, batch: int) -> list[tuple[int, int, tuple[int, int]]]:
    """(src replica, dst replica, intersecting rows) for every non-empty intersection."""
    out = []
    for i in range(src.dp):
        a0, a1 = src.rows(i, batch)
        for j in range(dst.dp):
            b0, b1 = dst.rows(j, batch)
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((i, j, (lo, hi)))
    return out


def plan_tasks(src: Mesh, dst: Mesh, batch: int, seq: int, split: Optional[int] = None,
               host_of: Optional[Callable[[int], int]] = None) -> list[Task]:
    """The broadcast method's unit tasks, senders and leaders. Pure and deterministic:
    every rank computes the same list (in processing order: largest first, ties by
    (rows, cols) position).

    Greedy least-load (paper 002 section 3.2, "load balance only", optimal for the
    min-max of per-host loads up to the usual LPT bound): each piece goes to the src
    replica rank whose *host* has sent the fewest elements so far, then whose rank
    has, then the lowest rank; the leader is chosen among the dst replica's ranks
    the same way by received elements.
    """
    _check_batch(src, dst, batch, seq)
    split = src.tp if split is None else split
    if split < 1:
        raise ValueError(f"split {split} must be >= 1")
    split = min(split, seq)
    host_of = host_of or (lambda r: r)
    pieces = []
    for i, j, rows in _overlaps(src, dst, batch):
        for k in range(split):
            cols = (k * seq // split, (k + 1) * seq // split)
            pieces.append((i, j, rows, cols))
    pieces.sort(key=lambda p: (-(p[2][1] - p[2][0]) * (p[3][1] - p[3][0]), p[2], p[3]))

    sent_host: dict[int, int] = {}
    sent_rank: dict[int, int] = {}
    recv_host: dict[int, int] = {}
    recv_rank: dict[int, int] = {}

    def pick(cands: list[int], by_host: dict, by_rank: dict, n: int) -> int:
        best = min(cands, key=lambda r: (by_host.get(host_of(r), 0), by_rank.get(r, 0), r))
        by_host[host_of(best)] = by_host.get(host_of(best), 0) + n
        by_rank[best] = by_rank.get(best, 0) + n
        return best

    tasks = []
    for i, j, rows, cols in pieces:
        n = (rows[1] - rows[0]) * (cols[1] - cols[0])
        sender = pick(src.replica(i), sent_host, sent_rank, n)
        reps = dst.replica(j)
        leader = pick(reps, recv_host, recv_rank, n)
        tasks.append(Task(rows, cols, i, j, sender,
                          (leader, *[r for r in reps if r != leader])))
    return tasks


# ---------------------------------------------------------------------------
# Messages: the point-to-point traffic of one method, computed alike on every rank


@dataclass(frozen=True)
class _Msg:
    """One isend/irecv of rows x cols of the global batch. For allgather, ``piece`` =
    (k, parts): the k-th of ``parts`` equal chunks of the flattened slice rows x (0, S)."""

    src: int
    dst: int
    rows: tuple[int, int]
    cols: tuple[int, int]
    piece: Optional[tuple[int, int]] = None


def _chunk(n: int, k: int, parts: int) -> tuple[int, int, int]:
    """(start, stop, chunk) of flat chunk k of ``parts`` over n elements; the last chunks
    may be short or empty (all_gather needs equal chunks: the receiver pads)."""
    c = -(-n // parts)
    return min(k * c, n), min((k + 1) * c, n), c


class Pending:
    """A posted transfer. ``wait()`` exactly once: it completes the messages (and, on
    dst ranks, the fan-out) and returns the received tensor (None on src ranks).
    Until then it holds every buffer the communication reads or writes."""

    def __init__(self, finish: Callable[[], Optional[torch.Tensor]], keep: list) -> None:
        self._finish, self._keep, self._done = finish, keep, False

    def wait(self) -> Optional[torch.Tensor]:
        if self._done:
            raise RuntimeError("Pending.wait() called twice")
        self._done = True
        try:
            return self._finish()
        finally:
            self._finish, self._keep = None, []


class CrossMeshTransfer:
    """One direction across one boundary. Built collectively: every rank of the world
    constructs every transfer in the same order (it creates process groups with
    dist.new_group). src ranks call ``send``, dst ranks ``recv``, then ``wait`` on
    the returned :class:`Pending`. Several calls may be in flight (send, send, ...,
    wait, wait); every rank of the transfer posts them and waits them in the same
    order (the dst fan-out collectives are issued inside ``wait``).

    On CUDA (NCCL) the p2p and fan-out run on NCCL's streams; ``work.wait()`` makes
    the *current* stream wait for them, so the tensor ``wait()`` returns is ready for
    kernels on the stream that called ``wait()`` (the stage's compute stream); call
    ``wait()`` on that stream. Pending holds every send/receive buffer until the works
    completed, and ProcessGroupNCCL records its stream on them, so the caching allocator
    cannot hand their memory to another stream while NCCL still reads or writes it.
    """

    def __init__(self, src: Mesh, dst: Mesh, batch: int, seq: int, method: str = "broadcast",
                 host_of: Optional[Callable[[int], int]] = None,
                 split: Optional[int] = None, sharded: bool = False) -> None:
        if method not in METHODS:
            raise ValueError(f"method {method!r} must be one of {', '.join(METHODS)}")
        if sharded and (seq % src.tp or seq % dst.tp):
            raise ValueError(f"sequence-sharded transfer: seq {seq} must divide by src tp "
                             f"{src.tp} and dst tp {dst.tp}")
        shared = sorted(set(src.ranks) & set(dst.ranks))
        if shared:
            raise ValueError(f"src {src} and dst {dst} share ranks {shared}: "
                             f"the meshes must be disjoint")
        _check_batch(src, dst, batch, seq)
        world = dist.get_world_size()
        top = max(src.ranks[-1], dst.ranks[-1])
        if top >= world:
            raise ValueError(f"src {src} / dst {dst} need rank {top} but the world has {world}")
        self.src, self.dst, self.batch, self.seq = src, dst, batch, seq
        self.method, self.sharded = method, sharded
        self.rank = dist.get_rank()
        self.is_src = src.replica_of(self.rank) is not None
        self.is_dst = dst.replica_of(self.rank) is not None
        self.tasks = [] if sharded else plan_tasks(src, dst, batch, seq, split, host_of)
        self.msgs = self._shard_messages() if sharded else self._messages()
        # This direction's own p2p group (module docstring), never shared: another group's
        # ops on it would queue between a receive posted early and its send (pp 2, one rank
        # per stage, tied embeddings: stage 1's tie all-reduce comes before its last SEND_B,
        # stage 0's after its RECV_B). Each dst replica's fan-out group has the ranks of that
        # replica's TP group and is that group (new_group shares it): all its members issue
        # the fan-out inside wait() at the same point of one action list, as their TP
        # collectives, so each issues the union in one order (DESIGN section 10); the fan-out
        # is on the critical path of its consumer anyway. Collective: one order on every rank.
        self.p2p = self.group = None
        for spec in transfer_specs(src, dst, method, sharded):
            g = new_group(spec.ranks, p2p=spec.p2p)
            if spec.p2p:
                self.p2p = g
            elif self.rank in spec.ranks:
                self.group = g

    def message_sizes(self, tail_numel: int) -> list[tuple[int, int, int]]:
        """(sender, receiver, elements) of every point-to-point message, for a tail of
        ``tail_numel`` elements per (row, position): the cross-mesh traffic of one call."""
        out = []
        for m in self.msgs:
            n = (m.rows[1] - m.rows[0]) * (m.cols[1] - m.cols[0]) * tail_numel
            if m.piece is not None:
                a, b, _ = _chunk(n, *m.piece)
                n = b - a
            out.append((m.src, m.dst, n))
        return out

    def _messages(self) -> list[_Msg]:
        if self.method == "broadcast":   # message k = task k, sender -> leader
            return [_Msg(t.sender, t.receivers[0], t.rows, t.cols) for t in self.tasks]
        src, dst, msgs = self.src, self.dst, []
        for i, j, rows in _overlaps(src, dst, self.batch):
            for t, r in enumerate(dst.replica(j)):
                sender = src.replica(i)[t % src.tp]   # same TP position, no balancing
                piece = (t, dst.tp) if self.method == "allgather" else None
                msgs.append(_Msg(sender, r, rows, (0, self.seq), piece))
        return msgs

    def _shard_messages(self) -> list[_Msg]:
        """``sharded``: one message per (rows, positions) intersection of a src rank's
        chunk and a dst rank's, in (replica pair, dst position, src position) order."""
        src, dst, msgs = self.src, self.dst, []
        for i, j, rows in _overlaps(src, dst, self.batch):
            for u, r in enumerate(dst.replica(j)):
                for t, q in enumerate(src.replica(i)):
                    lo = max(self._cols(src, t)[0], self._cols(dst, u)[0])
                    hi = min(self._cols(src, t)[1], self._cols(dst, u)[1])
                    if lo < hi:
                        msgs.append(_Msg(q, r, rows, (lo, hi)))
        return msgs

    def _cols(self, mesh: Mesh, t: int) -> tuple[int, int]:
        """The sequence positions TP rank t of a replica of ``mesh`` holds (all, unless
        ``sharded``)."""
        if not self.sharded:
            return 0, self.seq
        n = self.seq // mesh.tp
        return t * n, (t + 1) * n

    def _p2p(self, kind: str, buf: torch.Tensor, peer: int, k: int):
        """Post message k (``kind``: "send" or "recv") on this direction's group."""
        CommCounter.record(kind, buf)
        op = dist.isend if kind == "send" else dist.irecv
        return op(buf, peer, group=self.p2p, tag=k)

    def _tp_rank(self, mesh: Mesh) -> int:
        return (self.rank - mesh.first) % mesh.tp

    # -- src side ------------------------------------------------------------
    def send(self, x: torch.Tensor) -> Pending:
        """Post this rank's messages; x = this replica's rows, (B/src.dp, S, *tail)
        (``sharded``: this rank's positions, (B/src.dp, S/src.tp, *tail))."""
        if not self.is_src:
            raise ValueError(f"rank {self.rank} is not in the src mesh {self.src}")
        i = self.src.replica_of(self.rank)
        c0, c1 = self._cols(self.src, self._tp_rank(self.src))
        want = (self.batch // self.src.dp, c1 - c0)
        if tuple(x.shape[:2]) != want:
            raise ValueError(f"send: x has shape {tuple(x.shape)}, expected {want} + tail")
        x = x.contiguous()
        off = self.src.rows(i, self.batch)[0]
        works, keep = [], [x]
        for k, m in enumerate(self.msgs):
            if m.src != self.rank:
                continue
            part = x[m.rows[0] - off:m.rows[1] - off, m.cols[0] - c0:m.cols[1] - c0]
            if m.piece is not None:
                flat = part.reshape(-1)                  # a view: x is contiguous, cols full
                a, b, _ = _chunk(flat.numel(), *m.piece)
                if a == b:
                    continue                             # empty chunk: the receiver skips it too
                part = flat[a:b]
            buf = part.contiguous()                      # a copy only when cols are split
            keep.append(buf)
            works.append(self._p2p("send", buf, m.dst, k))

        def finish() -> None:
            for w in works:
                w.wait()

        return Pending(finish, keep)

    # -- dst side ------------------------------------------------------------
    def recv(self, tail: tuple, dtype: torch.dtype, device) -> Pending:
        """Post this rank's receives; ``wait()`` returns (B/dst.dp, S, *tail), contiguous
        (``sharded``: this rank's positions, (B/dst.dp, S/dst.tp, *tail))."""
        if not self.is_dst:
            raise ValueError(f"rank {self.rank} is not in the dst mesh {self.dst}")
        j = self.dst.replica_of(self.rank)
        off = self.dst.rows(j, self.batch)[0]
        c0, c1 = self._cols(self.dst, self._tp_rank(self.dst))
        out = torch.empty((self.batch // self.dst.dp, c1 - c0, *tail), dtype=dtype,
                          device=device)
        if self.sharded:
            return self._recv_sharded(off, c0, out)
        post = {"broadcast": self._recv_broadcast, "send": self._recv_send,
                "allgather": self._recv_allgather}[self.method]
        return post(j, off, out)

    def _recv_sharded(self, off: int, c0: int, out: torch.Tensor) -> Pending:
        posted = []   # (buffer, view of out, irecv work), in message order
        for k, m in enumerate(self.msgs):
            if m.dst != self.rank:
                continue
            view = out[m.rows[0] - off:m.rows[1] - off, m.cols[0] - c0:m.cols[1] - c0]
            buf = view if view.is_contiguous() else torch.empty_like(view)
            posted.append((buf, view, self._p2p("recv", buf, m.src, k)))

        def finish() -> torch.Tensor:
            for buf, view, work in posted:
                work.wait()
                if buf is not view:
                    view.copy_(buf)
            return out

        return Pending(finish, [out, posted])

    def _recv_send(self, j: int, off: int, out: torch.Tensor) -> Pending:
        works = [self._p2p("recv", out[m.rows[0] - off:m.rows[1] - off], m.src, k)
                 for k, m in enumerate(self.msgs) if m.dst == self.rank]   # full cols: contiguous

        def finish() -> torch.Tensor:
            for w in works:
                w.wait()
            return out

        return Pending(finish, [out])

    def _recv_broadcast(self, j: int, off: int, out: torch.Tensor) -> Pending:
        posted = []   # (task, buffer, view of out, irecv work or None), in task order
        for k, t in enumerate(self.tasks):
            if t.dst_replica != j:
                continue
            view = out[t.rows[0] - off:t.rows[1] - off, t.cols[0]:t.cols[1]]
            buf = view if view.is_contiguous() else torch.empty_like(view)
            leader = t.receivers[0] == self.rank
            work = self._p2p("recv", buf, t.sender, k) if leader else None
            posted.append((t, buf, view, work))

        def finish() -> torch.Tensor:
            fan = []
            # Broadcasts in task order on every rank of the replica. The leader of task k
            # waits for its piece only when its turn comes, so piece k+1 keeps arriving
            # over the link while piece k fans out (async broadcasts).
            for t, buf, _, work in posted:
                if work is not None:
                    work.wait()
                if self.group is not None:
                    CommCounter.record("fan_out", buf)
                    fan.append(dist.broadcast(buf, src=t.receivers[0], group=self.group,
                                              async_op=True))
            for w in fan:
                w.wait()
            for _, buf, view, _ in posted:
                if buf is not view:
                    view.copy_(buf)                      # (r, c, *tail) into its place
            return out

        return Pending(finish, [out, posted])

    def _recv_allgather(self, j: int, off: int, out: torch.Tensor) -> Pending:
        posted = []   # (slice of out, my chunk buffer, gather target or None, irecv or None)
        for k, m in enumerate(self.msgs):
            if m.dst != self.rank:
                continue
            view = out[m.rows[0] - off:m.rows[1] - off].view(-1)   # full cols: contiguous
            t, parts = m.piece
            a, b, c = _chunk(view.numel(), t, parts)
            if parts == 1:
                mine, target = view, None                # the whole slice, no gather
            else:
                mine = torch.empty(c, dtype=out.dtype, device=out.device)
                target = view if c * parts == view.numel() else torch.empty(
                    c * parts, dtype=out.dtype, device=out.device)   # padded
            work = self._p2p("recv", mine[:b - a], m.src, k) if b > a else None
            posted.append((view, mine, target, work))

        def finish() -> torch.Tensor:
            fan = []
            for view, mine, target, work in posted:      # message order = slice order
                if work is not None:
                    work.wait()
                if target is not None:
                    CommCounter.record("fan_out", mine)
                    fan.append(dist.all_gather(list(target.split(mine.numel())), mine,
                                               group=self.group, async_op=True))
            for w in fan:
                w.wait()
            for view, _, target, _ in posted:
                if target is not None and target is not view:
                    view.copy_(target[:view.numel()])
            return out

        return Pending(finish, [out, posted])
