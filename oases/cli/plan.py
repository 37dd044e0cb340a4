"""``python -m oases.plan``: choose the parallel layout of a run.

    python -m oases.plan --config configs/gpt.yaml --cluster configs/cluster/two-nodes-1g.yaml \\
        [--search uniap|amp|tp-only] [--trials K] [--profile DB] [--memory-gib G] \\
        [--time-budget S] [--gap G] [--max-tp T] --out plan.yaml [key.sub=value ...]

``--search uniap`` (default) and ``amp`` search pipelined layouts: every
(pp, dp x tp, micro-batch count) of the cluster's devices that runs the config's
global batch (:mod:`oases.planner.stages`), each priced by the overlap-aware cost
model on its stages' own links. ``amp`` gives every layer one degree and cuts the
stages optimally (AMP); ``uniap`` also lets each layer take its own degree and
placement (one MILP per layout, ``--time-budget`` seconds in all;
:mod:`oases.planner.search`). ``tp-only`` keeps the config's layout (pp = 1, its
tp) and chooses a degree per block with the ILP (:mod:`oases.planner.ilp`).

Profiles the model's blocks on this machine (or reuses the profile DB), prints
the chosen layout (stages, layer ranges, dp x tp, degrees, micro-batches,
predicted time per iteration and memory per stage), the best uniform layout and
AMP's pick, and writes the plan (YAML), a PNG next to it and, with ``--trials K``,
the next best plans (``plan-2.yaml`` ...). Bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from oases.config import load_config
from oases.errors import EXIT_USER_ERROR, ConfigError, UserError
from oases.parallel.groups import backend_for
from oases.planner import report as rep
from oases.planner.api import make_plan, report, run_shape
from oases.planner.cluster import load_cluster
from oases.planner.comm_memory import config_bytes, for_backend
from oases.planner.figures import plot_degrees, plot_stages
from oases.planner.profile import default_db, get_profile
from oases.planner.search import choosable, search
from oases.planner.stages import enumerate_choices, job_from_config, profile_run

SEARCHES = ("uniap", "amp", "tp-only")
# overrides the plan's own run replaces (printed with the plan's values)
RUN_KEYS = ("parallel.pp", "parallel.tp", "parallel.cp", "parallel.pp_schedule",
            "parallel.pp_virtual", "train.micro_batch_size", "train.grad_accum",
            "parallel.plan")


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m oases.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--search", choices=SEARCHES, default="uniap",
                    help="uniap: pipelined layouts, a degree per layer (default); amp: "
                         "pipelined layouts, one degree for all layers; tp-only: the config's "
                         "layout, a degree per block")
    ap.add_argument("--trials", type=int, default=1,
                    help="write the K best plans (plan.yaml, plan-2.yaml, ...)")
    ap.add_argument("--profile", help="profile DB (JSON); default ~/.cache/oases/profile_db.json")
    ap.add_argument("--memory-gib", type=float,
                    help="memory a plan may use per device (default: the cluster file's, "
                         "less a headroom)")
    ap.add_argument("--time-budget", type=float, default=6.0,
                    help="seconds of MILP solving for the whole uniap search (default 6)")
    ap.add_argument("--gap", type=float, default=0.01,
                    help="relative optimality gap at which a MILP stops (default 0.01)")
    ap.add_argument("--max-tp", type=int, help="largest tp a layout may have (default: any)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reprofile", action="store_true", help="measure even if the DB has it")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    for name, ok in (("trials", args.trials >= 1), ("time_budget", args.time_budget > 0),
                     ("gap", 0 <= args.gap < 1),
                     ("memory_gib", args.memory_gib is None or args.memory_gib > 0),
                     ("max_tp", args.max_tp is None or args.max_tp >= 1)):
        if not ok:
            raise UserError(f"--{name.replace('_', '-')}={getattr(args, name)} is out of range")
    return args


def main(argv=None) -> int:
    try:
        args = _args(argv)

        cluster = load_cluster(args.cluster)
        cfg = load_config(args.config, args.overrides).validate(cluster.world)
        out = Path(args.out)
        if out.exists() and out.is_dir():
            raise UserError(f"--out {out} is a directory")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        backend = backend_for(device, cfg.parallel.backend)
        cluster = for_backend(cluster, backend)  # what a communicator costs the run
        db = Path(args.profile) if args.profile else default_db()
        if args.search == "tp-only":
            _tp_only(args, cfg, cluster, device, db, out, backend)
        else:
            _layouts(args, cfg, cluster, device, db, out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def _tp_only(args, cfg, cluster, device, db, out: Path, backend: str) -> None:
    """The config's layout (pp = 1, its tp), one degree per block."""
    if cfg.parallel.pp > 1:
        raise ConfigError(f"--search tp-only plans per-block degrees at pp = 1; this config has "
                          f"parallel.pp={cfg.parallel.pp} (use --search uniap or amp)")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"--search tp-only plans per-block degrees, which do not run under "
                          f"context parallelism; this config has parallel.cp={cfg.parallel.cp} "
                          f"(use --search uniap or amp)")
    prof = get_profile(cfg, run_shape(cfg), device, db, force=args.reprofile)
    limit = (args.memory_gib * 2**30 if args.memory_gib else  # the run's smallest device,
             cluster.plan_bytes_of(range(cfg.parallel.tp * cfg.dp)))  # less the headroom
    comm = (0.0, 0.0) if args.memory_gib else config_bytes(cfg, cluster, backend)
    plan, cm, uni = make_plan(cfg, cluster, prof, limit, comm=comm)
    report(plan, cm, uni)
    out.parent.mkdir(parents=True, exist_ok=True)
    plan.save(out)
    png = out.with_suffix(".png")
    drawn = plot_degrees(plan.degrees, cm.kinds, png,
                         f"{cfg.model.name} on {cluster.name}: TP degree per block")
    print(f"wrote {out}" + (f" and {png}" if drawn else " (matplotlib missing: no PNG)"))


