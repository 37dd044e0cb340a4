"""``parallel.plan=auto`` with ``parallel.plan_search=uniap|amp``: the whole layout
(pipeline stages and their layer ranges, each stage's dp x tp, per-block degrees, context
parallelism, the micro-batch size and count) chosen at start-up, before any group of the
run exists.

    every rank                           rank 0                  every rank
    join the world  -> profile as plan=auto  -> search the cluster  -> the k best plans
                       does, at pp 1 and the    file's layouts         (broadcast as YAML)
                       largest tp searched      (oases.planner.search)
                    -> plan_trials > 1: build each plan's groups and model, time a few
                       real steps of it (the slowest rank's median), keep the fastest
                    -> write it to <out_dir>/plan.yaml and run it: parallel.pp/tp/cp,
                       train.micro_batch_size/grad_accum and parallel.plan are set from it

The search prices layouts with the cluster file's links, node speeds and memories
(``parallel.cluster`` is required) and the profile measured on the live cluster
(collectives, block compute on every rank, the host cost of communication calibrated
by real steps: :func:`oases.planner.online.measure_profile`); the
trials measure the live cluster, which is what AMP does with its top-k (its budget).
The global batch of the config is kept. Rank 0 searches alone while the others wait
in the broadcast: the search takes seconds (``benchmarks/results/plan_search.md``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
import yaml

from oases.config import Config
from oases.errors import ConfigError, UserError
from oases.parallel.groups import (ParallelContext, backend_for, build_context,
                                   build_pipeline_context, pick_device)
from oases.planner import report as rep
from oases.planner.calibrate import time_throwaway
from oases.planner.cluster import load_cluster
from oases.planner.comm_memory import for_backend
from oases.planner.online import (fit_sub_batches, measure_profile, resolve_layout, resolve_plan,
                                  stage_logger)
from oases.planner.plan_file import batch_divisor
from oases.planner.search import choosable, search
from oases.planner.stages import enumerate_choices, job_from_config, profile_run

TRIAL_STEPS = 3  # timed steps per trial, after 2 warm-up steps

# The runtime's throwaway training step: (config, context, degrees) -> one step to time,
# with close() to free its model. Passed in by the runtime, which sits above the planner.
StepOf = Callable[[Config, ParallelContext, Optional[list[int]]], Callable[[], None]]


def choose_layout(cfg: Config, world: int, join, step_of: StepOf) -> Config:
    """Search (rank 0), try the best ``parallel.plan_trials`` plans, and return the config
    of the chosen one (``cfg`` itself is left as it is). ``join()`` joins the default
    process group; ``step_of`` builds a throwaway step of a layout. Collective."""
    p = cfg.parallel
    join()
    rank = dist.get_rank()
    log = print if rank == 0 else (lambda *_: None)
    device = pick_device(p.device)
    job, base = _job(cfg, world)
    profile = _profile(cfg, world, job, base, device, log, step_of)  # collective
    box: list = [None]
    if rank == 0:
        try:
            box[0] = _search(cfg, world, job, base, profile, log)
        except UserError as e:
            box[0] = e
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise box[0]
    texts = box[0]
    best = 0
    if len(texts) > 1:
        # trials draw random numbers (throwaway models): the run must not depend on them
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            times = [_trial(cfg, world, t, k, len(texts), log, step_of)
                     for k, t in enumerate(texts)]
        best = min(range(len(times)), key=times.__getitem__)
        log(f"plan=auto: trial {best + 1} is the fastest ({1e3 * times[best]:.1f} ms per step)")
    path = Path(cfg.out_dir) / "plan.yaml"
    _write(path, texts[best])
    chosen = pointed_at(cfg, path, world)
    log(f"plan=auto: wrote {path}; running it: " + " ".join(_overrides(chosen)))
    return chosen


def _job(cfg: Config, world: int):
    """(Job, the run to profile at) of the search; the same on every rank."""
    p = cfg.parallel
    if not p.cluster:
        raise ConfigError(f"parallel.plan_search={p.plan_search} prices layouts on the "
                          f"cluster's links and devices: set parallel.cluster to its file")
    job = job_from_config(cfg, load_cluster(p.cluster).devices_per_node)
    choices = enumerate_choices(job, world)
    if not choices:
        raise ConfigError(f"no (pp, dp x cp x tp, micro-batches) layout of {world} devices runs "
                          f"the global batch of {job.global_batch} sequences")
    return job, profile_run(job, max(ch.tp for ch in choices), cfg.train.micro_batch_size)


def _profile(cfg: Config, world: int, job, base, device, log, step_of: StepOf):
    """The profile the search prices with, measured as ``parallel.plan=auto`` measures
    it (:func:`oases.planner.online.measure_profile`) in a pp-1 run at the largest tp
    searched, dp x that tp = the world: its collectives, block compute on every rank,
    and the host cost of communication calibrated by real steps of that run (rank 0;
    None elsewhere). Collective."""
    cluster = load_cluster(cfg.parallel.cluster)
    if cluster.world != world:
        raise ConfigError(f"cluster file {cfg.parallel.cluster} has {cluster.world} devices "
                          f"but this run has {world} processes")
    ctx = build_context(base.tp, device, cfg.model.n_kv_heads,
                        cfg.parallel.nccl_high_priority_tp)
    run = dataclasses.replace(base, dp=ctx.dp)
    cal = cfg.with_changes({  # the calibration's run: every block at degree base.tp
        # whole sequences: the search prices cp from them (oases.planner.cp_cost)
        "parallel.pp": 1, "parallel.tp": base.tp, "parallel.cp": 1, "parallel.plan": None,
        "parallel.plan_trials": 1, "train.micro_batch_size": base.micro_batch_size,
        "train.grad_accum": 1, "parallel.zero_search": False,  # settings of a searched run
        "parallel.grad_reduce_dtype": "fp32" if cfg.parallel.grad_reduce_dtype == "auto"
        else cfg.parallel.grad_reduce_dtype})
    log(f"plan=auto: profiling at pp 1, tp {base.tp}, dp {ctx.dp}, micro-batch "
        f"{base.micro_batch_size}")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        profile = measure_profile(cal, ctx, run, cluster,
                                  lambda n: time_throwaway(step_of(cal, ctx, None), device, n),
                                  stage_logger(log, 3))
    ctx.close()  # its communicators are not the run's (every rank, after the same steps)
    return profile


def _search(cfg: Config, world: int, job, base, profile, log) -> list[str]:
    """The k best plans of the layout search, as Plan YAML texts (rank 0)."""
    p = cfg.parallel
    # what a communicator costs the run (stages.build takes them off a derived limit)
    cluster = for_backend(load_cluster(p.cluster), backend_for(pick_device(p.device), p.backend))
    limit = p.memory_limit_gib * 2**30 if p.memory_limit_gib else None
    kinds = choosable(p.overlap_fb)  # the pipeline schedule is chosen with the layout
    res = search(job, world, cluster, profile, base, p.plan_search, memory_limit=limit, log=log,
                 schedules=kinds)
    if not job.sequence_parallel and base.tp > 1:
        # SP priced at the profiled sub-batches, in step: kept only where it wins even so
        log("plan=auto: the layout search again with sequence parallelism")
        try:
            with_sp = search(dataclasses.replace(job, sequence_parallel=True), world, cluster,
                             profile, base, p.plan_search, memory_limit=limit, log=log,
                             schedules=kinds)
        except ConfigError:  # no layout with SP fits
            with_sp = None
        if with_sp is not None:
            t0, t1 = res.best.time, with_sp.best.time
            log(f"plan=auto: sequence_parallel {'on' if t1 < t0 else 'off'} (predicted "
                f"{1e3 * t1:.1f} ms per iteration with it, {1e3 * t0:.1f} ms without)")
            res = with_sp if t1 < t0 else res
    for line in rep.summary(res, res.best):
        log(line)
    ranked = res.ranked[:p.plan_trials]
    return [yaml.safe_dump(_plan_dict(rep.to_plan(c, res, cfg, cluster.name)), sort_keys=False)
            for c in ranked]


def _plan_dict(plan) -> dict:
    return dataclasses.asdict(plan)


def _write(path: Path, text: str) -> None:
    """Every rank writes the same text (nodes need not share a disk): atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def pointed_at(cfg: Config, path: Path, world: int, **extra) -> Config:
    """A copy of ``cfg`` that runs the plan at ``path``: the layout and batch it was
    priced for."""
    d = yaml.safe_load(path.read_text())
    sp = bool(d.get("sequence_parallel")) or cfg.parallel.sequence_parallel
    chosen = cfg.with_changes({
        "parallel.plan": str(path), "parallel.pp": int(d.get("pp") or 1),
        "parallel.tp": int(d["tp"]), "parallel.cp": int(d.get("cp") or 1),
        "train.micro_batch_size": int(d["micro_batch_size"]),
        "train.grad_accum": int(d["micro_batches"]), "parallel.sequence_parallel": sp,
        "parallel.plan_trials": 1,  # chosen: the run is the plan file's
        # the ZeRO level, secondary shard and gradient-sum dtype it was priced with
        "parallel.zero": max(d.get("zero") or [0]), "parallel.zero_search": False,
        "parallel.zero_secondary": d.get("zero_secondary") or "none",
        "parallel.grad_reduce_dtype": d.get("grad_reduce_dtype") or (
            "fp32" if cfg.parallel.grad_reduce_dtype == "auto" else cfg.parallel.grad_reduce_dtype),
        **({"parallel.pp_schedule": d["pp_schedule"],
            "parallel.pp_virtual": int(d.get("pp_virtual") or 1)} if d.get("pp_schedule")
           else {}),
        **extra})
    chosen = fit_sub_batches(chosen, plan_divisor(d))
    if chosen.parallel.sub_batches == "auto":  # the count the layout was priced at runs
        chosen = chosen.with_changes({"parallel.sub_batches": chosen.sub_batches})
    return chosen


