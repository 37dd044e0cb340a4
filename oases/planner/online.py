"""``parallel.plan`` at run time: load a Plan file, or make one (``auto``).

``auto`` profiles on the live cluster: collectives on all ranks (they are
collective), block compute on every rank at once (so that the measurement sees
the contention of a real step; the figures are averaged over the ranks: with
more processes than cores, one rank's time slices are noisy), unless rank 0's
profile DB already holds this model and machine. Rank 0 solves the ILP and
broadcasts the degrees. Before solving, a few real training steps with every block
at degree tp calibrate the cost model's host cost of communication
(``parallel.plan_calibration_steps``; :func:`oases.planner.fit.calibrate_host_cost`).
The plan goes to ``<out_dir>/plan.yaml``, the whole profile (compute, collectives,
calibration) to ``<out_dir>/profile.json``. Where a step pairs backwards with forwards
(``oases``, ``grad_accum`` >= 2) the planner predicts both schedules and turns
``parallel.overlap_fb`` on when the pairs are predicted faster.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from oases.config import Config
from oases.config.heads import heads_problem
from oases.errors import ConfigError, UserError
from oases.parallel.groups import ParallelContext, backend_for
from oases.parallel.layout import PipelineLayout, stages_layout, uniform_layout
from oases.planner.api import make_plan, report, run_shape
from oases.planner.cluster import Cluster, load_cluster
from oases.planner.comm_memory import config_bytes, for_backend
from oases.planner.comm_profile import profile_comm
from oases.planner.cost import ModelShape, Profile
from oases.planner.fit import calibrate_host_cost
from oases.planner.stages import scale_profile
from oases.planner.plan_file import (batch_divisor, check_cp, check_degrees, check_model,
                                     check_plan, check_run, check_zero, load_plan)
from oases.planner.profile import (default_db, get_profile, load_db, profile_key, run_precision,
                                   save_profile)

StepTimer = Callable[[Optional[list[int]], int], float]


def resolve_layout(cfg: Config, world: int) -> PipelineLayout:
    """The stages of a run: from the plan file's ``stages`` if it has them, else
    ``parallel.pp`` stages of dp x tp with the layers split evenly (and a plan file's
    per-block ``degrees`` cut along them). Needs no process group (``plan=auto`` is
    pp=1 only and resolves its degrees later, in :func:`resolve_plan`)."""
    p = cfg.parallel
    plan = load_plan(p.plan) if p.plan and p.plan != "auto" else None
    if plan is not None:  # a searched plan: first of all, the run it was made for
        check_run(plan, cfg, f"plan file {p.plan}")
        check_cp(plan, cfg, f"plan file {p.plan}")
    if plan is None or not plan.stages:
        degrees = None
        if plan is not None and p.pp > 1:
            degrees = check_plan(plan, cfg.model, p.tp, f"plan file {p.plan}")
            _check_rows(cfg, degrees, p.tp, cfg.train.micro_batch_size)
        return uniform_layout(world, p.pp, p.tp, cfg.model.n_layer, degrees)
    where = f"plan file {p.plan}"
    check_model(plan, cfg.model, where)
    if plan.zero:
        check_zero(plan.zero, cfg.model.n_layer, where)
    if len(plan.stages) != p.pp:
        raise ConfigError(f"{where} has {len(plan.stages)} stages but parallel.pp={p.pp}")
    # a stage's dp counts its cp ranks, which read the same rows: in chunks of a row, a
    # pipeline micro-batch is cp x its rows
    cp = p.cp
    layout = stages_layout(plan.stages, world, cfg.model.n_layer, where,
                           cfg.pipeline_batch * cp)
    for s in layout.stages:
        heads = heads_problem(cfg.model.n_head, cfg.model.n_kv_heads, s.tp)
        if heads:
            raise ConfigError(f"{where}: a stage at tp={s.tp} {heads}")
        if cfg.model.ffn_hidden % s.tp:
            raise ConfigError(f"{where}: a stage at tp={s.tp} does not divide "
                              f"model.ffn_hidden={cfg.model.ffn_hidden}")
        if s.degrees is not None:
            check_degrees(list(s.degrees), s.tp, cfg.model, where, 2 * s.layers[0])
        _check_rows(cfg, s.degrees, s.tp, cfg.pipeline_batch * cp // s.dp)
    return layout


def _check_rows(cfg: Config, degrees, tp: int, rows: int) -> None:
    """A replica's micro-batch must split into sub-batches, and each into the parts of
    its smallest block degree."""
    p = cfg.parallel
    n = cfg.sub_batches if p.schedule == "oases" else 1
    auto = (f" (parallel.sub_batches=auto chose {n} for sequence_parallel: set it to 2)"
            if p.sub_batches == "auto" and n > 2 else "")
    if rows % n:
        raise ConfigError(f"a stage replica's micro-batch of {rows} sequences cannot be split "
                          f"into parallel.sub_batches={n}{auto}")
    k = batch_divisor(list(degrees), tp) if degrees else 1
    if (rows // n) % k:
        raise ConfigError(f"the plan runs blocks at degree {tp // k}, which splits each "
                          f"{'sub-' if n > 1 else ''}batch of {rows // n} into {k} parts: "
                          f"the micro-batch must allow that{auto}")


def fit_sub_batches(cfg: Config, k: int) -> Config:
    """``cfg``, or, where ``parallel.sub_batches=auto`` gives more than two sub-batches
    (sequence parallelism) and a plan's smallest degree splits each into ``k`` parts
    they do not hold, ``cfg`` at two."""
    if cfg.parallel.sub_batches == "auto" and cfg.sub_batches > 2 \
            and (cfg.train.micro_batch_size // cfg.sub_batches) % k:
        return cfg.with_changes({"parallel.sub_batches": 2})
    return cfg


def resolve_plan(cfg: Config, ctx: ParallelContext, time_steps: Optional[StepTimer] = None
                 ) -> tuple[Config, Optional[list[int]]]:
    """The config to run (``cfg``, or with ``parallel.plan=auto`` the copy that runs what
    the planner chose) and its per-block degrees, or None (every block at degree tp).
    ``time_steps(degrees, n)``: the median time of n real steps with those degrees
    (collective), for ``plan=auto``'s calibration."""
    p = cfg.parallel
    if not p.plan:
        return cfg, None
    if p.plan == "auto":
        # profiling and calibration draw random numbers: the run that follows must not
        # depend on them (plan=auto trains as the plan file it writes would)
        with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
            cfg, degrees = _auto(cfg, ctx, time_steps)
        p = cfg.parallel
    else:
        plan = load_plan(p.plan)
        check_run(plan, cfg, f"plan file {p.plan}")
        check_cp(plan, cfg, f"plan file {p.plan}")
        degrees = check_plan(plan, cfg.model, p.tp, f"plan file {p.plan}")
        if plan.sequence_parallel and not p.sequence_parallel:  # the plan was priced with it
            cfg = cfg.with_changes({"parallel.sequence_parallel": True})
            p = cfg.parallel
    k = batch_divisor(degrees, p.tp)
    cfg = fit_sub_batches(cfg, k)
    rows = cfg.train.micro_batch_size // (cfg.sub_batches if p.schedule == "oases" else 1)
    if rows % k:
        raise ConfigError(f"the plan runs blocks at degree {p.tp // k}, which splits each "
                          f"{'sub-' if p.schedule == 'oases' else ''}batch of {rows} into {k} "
                          f"parts: train.micro_batch_size must allow that")
    if set(degrees) == {p.tp}:
        return cfg, None
    return cfg, degrees


