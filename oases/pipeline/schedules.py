"""The schedule generators: each stage's compute order, and the sends and receives around it.

Every kind is one rule for the compute order of stage i of pp (m micro-batches); the
placement of sends and receives (:func:`stage_actions`) is shared:

    gpipe             all forwards, then all backwards
    1f1b              min(m, pp-i) forwards, then B, F alternating until the forwards
                      run out, then the remaining Bs
    eager-1f1b        as 1f1b with min(m, 2(pp-i)-1) forwards first (Alpa's count)
    zb-h1             1f1b's order with each backward split into B (input gradient)
                      and W (weight gradient); stage i runs W(k-i) right after B(k), the
                      Ws still pending run at the end (Qi et al. 2024, ZB-H1)
    eager-zb-h1       eager-1f1b's warm-up with zb-h1's Ws
    interleaved-1f1b  each rank holds ``virtual`` = v stages (chunks); Megatron's
                      virtual pipeline: (v-1)pp + 2(pp-1-i) + 1 forwards first, then
                      B, F alternating; forwards go over chunks 0..v-1, pp micro-batches
                      at a time, backwards over chunks v-1..0

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

ZB-H1. Only B is on the critical path from stage to stage, so the gradient of a
micro-batch comes back pp-1-i B's after the last stage's, not pp-1-i full backwards:
the warm-up wait shrinks, and the Ws fill the cool-down, where 1F1B's stages wait for
each other's backwards. Stage i holds W back by i micro-batches (torch's
``ScheduleInterleavedZeroBubble`` at one chunk per rank, the paper's ZB-H1): stage i
keeps 1F1B's pp-i activations between F and B, plus at most i micro-batches between B
and W, so no stage holds more than stage 0 holds under 1F1B (pp). With f = b = w the
bubble is (pp-1)(f+b-w) per stage, a third of 1F1B's (pp-1)(f+b+w).

Interleaved links. Rank r's chunk c is the global virtual stage g = c*pp + r
(Megatron's assignment), so ``SEND_F`` of chunk c goes to rank r+1, chunk c, and from
the last rank to rank 0, chunk c+1 (the wraparound); ``RECV_F`` comes from rank r-1,
chunk c (rank 0: from rank pp-1, chunk c-1); gradients go the other way
(:func:`~oases.pipeline.actions.peer`). Each chunk is 1/v of the rank's layers, so
the simulator charges it f/v, b/v; the transfers are v times as many.
"""

from __future__ import annotations

from oases.pipeline.actions import RECV_OF, SEND_OF, Action, has_peer

KINDS = ("gpipe", "1f1b", "eager-1f1b", "zb-h1", "eager-zb-h1", "interleaved-1f1b")
# Kinds whose backward runs as B (input gradient) and W (weight gradient) apart.
SPLIT_KINDS = ("zb-h1", "eager-zb-h1")
VIRTUAL_KINDS = ("interleaved-1f1b",)  # several stages (chunks of layers) per rank


def _check_args(kind: str, pp: int, stage: int, microbatches: int, virtual: int = 1) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown pipeline kind {kind!r}; expected one of {', '.join(KINDS)}")
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise ValueError(f"virtual must be an int >= 1, got {virtual!r}")
    if virtual > 1:
        if kind != "interleaved-1f1b":
            raise ValueError(f"virtual={virtual} stages per rank needs kind interleaved-1f1b, "
                             f"not {kind}")
        if pp < 2:
            raise ValueError(f"interleaved-1f1b with virtual={virtual} needs pp >= 2, got {pp}")
        if microbatches % pp:
            raise ValueError(f"interleaved-1f1b runs micro-batches in groups of pp={pp} "
                             f"(Megatron's order): microbatches={microbatches} is not a "
                             f"multiple of {pp}")


def forwards_before_first_backward(kind: str, pp: int, stage: int, m: int,
                                   virtual: int = 1) -> int:
    """Forwards ``stage`` runs before its first backward (see the module docstring);
    under interleaved-1f1b, forwards of any chunk, out of ``virtual`` x m."""
    _check_args(kind, pp, stage, m, virtual)
    if kind == "gpipe":
        return m
    depth = pp - stage
    if kind == "interleaved-1f1b":
        return min(virtual * m, (virtual - 1) * pp + 2 * depth - 1)
    return min(m, depth if kind in ("1f1b", "zb-h1") else 2 * depth - 1)