def plan_divisor(d: dict) -> int:
    """The parts the plan ``d``'s smallest degree splits each (sub-)batch into."""
    tp = int(d["tp"])
    degrees = [d.get("degrees") or []] + [s.get("degrees") or [] for s in d.get("stages") or []]
    return max(batch_divisor([int(t) for t in g], tp) for g in degrees)


def _overrides(cfg: Config) -> list[str]:
    return [f"parallel.pp={cfg.parallel.pp}", f"parallel.tp={cfg.parallel.tp}",
            f"parallel.cp={cfg.parallel.cp}",
            f"train.micro_batch_size={cfg.train.micro_batch_size}",
            f"train.grad_accum={cfg.train.grad_accum}", f"parallel.zero={cfg.parallel.zero}",
            f"parallel.zero_secondary={cfg.parallel.zero_secondary}",
            f"parallel.grad_reduce_dtype={cfg.parallel.grad_reduce_dtype}"]


def _trial(cfg: Config, world: int, text: str, k: int, n: int, log,
           step_of: StepOf) -> float:
    """The median step time of plan ``text`` on the live cluster (collective: every rank
    builds the plan's groups and a throwaway model, and times the same steps)."""
    path = Path(cfg.out_dir) / f"plan-trial-{k + 1}.yaml"
    _write(path, text)
    trial = pointed_at(cfg, path, world, **{"parallel.plan_calibration_steps": 0})
    device = pick_device(cfg.parallel.device)
    fast_tp, cp = trial.parallel.nccl_high_priority_tp, trial.parallel.cp
    if trial.parallel.pp > 1:
        ctx = build_pipeline_context(resolve_layout(trial, world), device,
                                     bool(trial.model.tie_embeddings), trial.model.n_kv_heads,
                                     fast_tp, cp)
        degrees = None
    else:
        ctx = build_context(trial.parallel.tp, device, trial.model.n_kv_heads, fast_tp, cp)
        trial, degrees = resolve_plan(trial, ctx)
    t = time_throwaway(step_of(trial, ctx, degrees), device, TRIAL_STEPS)
    # every rank: a trial's groups (NCCL communicators and their buffers) would otherwise
    # stay beside the next trial's and the run's
    ctx.close()
    log(f"plan=auto: trial {k + 1}/{n}: {' '.join(_overrides(trial))}: "
        f"{1e3 * t:.1f} ms per step ({path})")
    return t