def measure_profile(cfg: Config, ctx: ParallelContext, run, cluster,
                    time_steps: Optional[Callable[[int], float]],
                    stage: Callable[[str], None]):
    """The profile ``plan=auto`` plans with, measured on the live cluster (collective):
    the collectives of ``ctx``'s groups on every rank, block compute on every rank at
    once (averaged, each rank's at speed 1.0) unless rank 0's DB holds this model and
    machine, and, with ``time_steps``, the host cost of communication calibrated by
    ``parallel.plan_calibration_steps`` real steps with every block at degree
    ``ctx.tp`` (``time_steps(n)``: their median; ``run`` is their shape). Rank 0 gets
    the Profile and writes it, with the calibration, to ``<out_dir>/profile.json``;
    the other ranks get None."""
    log = print if ctx.is_main else (lambda *_: None)
    stage("measuring collectives")
    comm = profile_comm(ctx, log=log)            # collective: every rank measures
    key = profile_key(ctx.device, ModelShape.from_config(cfg.model), run,
                      run_precision(cfg, ctx.device))
    cached = [ctx.is_main and key in load_db(default_db())]
    dist.broadcast_object_list(cached, src=0)
    stage("block compute: " + ("from the profile DB" if cached[0] else "measuring"))
    if cached[0]:
        prof = get_profile(cfg, run, ctx.device, default_db(), log=log) if ctx.is_main else None
    else:  # every rank measures at once; the figures are averaged over the ranks
        prof = get_profile(cfg, run, ctx.device, None, log=log, force=True, barrier=dist.barrier)
        prof = rank_mean(prof, ctx, own_speed(cfg, ctx.rank))
        if ctx.is_main:
            save_profile(cfg, run, ctx.device, default_db(), prof, log=log)
    n_cal = cfg.parallel.plan_calibration_steps if time_steps is not None else 0
    measured = None
    stage(f"calibrating: {n_cal} training steps (after 2 warm-up steps) with every block at "
          f"degree {ctx.tp}" if n_cal else "calibration: off")
    if n_cal:
        measured = time_steps(n_cal)
    if not ctx.is_main:
        return None
    profile = Profile(prof.blocks, prof.constant, comm)
    record = {"blocks": profile.blocks, "constant": profile.constant, "comm": comm}
    if measured is not None:
        ref = [ctx.tp] * 2 * cfg.model.n_layer
        profile, scale, before, after = calibrate_host_cost(
            ModelShape.from_config(cfg.model), run, cluster, profile, ref, measured)
        log(f"plan=auto: calibration: measured {1e3 * measured:.1f} ms/step at degree "
            f"{ctx.tp}, predicted {1e3 * before:.1f} ms; host cost of communication "
            f"x{scale:.2f} -> predicted {1e3 * after:.1f} ms")
        record["comm"] = profile.comm
        record["calibration"] = {"degrees": ref, "measured_s": measured,
                                 "predicted_before_s": before, "host_cost_scale": scale,
                                 "predicted_s": after, "steps": n_cal,
                                 "cpu_per_byte_profiled": comm.get("cpu_per_byte", {})}
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.out_dir) / "profile.json").write_text(json.dumps(record, indent=1))
    return profile


