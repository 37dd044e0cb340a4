"""Pipeline schedules as data: each stage's list of actions, checked and simulated.

A schedule is one list of :class:`Action` per pipeline stage; the runtime runs
each list in order. It is data so that one checker, one simulator and one
printer serve every generator and hand-written plans.

    F(m)       forward of micro-batch m on this stage
    B(m)       backward of m (after F(m) here; needs stage s+1's gradient)
    RECV_F(m)  post a non-blocking receive of m's activation from stage s-1
    SEND_F(m)  post a non-blocking send of F(m)'s output to stage s+1
    RECV_B(m)  post a non-blocking receive of m's gradient from stage s+1
    SEND_B(m)  post a non-blocking send of B(m)'s input gradient to stage s-1

Sends and receives never block; the F/B that consumes a receive blocks until
the neighbour has posted the matching send. Generators post each receive one
compute action before its consumer, so the transfer runs during that compute,
and each send right after the compute that produced it:

    1f1b, pp=3, m=3, stage 1:
      RECV_F0 RECV_F1 F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_F2 B0 SEND_B0 ...
      (F1's activation arrives while F0 runs, B0's gradient while F1 runs)

The generators (gpipe, 1f1b, eager-1f1b, zb-h1, eager-zb-h1, interleaved-1f1b)
are in :mod:`oases.pipeline.schedules`; this module holds what every list shares:
the actions, the checker, the simulator and the printers.

With ``W`` actions in a schedule (zb-h1), the backward runs in two parts:

    B(m)       input gradient of m only (what stage s-1 waits for)
    W(m)       weight gradients of m on this stage (after B(m); no communication)

Interleaved schedules give each rank several stages (chunks): ``Action.chunk`` is
the chunk on this rank, and rank r's chunk c is the global virtual stage
c*pp + r (Megatron's assignment), so sends and receives go to the rank holding the
neighbouring virtual stage, rank pp-1's chunk c sending to rank 0's chunk c+1
(:func:`peer`). An action prints as ``F3`` on chunk 0 and ``F3c1`` on chunk 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

COMPUTE = ("F", "B", "W")


class _Link(NamedTuple):
    """How a communication action pairs up: with ``partner`` on stage s+``peer``,
    and with this stage's ``compute`` of the same micro-batch, which it must
    follow (a send of its output) or precede (a receive of its input)."""

    peer: int
    partner: str
    compute: str
    after_compute: bool


LINKS = {
    "RECV_F": _Link(-1, "SEND_F", "F", False),
    "SEND_F": _Link(+1, "RECV_F", "F", True),
    "RECV_B": _Link(+1, "SEND_B", "B", False),
    "SEND_B": _Link(-1, "RECV_B", "B", True),
}
RECV_OF = {"F": "RECV_F", "B": "RECV_B"}  # a W takes no input from another stage
SEND_OF = {"F": "SEND_F", "B": "SEND_B"}


class ScheduleError(ValueError):
    """A schedule is malformed (missing or misplaced action) or deadlocks."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's list: ``kind`` (F, B, W or a send/receive) of micro-batch
    ``mb`` on the rank's ``chunk`` (its virtual stage, 0 unless interleaved)."""

    kind: str
    mb: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE and self.kind not in LINKS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of "
                             f"{', '.join(COMPUTE + tuple(LINKS))}")
        if not isinstance(self.mb, int) or self.mb < 0:
            raise ValueError(f"micro-batch must be an int >= 0, got {self.mb!r}")
        if not isinstance(self.chunk, int) or self.chunk < 0:
            raise ValueError(f"chunk must be an int >= 0, got {self.chunk!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


def peer(kind: str, pp: int, stage: int, chunk: int = 0,
         virtual: int = 1) -> tuple[int, int] | None:
    """(rank, chunk) at the other end of a ``kind`` link of ``stage``'s ``chunk``, or
    None at the ends of the pipeline. Chunk c of rank r is the global virtual stage
    g = c*pp + r; the link goes to g+1 (``SEND_F``, ``RECV_B``) or g-1, held by rank
    (g±1) mod pp as its chunk (g±1) // pp: rank pp-1's chunk c links to rank 0's
    chunk c+1, rank 0's chunk c to rank pp-1's chunk c-1."""
    g = chunk * pp + stage + LINKS[kind].peer
    if not 0 <= g < pp * virtual:
        return None
    return g % pp, g // pp


def has_peer(kind: str, pp: int, stage: int, chunk: int = 0, virtual: int = 1) -> bool:
    return peer(kind, pp, stage, chunk, virtual) is not None


def is_fused(row: list[Action], i: int) -> bool:
    """Whether ``row[i]`` is a B that runs fused with the F right after it (the runtime
    and the simulator fuse every such adjacent pair when ``overlap_fb`` is on)."""
    return row[i].kind == "B" and i + 1 < len(row) and row[i + 1].kind == "F"


def virtual_of(actions: list[list[Action]]) -> int:
    """Stages per rank of a schedule: one more than its highest chunk."""
    return 1 + max((a.chunk for row in actions for a in row), default=0)


def _check_stage(row: list[Action], s: int, pp: int, virtual: int, mbs: list[int],
                 split: bool) -> None:
    where: dict[Action, int] = {}
    for i, a in enumerate(row):
        if a in where:
            raise ScheduleError(f"stage {s}: {a} appears more than once")
        where[a] = i
    computes = COMPUTE if split else ("F", "B")
    for c in range(virtual):
        for m in mbs:
            for kind in computes:
                if Action(kind, m, c) not in where:
                    raise ScheduleError(f"stage {s}: no {Action(kind, m, c)}")
            f, b, w = (Action(k, m, c) for k in COMPUTE)
            if where[b] < where[f]:
                raise ScheduleError(f"stage {s}: {b} comes before {f}")
            if split and where[w] < where[b]:
                raise ScheduleError(f"stage {s}: {w} comes before {b}")
            for kind, link in LINKS.items():
                a, comp = Action(kind, m, c), Action(link.compute, m, c)
                other = peer(kind, pp, s, c, virtual)
                if other is None:
                    if a in where:
                        raise ScheduleError(f"stage {s}: {a} but there is no stage "
                                            f"{s + link.peer}")
                elif a not in where:
                    direction = "to" if link.after_compute else "from"
                    raise ScheduleError(f"stage {s}: {comp} has no {a} {direction} stage "
                                        f"{other[0]}")
                elif (where[a] > where[comp]) != link.after_compute:
                    side = "before" if link.after_compute else "after"
                    raise ScheduleError(f"stage {s}: {a} comes {side} {comp}")
    if not split and any(a.kind == "W" for a in row):
        raise ScheduleError(f"stage {s}: has W actions where another stage has none")


def check_structure(actions: list[list[Action]]) -> None:
    """Rules (a) and (b) of :func:`check_schedule`. Every stage must hold each of
    its sends and receives for every micro-batch and chunk, so each has its partner
    on the neighbour stage without a separate look there (every receive its send)."""
    if not actions:
        raise ScheduleError("a schedule needs at least one stage")
    mbs = sorted({a.mb for row in actions for a in row})
    if not mbs:
        raise ScheduleError("a schedule needs at least one micro-batch")
    split = any(a.kind == "W" for row in actions for a in row)
    virtual = virtual_of(actions)
    for s, row in enumerate(actions):
        _check_stage(row, s, len(actions), virtual, mbs, split)


def _execute(actions: list[list[Action]], f_cost: float, b_cost: float,
             comm_cost: float, fused: bool = False,
             w_cost: float = 0.0) -> list[list[tuple[Action, float, float]]]:
    """Run a well-formed schedule as an event simulation; return each stage's
    (compute, start, end). A transfer needs both ends posted (as NCCL and gloo
    point-to-point do), so its data arrives ``comm_cost`` after the later of the
    send and the receive; with ``fused``, each B directly followed by an F runs as one
    unit that waits for both inputs first (``overlap_fb``). A chunk's compute costs 1/v
    of the stage's (v chunks per rank); a B costs ``b_cost + w_cost`` where the
    schedule has no W. Raises :class:`ScheduleError` naming each stuck stage when no
    stage can take its next action (after torch.distributed.pipelining's
    ``_simulate_comms_compute``)."""
    pp, virtual = len(actions), virtual_of(actions)
    split = any(a.kind == "W" for row in actions for a in row)
    cost = {"F": f_cost / virtual, "B": (b_cost if split else b_cost + w_cost) / virtual,
            "W": w_cost / virtual}
    pos, clock = [0] * pp, [0.0] * pp
    posted: dict[tuple[int, Action], float] = {}  # (stage, send/recv) -> time posted
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]

    def arrival(s: int, c: Action) -> float | None:
        """When c's input is on stage s; None while the neighbour has not sent it."""
        if c.kind not in RECV_OF:
            return 0.0
        recv = Action(RECV_OF[c.kind], c.mb, c.chunk)
        other = peer(recv.kind, pp, s, c.chunk, virtual)
        if other is None:
            return 0.0
        send = (other[0], Action(LINKS[recv.kind].partner, c.mb, other[1]))
        if send not in posted:
            return None
        return max(posted[send], posted[(s, recv)]) + comm_cost

    progress = True
    while progress:
        progress = False
        for s, row in enumerate(actions):
            while pos[s] < len(row):
                a = row[pos[s]]
                if a.kind in COMPUTE:  # a fused B, F pair starts once both inputs are in
                    unit = row[pos[s]:pos[s] + (2 if fused and is_fused(row, pos[s]) else 1)]
                    ready = [arrival(s, c) for c in unit]
                    if None in ready:
                        break
                    clock[s] = max(clock[s], *ready)
                    for c in unit:
                        start, clock[s] = clock[s], clock[s] + cost[c.kind]
                        spans[s].append((c, start, clock[s]))
                    pos[s] += len(unit)
                else:
                    posted[(s, a)] = clock[s]
                    pos[s] += 1
                progress = True
    stuck = []
    for s, row in enumerate(actions):
        if pos[s] < len(row):  # only a compute can block, on its receive's partner
            a = row[pos[s]]
            kind = RECV_OF[a.kind]
            rank, chunk = peer(kind, pp, s, a.chunk, virtual)
            stuck.append(f"stage {s} waits at {a} for "
                         f"{Action(LINKS[kind].partner, a.mb, chunk)} from stage {rank}")
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    return spans


