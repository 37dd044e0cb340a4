"""Planner v2's outer search: every (pp, dp, cp, tp, c), with three pickers. Pure Python.

For every outer choice (:func:`oases.planner.stages.enumerate_choices`) the
:class:`~oases.planner.stages.Problem` is built once and priced three ways:

    megatron  every layer at degree tp, the runtime's even split
    amp       AMP: the best uniform strategy with its exact partition (amp.best_uniform)
    uniap     the MILP (uniap.solve) over placement and per-layer strategies, warm
              started from that choice's AMP plan, so it never returns worse

``amp`` keeps the fastest AMP plan. ``uniap`` adds MILPs within a total time budget:
choices are visited fastest-AMP-first, and a choice is skipped when a lower bound
on anything it could reach is no better than the best plan found so far:

    LB = (1 + (c - 1) / P) sum_l min_{p,s} t[p][l][s]   (and max >= the heaviest layer)

(UniAP's time per iteration is sum T_p + sum O_p + (c - 1) max; resharding and
transfers are >= 0 and the max is at least the mean). A choice with one strategy
needs no MILP: AMP's partition is exact there. Each MILP gets the budget left,
shared among the choices left (at least ``min_limit_s``); the AMP plans stay
candidates, so the pick is never worse than AMP's. Choices under context parallelism
(cp > 1) and interleaved-1f1b ones take the ``megatron`` plan only: what they run.

:func:`exhaustive` is the reference the pickers are measured against: every choice x
contiguous partition x strategy per layer, priced one by one. Its space
(:func:`space_size`, sum over choices of C(L-1, pp-1) S^L) is enumerable only for a
few layers: 8 layers on 8 devices already hold about 10^5 plans, 32 layers on 16
devices about 10^21.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from oases.errors import ConfigError
from oases.planner import amp, uniap
from oases.planner.cost import Profile, RunShape
from oases.pipeline.schedules import KINDS, VIRTUAL_KINDS
from oases.planner.stages import Job, Problem, build, enumerate_choices, even_starts, with_schedule

METHODS = ("uniap", "amp")
# The schedules a search may choose: every one a run executes
CHOOSABLE = KINDS
# chunks per rank the search prices interleaved-1f1b with, unless the config sets them
SEARCH_VIRTUAL = 2


def choosable(overlap_fb: bool) -> tuple[str, ...]:
    """The schedules a run's search may choose: :data:`CHOOSABLE`, or with
    ``parallel.overlap_fb`` the one schedule that pairs a backward with a forward in a
    pipeline (eager-1f1b: the config refuses the others with it)."""
    return ("eager-1f1b",) if overlap_fb else CHOOSABLE


@dataclass
class Candidate:
    """One pipelined layout with its predicted time per iteration and memory per stage."""

    problem: Problem = field(repr=False)
    starts: list[int]
    strat: list[int]               # strategy index per layer
    time: float
    memory: list[float]            # per stage, bytes per device
    source: str                    # "uniap" | "amp" | "megatron" | "exhaustive"
    gap: Optional[float] = None    # the MILP's, when it stopped before proving optimality
    status: str = ""

    @property
    def choice(self):
        return self.problem.choice

    @property
    def schedule(self) -> str:
        """The pipeline schedule it was priced for ("1f1b" at pp = 1)."""
        return self.problem.inst.schedule

    @property
    def virtual(self) -> int:
        """Chunks per rank (interleaved-1f1b), else 1."""
        return self.problem.inst.virtual

    @property
    def degrees(self) -> list[int]:
        """TP degree per layer."""
        return [self.choice.degrees[s] for s in self.strat]

    def ranges(self) -> list[tuple[int, int]]:
        ends = self.starts[1:] + [len(self.strat)]
        return list(zip(self.starts, ends))

    def stages(self) -> list[dict]:
        """The plan file's ``stages`` (every block of a layer at the layer's degree)."""
        ch = self.choice
        return [{"layers": [a, b], "dp": ch.mesh_dp, "tp": ch.tp,  # a stage's dp: x cp
                 "degrees": [d for d in self.degrees[a:b] for _ in (0, 1)]}
                for a, b in self.ranges()]

    def key(self) -> tuple:
        ch = self.choice
        return (ch.pp, ch.dp, ch.tp, ch.micro_batches, tuple(self.starts), tuple(self.strat),
                ch.cp, ch.zero, ch.secondary, ch.reduce_bytes, self.schedule)

    def describe(self) -> str:
        ch = self.choice
        parts = []
        for (a, b), d in zip(self.ranges(), self.stage_degrees()):
            parts.append(f"layers {a}-{b - 1} @ {d}")
        sched = f" ({self.schedule})" if ch.pp > 1 else ""
        zero = f", ZeRO-{ch.zero}{' + node shard' if ch.secondary else ''}" if ch.zero else ""
        zero += ", bf16 gradient sums" if ch.reduce_bytes == 2 else ""
        return (f"pp {ch.pp} x dp {ch.dp} x {mesh(ch)}{sched}{zero}, {self.batches()}: "
                + " | ".join(parts))

    def batches(self) -> str:
        """"8 micro-batches of 4 sequences" (the whole pipeline's micro-batch)."""
        n, rows = self.choice.micro_batches, self.choice.rows * self.choice.dp
        return f"{n} micro-batch{'es' if n > 1 else ''} of {rows} sequence{'s' if rows > 1 else ''}"

    def stage_degrees(self) -> list[str]:
        """Per stage, its layers' degrees, run-length coded ("tp4 x3, tp2 x1")."""
        out = []
        for a, b in self.ranges():
            runs: list[list] = []
            for d in self.degrees[a:b]:
                if runs and runs[-1][0] == d:
                    runs[-1][1] += 1
                else:
                    runs.append([d, 1])
            out.append(", ".join(f"tp{d} x{n}" for d, n in runs))
        return out


@dataclass
class SearchResult:
    ranked: list[Candidate]        # distinct plans, fastest first
    megatron: Optional[Candidate]  # best uniform Megatron-style layout
    amp: Optional[Candidate]       # AMP's pick
    choices: int                   # outer choices enumerated
    milps: int = 0                 # MILPs solved
    pruned: int = 0                # choices the lower bound skipped
    solve_s: float = 0.0           # seconds in the MILP solver (model building included)
    total_s: float = 0.0           # the whole search
    method: str = "uniap"

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


def candidate(prob: Problem, starts, strat, source: str, **kw) -> Candidate:
    return Candidate(prob, list(starts), list(strat), prob.time(starts, strat),
                     prob.memory(starts, strat), source, **kw)


def megatron_plan(prob: Problem) -> Optional[Candidate]:
    """Every layer at degree tp on the runtime's even split, if it fits."""
    if prob.tp_index is None:
        return None
    L = prob.inst.L
    starts, strat = even_starts(L, prob.choice.pp), [prob.tp_index] * L
    used = uniap.evaluate(prob.inst, starts, strat)[1]
    if any(u > lim for u, lim in zip(used, prob.inst.memory_limit)):
        return None
    return candidate(prob, starts, strat, "megatron")


def amp_plan(prob: Problem) -> Optional[Candidate]:
    got = amp.best_uniform(prob.inst)
    if got is None:
        return None
    s = prob.inst.strategies.index(got.strategy)
    return candidate(prob, got.partition.starts, [s] * prob.inst.L, "amp")


def lower_bound(prob: Problem) -> float:
    """No plan of this choice is faster (module docstring)."""
    inst = prob.inst
    alpha, beta, kappa = inst.time_weights()
    least = [min(min(inst.t[p][l]) for p in range(inst.stages)) for l in range(inst.L)]
    total = sum(least)
    peak = max(total / inst.stages, max(least))
    if (alpha, kappa) != (1.0, 0.0):  # the sum part weighs each layer alpha t - kappa w
        total = sum(min(alpha * t - kappa * w for p in range(inst.stages)
                        for t, w in zip(inst.t[p][l], inst.wgrad[p][l])) for l in range(inst.L))
    return total + beta * peak + prob.constant


def solve_milp(prob: Problem, start: Optional[Candidate], limit: float, gap: float
          ) -> Optional[Candidate]:
    warm = (start.starts, start.strat) if start is not None else None
    try:
        res = uniap.solve(prob.inst, time_limit=limit, gap=gap, start=warm, explain=False)
    except (uniap.NoPlan, RuntimeError):
        return None  # nothing fits, or nothing found in time: the AMP plan (if any) stays
    strat = [prob.inst.strategies.index(s) for s in res.strategies]
    starts = [a for a, _ in res.stages]
    return candidate(prob, starts, strat, "uniap",
                      gap=None if res.status == "optimal" else res.gap, status=res.status)


def search(job: Job, world: int, cluster, profile: Profile, base: RunShape,
           method: str = "uniap", budget_s: float = 6.0, gap: float = 0.01,
           min_limit_s: float = 0.5, memory_limit: Optional[float] = None,
           log: Callable[[str], None] = print,
           schedules: Optional[Sequence[str]] = None) -> SearchResult:
    """Search every outer choice up to ``base.tp`` (the profiled degrees) on ``world``
    ranks, under each pipeline schedule of ``schedules`` (default: the job's
    ``pp_schedule`` alone; :data:`CHOOSABLE` lets the search choose); raises
    :class:`ConfigError` when no layout fits."""
    if method not in METHODS:
        raise ConfigError(f"unknown search {method!r} (one of {', '.join(METHODS)})")
    t0 = time.perf_counter()
    problems = _problems(job, world, cluster, profile, base, memory_limit,
                         schedules or (job.pp_schedule,))
    choices = len({p.choice for p in problems})
    if not problems:
        raise ConfigError(f"no (pp, dp, tp, micro-batches) layout of {world} devices runs the "
                          f"global batch of {job.global_batch} sequences")
    log(f"planning over {choices} layouts (pp, dp x cp x tp, micro-batches) of {world} devices"
        + (f" x {len(schedules)} schedules" if schedules and len(schedules) > 1 else ""))
    megatron = [c for c in map(megatron_plan, problems) if c is not None]
    # interleaved-1f1b runs the even split at one degree only (PipelineLayout.chunks),
    # and so does cp (the plans a cp run takes, oases.planner.plan_file.check_cp): their
    # candidates are those; AMP and UniAP place layers freely, so not over them
    free = [p for p in problems if p.inst.virtual == 1 and p.choice.cp == 1]
    amps = {id(p): amp_plan(p) for p in free}
    found = [c for c in amps.values() if c is not None]
    res = SearchResult([], _min(megatron), _min(found), choices, method=method)
    found += [c for c in megatron if c.virtual > 1 or c.choice.cp > 1]
    if method == "uniap":
        found += _uniap(free, amps, res, budget_s, gap, min_limit_s, log)
    ranked, seen = [], set()
    for c in sorted(found, key=lambda c: c.time):
        if c.key() not in seen:
            seen.add(c.key())
            ranked.append(c)
    if not ranked:
        raise ConfigError(_no_fit(problems))
    res.ranked = ranked
    res.total_s = time.perf_counter() - t0
    return res


def _problems(job: Job, world: int, cluster, profile: Profile, base: RunShape,
              memory_limit: Optional[float], schedules: Sequence[str]) -> list[Problem]:
    """One problem per (choice, schedule), each choice's stages built once; a choice of
    one stage once (it runs no pipeline schedule)."""
    unknown = [k for k in schedules if k not in KINDS]
    if unknown:
        raise ConfigError(f"unknown pipeline schedule(s) {', '.join(unknown)} "
                          f"(one of {', '.join(KINDS)})")
    built: dict = {}
    out = []
    for kind in schedules:
        virtual = 1
        if kind in VIRTUAL_KINDS:
            virtual = job.pp_virtual if job.pp_virtual > 1 else SEARCH_VIRTUAL
        kjob = dataclasses.replace(job, pp_schedule=kind, pp_virtual=virtual)
        for ch in enumerate_choices(kjob, world, max_tp=base.tp):
            if ch.pp > 1 and job.shape.n_layer % (ch.pp * virtual):
                continue  # no equal chunks
            if ch not in built:
                built[ch] = build(kjob, ch, cluster, profile, base, memory_limit)
                out.append(built[ch])
            elif ch.pp > 1:
                out.append(with_schedule(built[ch], kjob))
    return out


def _uniap(problems, amps, res: SearchResult, budget_s, gap, min_limit_s, log) -> list:
    best = res.amp.time if res.amp is not None else float("inf")
    order = sorted(problems, key=lambda p: (amps[id(p)] is None,
                                            amps[id(p)].time if amps[id(p)] else 0.0))
    todo = [p for p in order if p.inst.S > 1]
    out = []
    for k, prob in enumerate(todo):
        if lower_bound(prob) >= best * (1 - gap):
            res.pruned += 1
            continue
        if res.solve_s >= budget_s:
            res.pruned += 1
            continue
        limit = max(min_limit_s, (budget_s - res.solve_s) / (len(todo) - k))
        ch = prob.choice
        log(f"solving {ch.label()} ({prob.inst.L} layers x {prob.inst.S} strategies, "
            f"limit {limit:.1f} s) ...")
        t = time.perf_counter()
        got = solve_milp(prob, amps[id(prob)], limit, gap)
        res.solve_s += time.perf_counter() - t
        res.milps += 1
        if got is not None:
            out.append(got)
            best = min(best, got.time)
    return out


def mesh(ch) -> str:
    """A choice's "cp 2 x tp 4" (cp shown where > 1)."""
    return (f"cp {ch.cp} x " if ch.cp > 1 else "") + f"tp {ch.tp}"


def _min(cands: list) -> Optional[Candidate]:
    return min(cands, key=lambda c: c.time) if cands else None


def _no_fit(problems: list[Problem]) -> str:
    p = problems[0]
    lim = p.inst.memory_limit[0] + p.memory_const[0]
    return (f"no layout found that fits in {lim / 2**30:.3f} GiB per device (every (pp, dp x "
            f"cp x tp, micro-batches) tried): give more memory or devices, or a smaller batch")


# ---- the reference: every plan priced ----

def space_size(problems: list[Problem]) -> int:
    """Plans an exhaustive enumeration prices: per choice, C(L-1, pp-1) contiguous
    partitions times S^L per-layer strategies (exact, however large)."""
    return sum(math.comb(p.inst.L - 1, p.inst.stages - 1) * p.inst.S ** p.inst.L
               for p in problems)


def exhaustive(problems: list[Problem]) -> tuple[Optional[Candidate], int]:
    """(the fastest plan that fits, plans priced) over every choice x contiguous
    partition x strategy per layer: the search's reference, feasible only on small
    problems (:func:`space_size`). A plan is priced once (``uniap.evaluate``: its time
    and per-stage memory, as :meth:`Problem.time` and :meth:`Problem.memory` give them
    less the per-choice constants) and fits when every stage is within its limit."""
    best, best_t, priced = None, math.inf, 0
    for prob in problems:
        inst = prob.inst
        for cuts in itertools.combinations(range(1, inst.L), inst.stages - 1):
            starts = [0, *cuts]
            for strat in itertools.product(range(inst.S), repeat=inst.L):
                t, used = uniap.evaluate(inst, starts, strat)
                priced += 1
                if t + prob.constant < best_t and all(
                        u <= lim for u, lim in zip(used, inst.memory_limit)):
                    best, best_t = (prob, starts, strat), t + prob.constant
    if best is None:
        return None, priced
    return candidate(best[0], best[1], best[2], "exhaustive"), priced
