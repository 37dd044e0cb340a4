"""``python -m oases.plan``: choose a TP degree for every block.

    python -m oases.plan --config configs/gpt.yaml --cluster configs/cluster/two-nodes-1g.yaml \\
        [--profile DB] [--memory-gib G] --out plan.yaml [key.sub=value ...]

Profiles the model's blocks on this machine (or reuses the profile DB), builds
the overlap-aware cost model with the cluster file's links, solves the ILP and
writes the plan (YAML) and a PNG of the degree per block next to it. Prints
the per-block table, the predicted step time and memory, and the best uniform
plan for comparison. Bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from oases.errors import EXIT_USER_ERROR, UserError


def plot_degrees(degrees: list[int], kinds: list[str], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(degrees) + 2), 3))
    colors = ["tab:blue" if k == "attn" else "tab:orange" for k in kinds]
    ax.bar(range(len(degrees)), degrees, color=colors)
    ax.set_xlabel("block (blue: attention, orange: MLP)")
    ax.set_ylabel("TP degree")
    ax.set_yscale("log", base=2)
    ax.set_yticks(sorted(set(degrees)), [str(d) for d in sorted(set(degrees))])
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_plan(cfg, cluster, profile, memory_limit_bytes, log=print):
    """Solve for ``cfg`` (validated) on ``cluster``; returns (Plan, CostModel, uniform)."""
    from oases.planner import ilp
    from oases.planner.cost import CostModel, ModelShape, RunShape
    from oases.planner.plan import Plan, model_dict

    run = run_shape(cfg)
    cm = CostModel(ModelShape.from_config(cfg.model), run, cluster, profile)
    sol = ilp.solve(cm, memory_limit_bytes)
    uni = ilp.best_uniform(cm, memory_limit_bytes)
    plan = Plan(degrees=sol.degrees, tp=run.tp, model=model_dict(cfg.model),
                schedule=run.schedule, recompute=run.recompute,
                micro_batch_size=run.micro_batch_size, sub_batches=run.sub_batches,
                cluster=cluster.name,
                predicted={"step_time_s": sol.time_s, "memory_gib": sol.memory_bytes / 2**30,
                           "memory_limit_gib": (memory_limit_bytes or 0) / 2**30,
                           "solver": sol.solver, "solve_s": sol.solve_s,
                           "best_uniform": None if uni is None else
                           {"degree": uni.degrees[0], "step_time_s": uni.time_s,
                            "memory_gib": uni.memory_bytes / 2**30},
                           "blocks": cm.block_table(sol.degrees)})
    return plan, cm, uni


def run_shape(cfg):
    from oases.planner.cost import RunShape

    p = cfg.parallel
    return RunShape(tp=p.tp, dp=cfg.dp, micro_batch_size=cfg.train.micro_batch_size,
                    grad_accum=cfg.train.grad_accum, sub_batches=p.sub_batches,
                    schedule=p.schedule, recompute=p.recompute,
                    act_bytes=2 if cfg.train.precision == "bf16" else 4,
                    overlap_fb=p.overlap_fb)


def report(plan, cm, uni, log=print) -> None:
    from oases.planner.plan import fmt_table

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m oases.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--profile", help="profile DB (JSON); default ~/.cache/oases/profile_db.json")
    ap.add_argument("--memory-gib", type=float, help="memory per device (default: cluster file)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reprofile", action="store_true", help="measure even if the DB has it")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    try:
        import torch

        from oases.config import load_config
        from oases.planner.cluster import load_cluster
        from oases.planner.profile import DEFAULT_DB, get_profile

        cluster = load_cluster(args.cluster)
        cfg = load_config(args.config, args.overrides).validate(cluster.world)
        out = Path(args.out)
        if out.exists() and out.is_dir():
            raise UserError(f"--out {out} is a directory")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        db = Path(args.profile) if args.profile else DEFAULT_DB
        prof = get_profile(cfg, run_shape(cfg), device, db, force=args.reprofile)
        limit = (args.memory_gib * 2**30 if args.memory_gib else  # the run's smallest device
                 cluster.memory_bytes_of(range(cfg.parallel.tp * cfg.dp)))
        plan, cm, uni = make_plan(cfg, cluster, prof, limit)
        report(plan, cm, uni)
        out.parent.mkdir(parents=True, exist_ok=True)
        plan.save(out)
        png = out.with_suffix(".png")
        drawn = plot_degrees(plan.degrees, cm.kinds, png,
                             f"{cfg.model.name} on {cluster.name}: TP degree per block")
        print(f"wrote {out}" + (f" and {png}" if drawn else " (matplotlib missing: no PNG)"))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
