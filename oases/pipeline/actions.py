"""Pipeline schedules as data: each stage's list of actions, checked and simulated.

A schedule is one list of :class:`Action` per pipeline stage; the runtime runs
each list in order. It is data so that one checker, one simulator and one
printer serve every generator (gpipe, 1f1b, eager-1f1b) and hand-written plans.

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

Warm-up (forwards before a stage's first backward, stage i of pp, m micro-batches):
gpipe m; 1f1b min(m, pp-i); eager-1f1b min(m, 2(pp-i)-1). After the first
backward a stage alternates B, F until its forwards run out, then drains its Bs.

Why 2(pp-i)-1 (the count in Alpa's own eager-1F1B generator, whose paper is
papers/002 section 4; the extract there lost its formulas). In 1F1B, stage i
waits for B0 to come back through the later stages after its pp-i forwards;
with f == b that wait is pp-1-i slots. Eager-1F1B fills exactly those slots
with forwards: (pp-i) + (pp-1-i). The last stage has no wait, so it is plain
1F1B; every earlier stage keeps more activations in flight, and its forwards now
run ahead of their consumers, so an activation send has a compute to hide behind
instead of sitting between two dependent forwards. pp=3, m=6, f=b=1, a
transfer takes 0.5 (one cell = 0.5; digits: F of that micro-batch, letters a-f:
B of micro-batch 0-5; from ``python -m oases.schedule``):

    1f1b        stage 0 |001122........aa33bb44..cc55..dd..ee....ff|  makespan 21
                stage 1 |...0011....aa22bb..33cc44..dd55ee....ff...|
                stage 2 |......00aa11bb..22cc..33dd44ee..55ff......|

    eager-1f1b  stage 0 |0011223344....aa55bb..cc..dd..ee..ff|        makespan 18
                stage 1 |...001122..aa33bb44cc55dd..ee..ff...|
                stage 2 |......00aa11bb22cc33dd44ee55ff......|

In 1F1B stage 2 waits before forwards 2, 3 and 5: stage 1 produced that input
just before and it is still in flight. Under eager-1F1B it was produced a step
earlier and has arrived. With no transfer cost both take 16.

"2(pp-i)-1 warm-up forwards instead of pp-i-1" is sometimes quoted with warm-up
counted the Megatron way (1F1B's steady state starts with a forward); read that
way it gives 2(pp-i) forwards before the first backward and a last stage that
differs from 1F1B. We count forwards before the first backward, as Alpa does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("gpipe", "1f1b", "eager-1f1b")
COMPUTE = ("F", "B")


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
RECV_OF = {"F": "RECV_F", "B": "RECV_B"}
_SEND_OF = {"F": "SEND_F", "B": "SEND_B"}


class ScheduleError(ValueError):
    """A schedule is malformed (missing or misplaced action) or deadlocks."""


@dataclass(frozen=True)
class Action:
    """One step of a stage's list: ``kind`` (F, B or a send/receive) of micro-batch ``mb``."""

    kind: str
    mb: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE and self.kind not in LINKS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of "
                             f"{', '.join(COMPUTE + tuple(LINKS))}")
        if not isinstance(self.mb, int) or self.mb < 0:
            raise ValueError(f"micro-batch must be an int >= 0, got {self.mb!r}")

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}"


def has_peer(kind: str, pp: int, stage: int) -> bool:
    return 0 <= stage + LINKS[kind].peer < pp


