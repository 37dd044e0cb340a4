"""The exhaustive reference of the layout search (``oases.planner.search.exhaustive``)
and the plan_search benchmark's use of it (``benchmarks.lib.search_timing``)."""

from __future__ import annotations

import math

import pytest

from benchmarks.lib import search_timing as ps
from oases.planner import stages as st
from oases.planner.cluster import Cluster
from oases.planner.cost import ModelShape
from oases.planner.fit import analytic_profile
from oases.planner.search import exhaustive, search, space_size

SHAPE = ModelShape("gpt", 4, 256, 8, 8, 1024, 512, 64)


def _setup():
    job = st.Job(SHAPE, 16, 2, "megatron", "none")
    cluster = Cluster("c", 2, 2, 4, 10.0, 2.0)
    base = st.profile_run(job, 4, 8)
    return job, cluster, base, analytic_profile(SHAPE, base, [1, 2, 4], 5e9)


def test_exhaustive_equals_the_uniap_search_under_a_memory_limit():
    """World 4, 4 layers, 0.4 of the memory the unconstrained pick needs: the enumeration
    prices exactly the space it counts, its optimum fits, and it is the MILP search's
    pick (which mixes degrees, so AMP's uniform pick is slower)."""
    job, cluster, base, prof = _setup()
    quiet = dict(log=lambda s: None)
    limit = 0.4 * max(search(job, 4, cluster, prof, base, **quiet).best.memory)
    res = search(job, 4, cluster, prof, base, gap=1e-9, budget_s=30, memory_limit=limit,
                 **quiet)
    problems = [st.build(job, ch, cluster, prof, base, limit)
                for ch in st.enumerate_choices(job, 4, 4)]
    best, priced = exhaustive(problems)
    assert priced == space_size(problems) == sum(
        math.comb(3, p.choice.pp - 1) * len(p.choice.degrees) ** 4 for p in problems)
    assert best.source == "exhaustive"
    assert all(m <= limit * (1 + 1e-9) for m in best.memory)
    assert best.time == pytest.approx(res.best.time, rel=1e-9)
    assert best.time < res.amp.time * (1 - 1e-3)


def test_exhaustive_finds_nothing_when_nothing_fits():
    job, cluster, base, prof = _setup()
    problems = [st.build(job, ch, cluster, prof, base, 1.0)
                for ch in st.enumerate_choices(job, 4, 4)]
    assert exhaustive(problems) == (None, space_size(problems))


def test_benchmark_estimates_only_what_it_does_not_enumerate(monkeypatch):
    """search_timing.against_exhaustive on the 8-layer problem, with searches' rows
    stubbed: above the time cap it reports an estimate (plans / sampled rate) and runs
    nothing; the space is counted exactly either way."""
    called = []
    monkeypatch.setattr(ps, "run_exhaustive", lambda name: called.append(name))
    rows = [{"problem": "8 layers x 8 devices", "method": m, "total_s": 0.1, "time_s": 1.0}
            for m in ("uniap", "amp")]
    e = ps.against_exhaustive("8 layers x 8 devices", rows, 1, max_s=0.0)
    assert not e["measured"] and not called
    assert e["plans"] == space_size(ps.problems("8 layers x 8 devices")) > 10**5
    assert e["estimate_s"] == pytest.approx(e["plans"] / e["rate_plans_per_s"])
    assert e["speedup"] == pytest.approx(e["estimate_s"] / 0.1)
    assert "estimated" in ps.seconds_text(e) and "not enumerated" in ps.vs_optimum_text(e)