def this_cluster(cfg: Config, ctx: ParallelContext):
    """``parallel.cluster``'s file, or a uniform cluster of this run's devices (links
    then come from the measured collectives; only the memory matters)."""
    if cfg.parallel.cluster:
        return load_cluster(cfg.parallel.cluster)
    mem = (torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
           if ctx.device.type == "cuda" else 1e6)
    return Cluster("this-cluster", ctx.world_size, 1, mem, 1.0, 1.0)


def _auto(cfg: Config, ctx: ParallelContext,
          time_steps: Optional[StepTimer]) -> tuple[Config, list[int]]:
    log = print if ctx.is_main else (lambda *_: None)
    stage = stage_logger(log, 4)
    backend = backend_for(ctx.device, cfg.parallel.backend)
    cluster = for_backend(this_cluster(cfg, ctx), backend)  # what a communicator costs
    profile = measure_profile(cfg, ctx, run_shape(cfg), cluster,
                              (lambda n: time_steps(None, n)) if time_steps else None, stage)
    obj: list = [None]
    stage("solving")
    if ctx.is_main:
        try:
            limit_gib = cfg.parallel.memory_limit_gib or \
                cluster.plan_bytes_of(range(cfg.parallel.tp * cfg.dp)) / 2**30  # less headroom
            comm = (0.0, 0.0) if cfg.parallel.memory_limit_gib else \
                config_bytes(cfg, cluster, backend)  # the run's NCCL communicators
            solved = make_plan(cfg, cluster, profile, limit_gib * 2**30, comm=comm)
            # the paired schedule and sequence parallelism, each if predicted faster
            fb, sp = cfg.parallel.overlap_fb, cfg.parallel.sequence_parallel
            if _can_pair(cfg) and not fb:
                solved, fb = _faster(solved, paired_config(cfg), "overlap_fb", cluster,
                                     profile, limit_gib, log, comm)
            solved[0].predicted["overlap_fb"] = fb
            if not sp and cfg.model.seq_len % cfg.parallel.tp == 0 and cfg.parallel.tp > 1:
                # priced at the profiled sub-batches (the cost model's two, in step), so
                # chosen only where it wins even so; sub_batches=auto then runs it staggered
                solved, sp = _faster(solved, cfg.with_changes({
                    "parallel.sequence_parallel": True, "parallel.overlap_fb": fb,
                    "parallel.sub_batches": cfg.sub_batches}),
                    "sequence_parallel", cluster, profile, limit_gib, log, comm)
                solved[0].predicted["overlap_fb"] = fb
            n = cfg.sub_batches
            if cfg.parallel.sub_batches == "auto" and cfg.parallel.schedule == "oases":
                solved, n = planned_sub_batches(solved, cfg.with_changes({
                    "parallel.sequence_parallel": sp, "parallel.overlap_fb": fb}),
                    cluster, profile, limit_gib, log)
                solved[0].predicted["overlap_fb"] = fb
            plan, cm, uni = solved
            plan.sequence_parallel = sp
            report(plan, cm, uni)
            path = Path(cfg.out_dir) / "plan.yaml"
            plan.save(path)
            print(f"plan=auto: wrote {path}", flush=True)
            obj[0] = (plan.degrees, fb, sp, n)
        except UserError as e:
            obj[0] = e
    dist.broadcast_object_list(obj, src=0)
    if isinstance(obj[0], UserError):
        raise obj[0]
    degrees, fb, sp, n = obj[0]  # every rank runs what rank 0 chose
    if (fb, sp) != (cfg.parallel.overlap_fb, cfg.parallel.sequence_parallel):
        cfg = cfg.with_changes({"parallel.overlap_fb": fb, "parallel.sequence_parallel": sp})
    if cfg.parallel.sub_batches == "auto" and cfg.parallel.schedule == "oases":
        cfg = cfg.with_changes({"parallel.sub_batches": n})  # the count it was priced at
    return cfg, degrees


