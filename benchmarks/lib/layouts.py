"""The layouts the planner validation (``python -m benchmarks.planner_layouts``) measures:
the job every candidate runs and the candidates themselves (the search's pick, AMP's,
every uniform layout, random valid plans)."""

from __future__ import annotations

import random

from benchmarks.lib.driver import REPO
from oases.config import load_config
from oases.planner.search import candidate, megatron_plan

WORLD = 4
PROFILE_MBS = 8   # the profile's rows: profile_run(job, 4, 8) is the tp-4 run plan=auto profiles


def model_overrides(args) -> list[str]:
    """The job every candidate runs (its layout comes from the plan and run overrides)."""
    return ["model.name=gpt-tiny", f"model.d_model={args.d_model}",
            f"model.n_layer={args.n_layer}", f"model.n_head={args.n_head}",
            f"model.n_kv_heads={args.n_head}", f"model.ffn_hidden={4 * args.d_model}",
            f"model.seq_len={args.seq_len}", "parallel.schedule=oases",
            "parallel.recompute=fine", "parallel.device=cpu", "train.log_interval=1",
            "wandb.mode=disabled", "data.kind=synthetic", "data.val_path=", "eval.interval=0",
            "checkpoint.save_final=false", "checkpoint.interval=0", "resume=none"]


def job_config(args):
    """The validated config the search plans for: global batch ``--batch`` at pp 1,
    tp = world (its micro-batch only sets the profile's rows)."""
    ov = model_overrides(args) + [f"parallel.tp={WORLD}", "parallel.pp=1",
                                  f"train.micro_batch_size={PROFILE_MBS}",
                                  f"train.grad_accum={args.batch // PROFILE_MBS}"]
    return load_config(str(REPO / "configs/gpt-tiny.yaml"), ov).validate(WORLD)


def random_partition(rng: random.Random, L: int, pp: int) -> list[int]:
    """First layer of each of ``pp`` non-empty contiguous stages."""
    return [0] + sorted(rng.sample(range(1, L), pp - 1))


def candidates(problems, res_u, res_a, n_random: int, seed: int) -> tuple[dict, dict]:
    """(name -> Candidate, name -> other names of the same plan): the MILP's plan, AMP's
    pick, every uniform (pp, dp, tp) layout at its best micro-batch count, and
    ``n_random`` distinct random plans that fit; no plan twice (a random draw that
    repeats a plan is recorded as that plan's alias "random draw")."""
    out: dict = {}
    seen: set = set()
    aliases: dict = {}

    def add(name, cand):
        if cand is None:
            return
        if cand.key() in seen:  # the same plan under another name: say so
            first = next(n for n, c in out.items() if c.key() == cand.key())
            aliases.setdefault(first, []).append(name)
            return
        seen.add(cand.key())
        out[name] = cand

    add("milp", res_u.best)
    add("amp", res_a.amp)
    uniform: dict = {}
    for prob in problems:
        m = megatron_plan(prob)
        ch = prob.choice
        k = (ch.pp, ch.dp, ch.tp)
        if m is not None and (k not in uniform or m.time < uniform[k].time):
            uniform[k] = m
    for (pp, dp, tp), m in sorted(uniform.items()):
        add(f"uniform-pp{pp}-dp{dp}-tp{tp}", m)
    rng = random.Random(seed)
    for _ in range(1000):
        if sum(n.startswith("random") for n in out) >= n_random:
            break
        prob = rng.choice(problems)
        L = prob.inst.L
        starts = random_partition(rng, L, prob.choice.pp)
        strat = [rng.randrange(len(prob.choice.degrees)) for _ in range(L)]
        used = prob.memory(starts, strat)
        limits = [lim + k for lim, k in zip(prob.inst.memory_limit, prob.memory_const)]
        if any(u > lim for u, lim in zip(used, limits)):
            continue
        cand = candidate(prob, starts, strat, "random")
        add(f"random-{sum(n.startswith('random') for n in out) + 1}"
            if cand.key() not in seen else "random draw", cand)
    return out, aliases