def _check_args(kind: str, pp: int, stage: int, microbatches: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline kind {kind!r}; expected one of {', '.join(KINDS)}")
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")


def forwards_before_first_backward(kind: str, pp: int, stage: int, m: int) -> int:
    """Forwards ``stage`` runs before its first backward (see the module docstring)."""
    _check_args(kind, pp, stage, m)
    if kind == "gpipe":
        return m
    depth = pp - stage
    return min(m, depth if kind == "1f1b" else 2 * depth - 1)


def _compute_order(kind: str, pp: int, stage: int, m: int) -> list[Action]:
    warm = forwards_before_first_backward(kind, pp, stage, m)
    order = [Action("F", i) for i in range(warm)]
    for i in range(m):
        order.append(Action("B", i))
        if warm + i < m:
            order.append(Action("F", warm + i))
    return order


def fused_units(computes: list[Action], overlap_fb: bool) -> list[list[Action]]:
    """The compute order cut into what runs as one: under ``overlap_fb`` each B
    directly followed by an F (the steady state of 1F1B, every B but the last at
    pp=1) is one unit, the two micro-batches' programs interleaved by the engine."""
    units: list[list[Action]] = []
    i = 0
    while i < len(computes):
        n = 2 if (overlap_fb and computes[i].kind == "B" and i + 1 < len(computes)
                  and computes[i + 1].kind == "F") else 1
        units.append(computes[i:i + n])
        i += n
    return units


def stage_actions(kind: str, pp: int, stage: int, microbatches: int,
                  overlap_fb: bool = False) -> list[Action]:
    """``stage``'s actions: its compute order with receives posted one compute early
    and sends right after their compute (the placement rule of the module docstring).
    Under ``overlap_fb`` a fused B, F pair (:func:`fused_units`) is one compute for that
    rule: both receives are posted before the compute ahead of it, and both sends
    follow the pair, B's first (eager-1f1b, pp=2, 4 micro-batches):

        stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 F2 SEND_F2 RECV_B1 B0 F3 SEND_F3 RECV_B2 B1 ...
        stage 1: RECV_F0 RECV_F1 F0 RECV_F2 B0 F1 SEND_B0 RECV_F3 B1 F2 SEND_B1 B2 F3 ...

    A pair's outputs leave when the pair ends, so each stage's pair waits for the next
    stage's whole pair (B's gradient) and for the previous stage's pair (F's input).
    Under 1f1b the previous stage produces that input in the pair just before, and the
    pairs run one stage at a time (pp=3, 6 micro-batches, f=1, b=2: makespan 42
    against 21 unfused); eager-1f1b's two extra warm-up forwards per stage put it two
    pairs back, and the rate is 1F1B's (28 against 18 with transfers of 0.5, 54
    against 54 at 16 micro-batches without).
    """
    units = fused_units(_compute_order(kind, pp, stage, microbatches), overlap_fb)

    def recv(unit: list[Action]) -> list[Action]:
        out = []
        for c in unit:
            kind_ = RECV_OF[c.kind]
            if has_peer(kind_, pp, stage):
                out.append(Action(kind_, c.mb))
        return out

    actions = recv(units[0])
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            actions += recv(units[i + 1])
        actions += unit
        actions += [Action(_SEND_OF[c.kind], c.mb) for c in unit
                    if has_peer(_SEND_OF[c.kind], pp, stage)]
    return actions


def is_fused(row: list[Action], i: int) -> bool:
    """Whether ``row[i]`` is a B that runs fused with the F right after it (the runtime
    and the simulator fuse every such adjacent pair when ``overlap_fb`` is on)."""
    return row[i].kind == "B" and i + 1 < len(row) and row[i + 1].kind == "F"


def pipeline_actions(kind: str, pp: int, microbatches: int,
                     overlap_fb: bool = False) -> list[list[Action]]:
    """One action list per stage."""
    _check_args(kind, pp, 0, microbatches)
    return [stage_actions(kind, pp, s, microbatches, overlap_fb) for s in range(pp)]


def _check_stage(row: list[Action], s: int, pp: int, mbs: list[int]) -> None:
    where: dict[Action, int] = {}
    for i, a in enumerate(row):
        if a in where:
            raise ScheduleError(f"stage {s}: {a} appears more than once")
        where[a] = i
    for m in mbs:
        for kind in COMPUTE:
            if Action(kind, m) not in where:
                raise ScheduleError(f"stage {s}: no {kind}{m}")
        if where[Action("B", m)] < where[Action("F", m)]:
            raise ScheduleError(f"stage {s}: B{m} comes before F{m}")
        for kind, link in LINKS.items():
            a, c = Action(kind, m), Action(link.compute, m)
            if not has_peer(kind, pp, s):
                if a in where:
                    raise ScheduleError(f"stage {s}: {a} but there is no stage {s + link.peer}")
            elif a not in where:
                direction = "to" if link.after_compute else "from"
                raise ScheduleError(f"stage {s}: {c} has no {a} {direction} stage {s + link.peer}")
            elif (where[a] > where[c]) != link.after_compute:
                side = "before" if link.after_compute else "after"
                raise ScheduleError(f"stage {s}: {a} comes {side} {c}")


def check_structure(actions: list[list[Action]]) -> None:
    """Rules (a) and (b) of :func:`check_schedule`. Every stage must hold each of
    its sends and receives for every micro-batch, so each has its partner on the
    neighbour stage without a separate look there."""
    if not actions:
        raise ScheduleError("a schedule needs at least one stage")
    mbs = sorted({a.mb for row in actions for a in row})
    if not mbs:
        raise ScheduleError("a schedule needs at least one micro-batch")
    for s, row in enumerate(actions):
        _check_stage(row, s, len(actions), mbs)


def _execute(actions: list[list[Action]], f_cost: float, b_cost: float,
             comm_cost: float, fused: bool = False) -> list[list[tuple[Action, float, float]]]:
    """Run a well-formed schedule as an event simulation; return each stage's
    (compute, start, end). A transfer needs both ends posted (as NCCL and gloo
    point-to-point do), so its data arrives ``comm_cost`` after the later of the
    send and the receive; with ``fused``, each B directly followed by an F runs as one
    unit that waits for both inputs first (``overlap_fb``). Raises :class:`ScheduleError` naming each stuck stage
    when no stage can take its next action (after torch.distributed.pipelining's
    ``_simulate_comms_compute``)."""
    pp = len(actions)
    pos, clock = [0] * pp, [0.0] * pp
    posted: dict[tuple[int, Action], float] = {}  # (stage, send/recv) -> time posted
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp)]

    def arrival(s: int, c: Action) -> float | None:
        """When c's input is on stage s; None while the neighbour has not sent it."""
        recv = Action(RECV_OF[c.kind], c.mb)
        if not has_peer(recv.kind, pp, s):
            return 0.0
        send = (s + LINKS[recv.kind].peer, Action(LINKS[recv.kind].partner, c.mb))
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
                        start, clock[s] = clock[s], clock[s] + (f_cost if c.kind == "F" else b_cost)
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
            link = LINKS[RECV_OF[a.kind]]
            stuck.append(f"stage {s} waits at {a} for {link.partner}{a.mb} "
                         f"from stage {s + link.peer}")
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))
    return spans