def check_schedule(actions: list[list[Action]], fused: bool = False) -> None:
    """Raise :class:`ScheduleError` (one line) unless every stage runs F(m) and
    B(m) once for every micro-batch m and chunk, F before B, and, where the schedule
    has Ws, W(m) once after B(m); every send and receive has its partner on the
    neighbour stage and sits on the right side of its compute, and running the lists
    under the blocking rules cannot deadlock."""
    check_structure(actions)
    _execute(actions, 1.0, 1.0, 0.0, fused, w_cost=1.0)


@dataclass(frozen=True)
class Timeline:
    """Simulated compute of each stage: ``spans[s]`` = [(F/B/W action, start, end)]."""

    spans: list[list[tuple[Action, float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for row in self.spans for _, _, end in row)

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' time (pp x makespan) spent not computing."""
        busy = sum(end - start for row in self.spans for _, start, end in row)
        return 1.0 - busy / (len(self.spans) * self.makespan)

    def _peaks(self, until: tuple[str, ...]) -> list[int]:
        peaks = []
        for row in self.spans:
            live = peak = 0
            for a, _, _ in row:
                live += 1 if a.kind == "F" else -1 if a.kind in until else 0
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    @property
    def peak_inflight(self) -> list[int]:
        """Per stage, the most micro-batches whose activations are kept at once
        (F done, B not yet): the schedule's activation memory in micro-batches (in
        chunks of 1/v of a stage under interleaving)."""
        return self._peaks(("B",))

    @property
    def peak_stashed(self) -> list[int]:
        """Per stage, the most micro-batches with F done and weight gradients not yet
        (W, or B where the schedule has no W): a W still needs its layers' stashed
        inputs and output gradients, so with W this bounds the memory."""
        split = any(a.kind == "W" for row in self.spans for a, _, _ in row)
        return self._peaks(("W",) if split else ("B",))


def simulate(actions: list[list[Action]], f_cost: float = 1.0, b_cost: float = 2.0,
             comm_cost: float = 0.0, fused: bool = False, w_cost: float = 0.0) -> Timeline:
    """Time a schedule: F and B take ``f_cost`` and ``b_cost`` (a stage's whole layers;
    a chunk of v takes 1/v of it), sends and receives no compute time, and a transfer
    takes ``comm_cost`` once both its send and its receive are posted. ``w_cost``: the
    weight-gradient part of the backward; in a schedule with W actions each W takes
    it and ``b_cost`` is the input-gradient part only, in one without, each B takes
    ``b_cost + w_cost``. Raises :class:`ScheduleError` for a bad schedule."""
    if f_cost <= 0 or b_cost <= 0 or comm_cost < 0 or w_cost < 0:
        raise ValueError(f"costs must be f > 0, b > 0, comm >= 0, w >= 0; got f={f_cost}, "
                         f"b={b_cost}, comm={comm_cost}, w={w_cost}")
    check_structure(actions)
    if w_cost == 0 and any(a.kind == "W" for row in actions for a in row):
        raise ValueError("a schedule with W actions needs w_cost > 0 (the weight-gradient "
                         "time; b_cost is then the input-gradient part only)")
    return Timeline(_execute(actions, f_cost, b_cost, comm_cost, fused, w_cost))


def format_actions(actions: list[list[Action]]) -> str:
    return "\n".join(f"stage {s}: " + " ".join(map(str, row)) for s, row in enumerate(actions))


def _cell(a: Action) -> str:
    i = a.mb % 10
    return str(i) if a.kind == "F" else ("abcdefghij" if a.kind == "B" else "ABCDEFGHIJ")[i]


def format_timeline(timeline: Timeline, width: int = 72) -> str:
    """ASCII chart, one row per stage, ``width`` cells for the makespan. A cell
    shows what the stage computes in it: a digit for F of that micro-batch, a
    letter for B (a = 0 ... j = 9, both mod 10), a capital for W (A = 0 ... J = 9),
    '.' for idle. Chunks are not told apart (the action lists show them)."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    scale = width / timeline.makespan
    split = any(a.kind == "W" for row in timeline.spans for a, _, _ in row)
    lines = []
    for s, row in enumerate(timeline.spans):
        cells = ["."] * width
        for a, start, end in row:
            for i in range(round(start * scale), round(end * scale)):
                cells[i] = _cell(a)
        lines.append(f"stage {s} |{''.join(cells)}|")
    lines.append("legend: 0-9 = F of micro-batch (mod 10), a-j = B of micro-batch 0-9 "
                 + ("(input gradient), A-J = W (weight gradient) " if split else "")
                 + f"(mod 10), . = idle; one cell = {timeline.makespan / width:.3g} time units")
    return "\n".join(lines)


_GENERATORS = ("KINDS", "SPLIT_KINDS", "compute_order", "forwards_before_first_backward",
               "fused_units", "pipeline_actions", "stage_actions")


def __getattr__(name: str):
    """The generators, importable from here too, where the runtime and the tests have
    always found them (:mod:`oases.pipeline.schedules` builds on this module)."""
    if name in _GENERATORS:
        from oases.pipeline import schedules  # deferred: schedules imports this module
        return getattr(schedules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