def planned_sub_batches(solved: tuple, cfg: Config, cluster, profile, limit_gib: float, log
                 ) -> tuple[tuple, int]:
    """``parallel.sub_batches=auto`` under plan=auto: ``solved`` (priced at
    ``cfg.sub_batches``, the profile's) or the plan solved at another count the micro-batch
    takes (1, 2, and 4 under sequence parallelism), whichever is predicted faster. The
    profile is rescaled to each count's rows (its blocks' fixed part paid per
    sub-batch: :func:`~oases.planner.stages.scale_profile`)."""
    base = run_shape(cfg)
    shape = ModelShape.from_config(cfg.model)
    best, n_best = solved, cfg.sub_batches
    tried = {n_best: solved[0].predicted["step_time_s"]}
    mbs = cfg.train.micro_batch_size
    for n in (1, 2, 4):
        if n in tried or mbs % n or (n == 4 and not cfg.parallel.sequence_parallel):
            continue
        other = cfg.with_changes({"parallel.sub_batches": n})
        prof = scale_profile(profile, base, run_shape(other), shape)
        alt = make_plan(other, cluster, prof, limit_gib * 2**30)
        tried[n] = alt[0].predicted["step_time_s"]
        if tried[n] < best[0].predicted["step_time_s"]:
            best, n_best = alt, n
    log(f"plan=auto: {n_best} sub-batch{'es' if n_best > 1 else ''} (predicted step "
        + ", ".join(f"{k}: {1e3 * v:.1f} ms" for k, v in sorted(tried.items())) + ")")
    return best, n_best


