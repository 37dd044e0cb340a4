"""The planner validation benchmark's candidates (``benchmarks.lib.layouts``): every
uniform and random layout it would measure is a plan the runtime accepts with its run
overrides (no cluster, no torch run)."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.lib import layouts as pl
from oases.config import load_config
from oases.planner import report as rep
from oases.planner.cluster import load_cluster
from oases.planner.fit import analytic_profile
from oases.planner.online import resolve_layout
from oases.planner.search import search
from oases.planner.stages import build, enumerate_choices, job_from_config, profile_run

REPO = Path(__file__).resolve().parents[1]


def test_candidates_are_valid_plans(tmp_path):
    args = argparse.Namespace(d_model=256, n_layer=8, n_head=4, seq_len=64, batch=16)
    cfg = pl.job_config(args)
    job = job_from_config(cfg)
    choices = enumerate_choices(job, pl.WORLD)
    base = profile_run(job, max(c.tp for c in choices), cfg.train.micro_batch_size)
    prof = analytic_profile(job.shape, base, job.shape.valid_degrees(base.tp), flops_per_s=5e10)
    cluster = load_cluster(REPO / "configs/cluster/four-nodes-halfspeed.yaml")
    problems = [build(job, ch, cluster, prof, base) for ch in choices]
    quiet = lambda s: None  # noqa: E731
    res_u = search(job, pl.WORLD, cluster, prof, base, "uniap", budget_s=0.5, log=quiet)
    res_a = search(job, pl.WORLD, cluster, prof, base, "amp", log=quiet)
    cands, aliases = pl.candidates(problems, res_u, res_a, 5, seed=0)
    uniform = {(c.choice.pp, c.choice.dp, c.choice.tp) for n, c in cands.items()
               if n.startswith("uniform")}
    uniform |= {(c.choice.pp, c.choice.dp, c.choice.tp) for n, c in cands.items()
                if any(a.startswith("uniform") for a in aliases.get(n, []))}
    assert uniform == {(ch.pp, ch.dp, ch.tp) for ch in choices}  # every (pp, dp, tp) once
    assert sum(n.startswith("random") for n in cands) == 5
    assert len({c.key() for c in cands.values()}) == len(cands)
    for name, c in cands.items():
        path = tmp_path / f"{name}.yaml"
        rep.to_plan(c, res_u, cfg, cluster.name).save(path)
        run = load_config(str(REPO / "configs/gpt-tiny.yaml"),
                          pl.model_overrides(args) + [f"parallel.plan={path}",
                                                      *rep.run_overrides(c)]).validate(pl.WORLD)
        layout = resolve_layout(run, pl.WORLD)
        assert [list(s.layers) for s in layout.stages] == [list(r) for r in c.ranges()], name
        assert run.global_batch_size == args.batch


def test_an_interleaved_pick_is_a_plan_the_runtime_accepts(tmp_path):
    """The search's interleaved-1f1b candidates (even split, one degree, v = 2) save as
    plans whose run overrides and layout give every rank its chunks."""
    args = argparse.Namespace(d_model=256, n_layer=8, n_head=4, seq_len=64, batch=16)
    cfg = pl.job_config(args)
    job = job_from_config(cfg)
    base = profile_run(job, 2, cfg.train.micro_batch_size)
    prof = analytic_profile(job.shape, base, job.shape.valid_degrees(base.tp), flops_per_s=5e10)
    cluster = load_cluster(REPO / "configs/cluster/four-nodes-halfspeed.yaml")
    res = search(job, pl.WORLD, cluster, prof, base, "amp", log=lambda s: None,
                 schedules=("1f1b", "interleaved-1f1b"))
    picks = [c for c in res.ranked if c.schedule == "interleaved-1f1b"]
    assert picks
    for i, c in enumerate(picks):
        path = tmp_path / f"inter-{i}.yaml"
        rep.to_plan(c, res, cfg, cluster.name).save(path)
        assert "parallel.pp_virtual=2" in rep.run_overrides(c)
        run = load_config(str(REPO / "configs/gpt-tiny.yaml"),
                          pl.model_overrides(args) + [f"parallel.plan={path}",
                                                      *rep.run_overrides(c)]).validate(pl.WORLD)
        assert (run.parallel.pp_schedule, run.parallel.pp_virtual) == ("interleaved-1f1b", 2)
        layout = resolve_layout(run, pl.WORLD)
        per = args.n_layer // (2 * layout.pp)
        assert [layout.chunks(s, 2) for s in range(layout.pp)] == [
            ((s * per, (s + 1) * per), ((layout.pp + s) * per, (layout.pp + s + 1) * per))
            for s in range(layout.pp)]