def _chunked(op: int, pp: int, virtual: int, backward: bool) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's ``op``-th forward (or backward) under Megatron's
    interleaved order: pp micro-batches through chunk 0, the same through chunk 1, ...,
    then the next pp micro-batches; backwards visit the chunks from the last."""
    group, within = divmod(op, pp * virtual)
    chunk = within // pp
    return group * pp + within % pp, virtual - 1 - chunk if backward else chunk


def compute_order(kind: str, pp: int, stage: int, m: int, virtual: int = 1) -> list[Action]:
    """``stage``'s F, B (and W) actions in the order it runs them."""
    warm = forwards_before_first_backward(kind, pp, stage, m, virtual)
    total = virtual * m
    if kind == "interleaved-1f1b" and virtual > 1:
        def f(i: int) -> Action:
            return Action("F", *_chunked(i, pp, virtual, False))

        def b(i: int) -> Action:
            return Action("B", *_chunked(i, pp, virtual, True))
    else:
        def f(i: int) -> Action:
            return Action("F", i)

        def b(i: int) -> Action:
            return Action("B", i)
    order = [f(i) for i in range(warm)]
    split = kind in SPLIT_KINDS
    for i in range(total):
        order.append(b(i))
        if split and i >= stage:  # W held back by `stage` micro-batches (module docstring)
            order.append(Action("W", i - stage))
        if warm + i < total:
            order.append(f(warm + i))
    if split:
        order += [Action("W", i) for i in range(max(0, total - stage), total)]
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
                  overlap_fb: bool = False, virtual: int = 1) -> list[Action]:
    """``stage``'s actions: its compute order with receives posted one compute early
    and sends right after their compute (the placement rule of
    :mod:`oases.pipeline.actions`); a W counts as a compute, so a receive posted
    before it runs during it. Under ``overlap_fb`` a fused B, F pair
    (:func:`fused_units`) is one compute for that rule: both receives are posted before
    the compute ahead of it, and both sends follow the pair, B's first (eager-1f1b,
    pp=2, 4 micro-batches):

        stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 F2 SEND_F2 RECV_B1 B0 F3 SEND_F3 RECV_B2 B1 ...
        stage 1: RECV_F0 RECV_F1 F0 RECV_F2 B0 F1 SEND_B0 RECV_F3 B1 F2 SEND_B1 B2 F3 ...

    A pair's outputs leave when the pair ends, so each stage's pair waits for the next
    stage's whole pair (B's gradient) and for the previous stage's pair (F's input).
    Under 1f1b the previous stage produces that input in the pair just before, and the
    pairs run one stage at a time (pp=3, 6 micro-batches, f=1, b=2: makespan 42
    against 21 unfused); eager-1f1b's two extra warm-up forwards per stage put it two
    pairs back, and the rate is 1F1B's (28 against 18 with transfers of 0.5, 54
    against 54 at 16 micro-batches without).

    ``virtual`` (interleaved-1f1b only): stages per rank; each action carries its chunk,
    and its sends and receives go to the rank holding the neighbouring virtual stage
    (module docstring).
    """
    units = fused_units(compute_order(kind, pp, stage, microbatches, virtual), overlap_fb)

    def recv(unit: list[Action]) -> list[Action]:
        return [Action(RECV_OF[c.kind], c.mb, c.chunk) for c in unit
                if c.kind in RECV_OF and has_peer(RECV_OF[c.kind], pp, stage, c.chunk, virtual)]

    actions = recv(units[0])
    for i, unit in enumerate(units):
        if i + 1 < len(units):
            actions += recv(units[i + 1])
        actions += unit
        actions += [Action(SEND_OF[c.kind], c.mb, c.chunk) for c in unit
                    if c.kind in SEND_OF and has_peer(SEND_OF[c.kind], pp, stage, c.chunk, virtual)]
    return actions


def pipeline_actions(kind: str, pp: int, microbatches: int,
                     overlap_fb: bool = False, virtual: int = 1) -> list[list[Action]]:
    """One action list per stage (per rank, under interleaved-1f1b)."""
    _check_args(kind, pp, 0, microbatches, virtual)
    return [stage_actions(kind, pp, s, microbatches, overlap_fb, virtual) for s in range(pp)]
