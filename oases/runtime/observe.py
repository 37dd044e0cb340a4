"""What a run tells its watchers about itself: the resolved layout in the logged config,
the W&B group name, and the clock of its TP communication (docs/observability.md)."""

from __future__ import annotations

from typing import Optional

from oases.config import Config
from oases.overlap.comm_clock import CommClock
from oases.parallel.comm import group_size
from oases.parallel.groups import ParallelContext


def layout_name(cfg: Config, ctx: ParallelContext) -> str:
    """``pp2-dp2-tp2-oases-fine``: runs of one layout and schedule group together."""
    par = cfg.parallel
    pp = f"pp{ctx.pp}-" if ctx.pp > 1 else ""
    cp = f"cp{par.cp}-" if par.cp > 1 else ""
    return f"{pp}dp{cfg.dp}-{cp}tp{par.tp}-{par.schedule}-{par.recompute}"


def run_config(cfg: Config, ctx: ParallelContext, n_params: int, flops_per_token: float,
               degrees: Optional[list[int]]) -> dict:
    """The config as logged (W&B ``config``): every section, and under ``run`` what the
    run resolved: world, dp, pp, tp, ZeRO level, parameters, FLOPs per token, the plan's
    per-block degrees and the pipeline's stages."""
    d = cfg.to_dict()
    d["run"] = {"world": ctx.world_size, "dp": cfg.dp, "pp": ctx.pp, "cp": ctx.cp,
                "tp": cfg.parallel.tp,
                "zero": cfg.parallel.zero, "params": n_params,
                "flops_per_token": flops_per_token, "layout": layout_name(cfg, ctx),
                "plan": {"degrees": degrees,
                         "stages": ctx.layout.describe() if ctx.layout is not None else None}}
    return d


def comm_clock_for(model, ctx: ParallelContext) -> Optional[CommClock]:
    """The clock of this rank's TP collectives (every TP group its model's modules
    hold), or None when they are all over one rank."""
    groups = [ctx.tp_group] + [getattr(m, "tp_group", None) for m in model.modules()]
    groups = [g for g in groups if g is not None and group_size(g) > 1]
    return CommClock(ctx.device, groups) if groups else None