def _faster(solved: tuple, other: Config, switch: str, cluster, profile, limit_gib: float,
            log, comm: tuple = (0.0, 0.0)) -> tuple[tuple, bool]:
    """``solved`` (make_plan's answer) or the plan of ``other`` (the config with
    ``switch`` on), whichever is predicted faster, and whether the switch is on."""
    alt = make_plan(other, cluster, profile, limit_gib * 2**30, comm=comm)
    t0, t1 = solved[0].predicted["step_time_s"], alt[0].predicted["step_time_s"]
    log(f"plan=auto: {switch} {'on' if t1 < t0 else 'off'} (predicted step {1e3 * t1:.1f} "
        f"ms with it, {1e3 * t0:.1f} ms without)")
    return (alt, True) if t1 < t0 else (solved, False)


def paired_config(cfg: Config) -> Config:
    """A copy of ``cfg`` with ``parallel.overlap_fb`` on, validated for the same world."""
    return cfg.with_changes({"parallel.overlap_fb": True})


def _can_pair(cfg: Config) -> bool:
    """Whether ``parallel.overlap_fb`` could run: plan=auto then predicts both."""
    p = cfg.parallel
    return p.schedule == "oases" and p.pp == 1 and cfg.train.grad_accum >= 2


def stage_logger(log: Callable[[str], None], n: int) -> Callable[[str], None]:
    """``stage(what)`` logs ``plan=auto [i/n] what (Ts)``: plan=auto runs under torchrun,
    where progress is told in lines (:mod:`oases.progress`), and its stages can take
    minutes on a large model."""
    t0, done = time.perf_counter(), [0]

    def stage(what: str) -> None:
        done[0] += 1
        log(f"plan=auto [{done[0]}/{n}] {what} ({time.perf_counter() - t0:.0f}s)")

    return stage


def own_speed(cfg: Config, rank: int) -> float:
    """This rank's node speed in ``parallel.cluster`` (1.0 without a cluster file)."""
    if not cfg.parallel.cluster:
        return 1.0
    cluster = load_cluster(cfg.parallel.cluster)
    return cluster.speed_of([rank]) if rank < cluster.world else 1.0


def rank_mean(prof, ctx: ParallelContext, speed: float = 1.0):
    """The profile with every timing averaged over all ranks (same keys everywhere),
    each rank's first taken to a speed-1.0 device (times ``speed``, its node's): the
    cost model divides by the speed of the nodes a plan runs on, so a profile that
    kept a slow node's times would count its slowness twice."""
    keys = [(kind, t, ph) for kind in sorted(prof.blocks) for t in sorted(prof.blocks[kind])
            for ph in ("fwd", "bwd", "fwd2", "bwd2") if ph in prof.blocks[kind][t]]
    ckeys = [k for k in ("fwd", "bwd", "step", "head_fwd") if k in prof.constant]
    vals = torch.tensor([prof.blocks[k][t][ph] for k, t, ph in keys] +
                        [prof.constant[k] for k in ckeys], dtype=torch.float64, device=ctx.device)
    vals *= speed
    dist.all_reduce(vals)
    vals = (vals / ctx.world_size).tolist()
    blocks = {k: {t: dict(v) for t, v in d.items()} for k, d in prof.blocks.items()}
    for (k, t, ph), v in zip(keys, vals):
        blocks[k][t][ph] = v
    const = dict(prof.constant)
    for k, v in zip(ckeys, vals[len(keys):]):
        const[k] = v
    return Profile(blocks, const, prof.comm)
