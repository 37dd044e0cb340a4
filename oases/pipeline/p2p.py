"""The point-to-point order of a pipeline schedule, as NCCL will run it.

ProcessGroupNCCL runs the sends and receives of one process group in issue order,
one stream per rank, both directions, tags ignored; a send or a receive holds
the stream until its partner runs. A schedule that posts receives early (as
:func:`~oases.pipeline.actions.stage_actions` does, so transfers overlap compute)
can therefore hang on NCCL where gloo, which matches messages by tag, runs it.

The runtime gives each direction of each boundary its own process group
(:mod:`oases.pipeline.cross_mesh`): on the forward group of stages s, s+1, stage
s only sends activations and stage s+1 only receives them, each in micro-batch
order; the backward group carries the gradients the other way. Both sides of a
group see one order, so its earliest unfinished message always has both ends
posted::

    1f1b, pp=2, 3 micro-batches              forward group      backward group
      stage 0: F0 SEND_F0 F1 SEND_F1 ...     SEND_F0 SEND_F1 .. RECV_B0 RECV_B1 ..
      stage 1: RECV_F0 RECV_F1 F0 B0 ...     RECV_F0 RECV_F1 .. SEND_B0 SEND_B1 ..

With one group for both directions the same lists meet SEND_F1 on stage 0
against SEND_B0 on stage 1 (or RECV_B0 against RECV_F1): both streams wait for
each other. :func:`check_p2p` runs the lists under these rules and names the
stuck ops; ``python -m oases.schedule --p2p`` prints both.

Interleaved schedules (v chunks per rank) add the wraparound boundary from rank pp-1
to rank 0 (chunk c of the last rank feeds chunk c+1 of the first,
:func:`~oases.pipeline.actions.peer`): boundary b links rank b to rank (b+1) mod pp,
each direction its own group, and a group carries every chunk's messages across it.
Both sides then issue them in the order of the micro-batches and chunks of their
lists, which the interleaved generator makes the same on every rank, and
:func:`check_p2p` checks that each head pairs with its partner (micro-batch and
chunk). W actions have no transfer.
"""

from __future__ import annotations

from oases.pipeline.actions import (LINKS, RECV_OF, COMPUTE, Action, ScheduleError,
                                    check_structure, has_peer, is_fused, peer, virtual_of)


def _boundary(stage: int, a: Action, pp: int) -> int:
    """The boundary that action ``a`` of ``stage`` crosses, named by the rank on its
    activations' sending side (boundary b: rank b -> rank (b+1) mod pp)."""
    return stage if LINKS[a.kind].peer > 0 else (stage - 1) % pp


def _group(stage: int, a: Action, shared: bool, pp: int) -> tuple[int, str]:
    """The process group ``a`` runs on: per boundary and direction, or per boundary."""
    if shared:  # at pp=2 the wraparound boundary joins the same two ranks
        return (0 if pp == 2 else _boundary(stage, a, pp)), "both"
    return _boundary(stage, a, pp), "fwd" if a.kind in ("SEND_F", "RECV_F") else "bwd"


def p2p_order(actions: list[list[Action]], shared: bool = False) -> dict:
    """``{(boundary, direction): {stage: [ops in issue order]}}`` for every p2p group."""
    pp = len(actions)
    out: dict = {}
    for s, row in enumerate(actions):
        for a in row:
            if a.kind not in COMPUTE:
                out.setdefault(_group(s, a, shared, pp), {}).setdefault(s, []).append(a)
    for (b, _), sides in out.items():
        for s in (b, (b + 1) % pp):
            sides.setdefault(s, [])
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1] == "bwd")))


def check_p2p(actions: list[list[Action]], fused: bool = False, shared: bool = False) -> None:
    """Run the lists under NCCL's point-to-point rules; raise :class:`ScheduleError` naming
    each stuck stage and the heads of its groups unless every op completes. ``fused``: a B
    directly followed by an F starts once both inputs are in (``overlap_fb``)."""
    check_structure(actions)
    pp, virtual = len(actions), virtual_of(actions)
    pos = [0] * pp
    queues: dict = {}      # group -> {stage: posted, not yet completed ops, in order}
    done: set = set()      # (stage, receive) completed
    errors: list[str] = []

    def match() -> bool:
        moved = False
        for g, sides in queues.items():
            lo, hi = g[0], (g[0] + 1) % pp
            while sides.get(lo) and sides.get(hi):
                a, b = sides[lo][0], sides[hi][0]
                if (LINKS[a.kind].partner != b.kind or a.mb != b.mb
                        or peer(a.kind, pp, lo, a.chunk, virtual) != (hi, b.chunk)):
                    errors.append(f"group {_label(g, pp)}: stage {lo} is at {a} while stage "
                                  f"{hi} is at {b}")
                    return moved
                sides[lo].pop(0)
                sides[hi].pop(0)
                done.update({(lo, a), (hi, b)})
                moved = True
        return moved

    progress = True
    while progress and not errors:
        progress = False
        for s, row in enumerate(actions):
            while pos[s] < len(row):
                a = row[pos[s]]
                if a.kind in COMPUTE:
                    unit = row[pos[s]:pos[s] + (2 if fused and is_fused(row, pos[s]) else 1)]
                    needs = [Action(RECV_OF[c.kind], c.mb, c.chunk) for c in unit
                             if c.kind in RECV_OF]
                    if any(has_peer(r.kind, pp, s, r.chunk, virtual) and (s, r) not in done
                           for r in needs):
                        break
                    pos[s] += len(unit)
                else:
                    queues.setdefault(_group(s, a, shared, pp), {}).setdefault(s, []).append(a)
                    pos[s] += 1
                progress = True
        progress = match() or progress
    stuck = [f"stage {s} waits at {actions[s][pos[s]]}" for s in range(pp)
             if pos[s] < len(actions[s])]
    left = [] if errors else [f"group {_label(g, pp)} stage {s} still holds {' '.join(map(str, q))}"
                              for g, sides in queues.items() for s, q in sorted(sides.items())
                              if q]
    if errors or stuck or left:
        raise ScheduleError("NCCL point-to-point deadlock: " + "; ".join(errors + stuck + left))


def _label(g: tuple[int, str], pp: int) -> str:
    b, d = g
    n = (b + 1) % pp
    return {"fwd": f"{b}->{n}", "bwd": f"{n}->{b}", "both": f"{b}<->{n}"}[d]


def format_p2p(actions: list[list[Action]], fused: bool = False) -> str:
    """Per stage pair and direction, the op order each side issues on its process group,
    then the verdict for these groups and for one shared group per stage pair."""
    lines = ["point-to-point order per process group (NCCL runs each rank's ops on a group "
             "in this order):"]
    for g, sides in p2p_order(actions).items():
        what = "activations" if g[1] == "fwd" else "gradients"
        lines.append(f"  group {_label(g, len(actions))} ({what})")
        for s, ops in sorted(sides.items()):
            lines.append(f"    stage {s}: {' '.join(map(str, ops)) or '-'}")
    if len(actions) == 1:
        return "no point-to-point: one stage"
    check_p2p(actions, fused)
    lines.append("each group carries one direction, in one order on both sides: "
                 "no deadlock")
    try:
        check_p2p(actions, fused, shared=True)
        lines.append("(one group per stage pair for both directions would also run)")
    except ScheduleError as e:
        lines.append(f"(one group per stage pair for both directions would hang: {e})")
    return "\n".join(lines)
