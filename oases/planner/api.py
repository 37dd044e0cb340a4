"""The planner's one-call entry: price a config's blocks on a cluster and solve for a
TP degree per block (the pp = 1 ILP, :mod:`oases.planner.ilp`).

``make_plan`` is what ``python -m oases.plan --search tp-only`` and ``parallel.plan=auto``
both call; ``run_shape`` turns a validated config into the cost model's run description;
``report`` prints a plan's table and its comparison with the best uniform plan."""

from __future__ import annotations

from oases.errors import ConfigError
from oases.planner import ilp
from oases.planner.cost import CostModel, ModelShape, RunShape
from oases.planner.plan_file import Plan, fmt_table, model_dict
from oases.planner.profile import run_precision
from oases.config.schema import BF16_PRECISIONS


def make_plan(cfg, cluster, profile, memory_limit_bytes, log=print, comm=(0.0, 0.0)):
    """Solve for ``cfg`` (validated) on ``cluster``; returns (Plan, CostModel, uniform).
    ``comm``: (communicator memory of the run at tp, what per-block degrees below tp add:
    :func:`oases.planner.comm_memory.pp1_bytes`), charged against the limit."""

    if cfg.parallel.cp > 1:  # the ring runs every block at tp (models.parallelize refuses)
        raise ConfigError(f"per-block TP degrees (--search tp-only) do not run under "
                          f"parallel.cp={cfg.parallel.cp}: search the layout (uniap or amp), "
                          f"which chooses cp with it")
    run = run_shape(cfg)
    shape = ModelShape.from_config(cfg.model)
    # the degrees the profile has (the profiler skips those whose batch parts would not
    # hold whole sequences: they cannot run either) and whose parts of this run's
    # sub-batches are whole sequences
    degrees = [t for t in shape.valid_degrees(run.tp)
               if all(str(t) in profile.blocks.get(k, {}) for k in ("attn", "mlp"))
               and (run.micro_batch_size / run.sub_batches * t / run.tp).is_integer()]
    cm = CostModel(shape, run, cluster, profile, degrees)
    limit = None if memory_limit_bytes is None else memory_limit_bytes - comm[0]
    sol = ilp.solve(cm, limit, mixed=comm[1])
    uni = ilp.best_uniform(cm, limit, mixed=comm[1])
    held = comm[0] + (comm[1] if set(sol.degrees) != {run.tp} else 0.0)  # communicators
    plan = Plan(degrees=sol.degrees, tp=run.tp, model=model_dict(cfg.model),
                schedule=run.schedule, recompute=run.recompute,
                micro_batch_size=run.micro_batch_size, sub_batches=run.sub_batches,
                cluster=cluster.name,
                predicted={"step_time_s": sol.time_s, "memory_gib": sol.memory_bytes / 2**30,
                           "memory_limit_gib": (memory_limit_bytes or 0) / 2**30,
                           "communicators_gib": held / 2**30,
                           "solver": sol.solver, "solve_s": sol.solve_s,
                           "best_uniform": None if uni is None else
                           {"degree": uni.degrees[0], "step_time_s": uni.time_s,
                            "memory_gib": uni.memory_bytes / 2**30},
                           "blocks": cm.block_table(sol.degrees)})
    return plan, cm, uni


def run_shape(cfg):

    p = cfg.parallel
    # dp: every replica of the parameters (cp's ranks too: the gradients sum over them)
    return RunShape(tp=p.tp, dp=cfg.dp * p.cp, cp=p.cp,
                    micro_batch_size=cfg.train.micro_batch_size,
                    grad_accum=cfg.train.grad_accum, sub_batches=cfg.sub_batches,
                    schedule=p.schedule, recompute=p.recompute,
                    act_bytes=2 if run_precision(cfg) in BF16_PRECISIONS else 4,
                    overlap_fb=p.overlap_fb, sequence_parallel=p.sequence_parallel,
                    grad_reduce_bytes=2 if p.grad_reduce_dtype == "bf16" else 4,
                    zero=p.zero if cfg.dp * p.cp > 1 else 0,
                    weight_bytes=2 if run_precision(cfg) == "bf16" else 4,
                    residual_bytes=2 if run_precision(cfg) == "bf16" else 4)


def report(plan, cm, uni, log=print) -> None:

    log(fmt_table(plan.predicted["blocks"]))
    pred = plan.predicted
    log(f"plan {plan.degrees}: predicted step {1e3 * pred['step_time_s']:.1f} ms, "
        f"memory {pred['memory_gib']:.3f} GiB per device ({pred['solver']}, "
        f"{1e3 * pred['solve_s']:.0f} ms)")
    if uni is None:
        log("no uniform plan fits the memory limit")
    else:
        log(f"best uniform plan: degree {uni.degrees[0]}: predicted step {1e3 * uni.time_s:.1f} ms, "
            f"memory {uni.memory_bytes / 2**30:.3f} GiB ({uni.time_s / pred['step_time_s']:.2f}x "
            f"the plan's time)")