def _layouts(args, cfg, cluster, device, db, out: Path) -> None:
    """Pipelined layouts (``--search uniap|amp``): profile, search, print, write."""
    job = job_from_config(cfg, cluster.devices_per_node)
    choices = enumerate_choices(job, cluster.world, args.max_tp)
    if not choices:
        raise ConfigError(f"no (pp, dp x tp, micro-batches) layout of the {cluster.world} "
                          f"devices of {cluster.name} runs the global batch of "
                          f"{job.global_batch} sequences")
    # one profile for every layout: degrees up to the largest tp (stages.scale_profile)
    base = profile_run(job, max(ch.tp for ch in choices), cfg.train.micro_batch_size)
    prof = get_profile(cfg, base, device, db, force=args.reprofile)
    limit = args.memory_gib * 2**30 if args.memory_gib else None
    res = search(job, cluster.world, cluster, prof, base, args.search, args.time_budget,
                 args.gap, memory_limit=limit, schedules=choosable(cfg.parallel.overlap_fb))
    best = res.best
    for line in rep.summary(res, best):
        print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for k, cand in enumerate(res.ranked[:args.trials]):
        path = out if k == 0 else out.with_name(f"{out.stem}-{k + 1}{out.suffix}")
        rep.to_plan(cand, res, cfg, cluster.name).save(path)
        written.append(path)
        if k:
            print(f"plan {k + 1}: {cand.describe()}: {1e3 * cand.time:.1f} ms per iteration")
    png = out.with_suffix(".png")
    drawn = plot_stages(best.stages(), png, f"{cfg.model.name} on {cluster.name}: "
                        f"{1e3 * best.time:.1f} ms per iteration (predicted)")
    print(f"wrote {', '.join(map(str, written))}"
          + (f" and {png}" if drawn else " (matplotlib missing: no PNG)"))
    keep = [o for o in args.overrides if o.split("=", 1)[0].strip() not in RUN_KEYS]
    print(f"run it: torchrun --nnodes {cluster.nodes} --nproc-per-node "
          f"{cluster.devices_per_node} train.py --config {args.config} parallel.plan={out} "
          + " ".join(rep.run_overrides(best) + keep))


if __name__ == "__main__":
    sys.exit(main())