def check_schedule(actions: list[list[Action]], fused: bool = False) -> None:
    """Raise :class:`ScheduleError` (one line) unless every stage runs F(m) and
    B(m) once for every micro-batch m, F before B, every send and receive has
    its partner on the neighbour stage and sits on the right side of its
    compute, and running the lists under the blocking rules cannot deadlock."""
    check_structure(actions)
    _execute(actions, 1.0, 1.0, 0.0, fused)


@dataclass(frozen=True)
class Timeline:
    """Simulated compute of each stage: ``spans[s]`` = [(F/B action, start, end)]."""

    spans: list[list[tuple[Action, float, float]]]

    @property
    def makespan(self) -> float:
        return max(end for row in self.spans for _, _, end in row)

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' time (pp x makespan) spent not computing."""
        busy = sum(end - start for row in self.spans for _, start, end in row)
        return 1.0 - busy / (len(self.spans) * self.makespan)

    @property
    def peak_inflight(self) -> list[int]:
        """Per stage, the most micro-batches whose activations are kept at once
        (F done, B not yet): the schedule's activation memory in micro-batches."""
        peaks = []
        for row in self.spans:
            live = peak = 0
            for a, _, _ in row:
                live += 1 if a.kind == "F" else -1
                peak = max(peak, live)
            peaks.append(peak)
        return peaks


def simulate(actions: list[list[Action]], f_cost: float = 1.0, b_cost: float = 2.0,
             comm_cost: float = 0.0, fused: bool = False) -> Timeline:
    """Time a schedule: F and B take ``f_cost`` and ``b_cost``, sends and receives
    no compute time, and a transfer takes ``comm_cost`` once both its send and
    its receive are posted. Raises :class:`ScheduleError` for a bad schedule."""
    if f_cost <= 0 or b_cost <= 0 or comm_cost < 0:
        raise ValueError(f"costs must be f > 0, b > 0, comm >= 0; got f={f_cost}, "
                         f"b={b_cost}, comm={comm_cost}")
    check_structure(actions)
    return Timeline(_execute(actions, f_cost, b_cost, comm_cost, fused))


def format_actions(actions: list[list[Action]]) -> str:
    return "\n".join(f"stage {s}: " + " ".join(map(str, row)) for s, row in enumerate(actions))


def _cell(a: Action) -> str:
    return str(a.mb % 10) if a.kind == "F" else "abcdefghij"[a.mb % 10]


def format_timeline(timeline: Timeline, width: int = 72) -> str:
    """ASCII chart, one row per stage, ``width`` cells for the makespan. A cell
    shows what the stage computes in it: a digit for F of that micro-batch, a
    letter for B (a = 0 ... j = 9, both mod 10), '.' for idle."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    scale = width / timeline.makespan
    lines = []
    for s, row in enumerate(timeline.spans):
        cells = ["."] * width
        for a, start, end in row:
            for i in range(round(start * scale), round(end * scale)):
                cells[i] = _cell(a)
        lines.append(f"stage {s} |{''.join(cells)}|")
    lines.append(f"legend: 0-9 = F of micro-batch (mod 10), a-j = B of micro-batch 0-9 "
                 f"(mod 10), . = idle; one cell = {timeline.makespan / width:.3g} time units")
    return "\n".join(lines)
