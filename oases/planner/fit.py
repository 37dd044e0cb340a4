"""Profiles the planner did not measure: FLOP-count estimates (:func:`analytic_profile`,
for tests and a first look) and the host cost of communication fitted to real steps
(:func:`calibrate_host_cost`, ``parallel.plan=auto``'s calibration). Pure Python."""

from __future__ import annotations

from oases.planner.cost import PARAM_BYTES, CostModel, ModelShape, Profile, RunShape


def analytic_profile(shape: ModelShape, run: RunShape, degrees: list[int],
                     flops_per_s: float = 50e9) -> Profile:
    """A profile from FLOP counts at a given throughput (for tests and a first look;
    the real planner measures). Saved bytes follow Korthikanti et al., plus the
    weight matrices once, as the profiler's measurement holds them."""
    blocks: dict = {"attn": {}, "mlp": {}}
    s, d = shape.seq_len, shape.d_model
    for t in degrees:
        rows = run.micro_batch_size / run.sub_batches * t / run.tp
        for kind in ("attn", "mlp"):
            p = shape.rank_params(kind, t)  # replicated kv heads are computed on each replica
            flops = 2 * rows * s * p
            if kind == "attn":
                flops += 4 * rows * s * s * d / t
            saved = rows * s * d * run.act_bytes * (5 if kind == "attn" else 6) + \
                (rows * shape.n_head / t * s * s * 4 if kind == "attn" else 0) + \
                run.act_bytes * shape.matrix_params(kind) / t + PARAM_BYTES * shape.norm_params(kind)
            blocks[kind][str(t)] = {"fwd": flops / flops_per_s, "bwd": 2 * flops / flops_per_s,
                                    "saved": saved}
    head = 2 * run.micro_batch_size * s * shape.vocab_size * d / run.tp
    return Profile(blocks, {"fwd": head / flops_per_s, "bwd": 2 * head / flops_per_s,
                            "step": 0.0, "peak": 3 * run.micro_batch_size * s *
                            shape.vocab_size / run.tp * 4})

def calibrate_host_cost(shape: ModelShape, run: RunShape, cluster, profile: Profile,
                        degrees: list[int], measured_s: float,
                        max_scale: float = 50.0) -> tuple[Profile, float, float, float]:
    """Fit the host cost of communication to one measured step time.

    The profiler's ``cpu_per_byte`` comes from an isolated measurement; in a real step
    communication can cost the host more (on an oversubscribed host every collective
    also waits for the rank the scheduler left behind) or less. The predicted step
    time is linear in that cost, so one real step of ``degrees`` (a uniform plan: the
    most collectives) fixes a scale for it, clamped to [0, ``max_scale``]. The scale
    applies to the activation collectives the step ran (TP all-reduces, reshard
    all-gathers); the gradient syncs keep the profiled figure. Returns the profile with
    the scaled cost, the scale, and the predictions before and after scaling. Without a
    host cost (e.g. GPUs) there is nothing to scale: the profile comes back as is."""
    cpb = profile.comm.get("cpu_per_byte", {})

    def predict(scale: float) -> tuple[Profile, float]:
        comm = dict(profile.comm)
        comm.setdefault("cpu_per_byte_sync", dict(cpb))
        comm["cpu_per_byte"] = {k: v * scale for k, v in cpb.items()}
        p = Profile(profile.blocks, profile.constant, comm)
        return p, CostModel(shape, run, cluster, p).plan_time(degrees)

    before = predict(1.0)[1]
    if not any(v > 0 for v in cpb.values()):
        return profile, 1.0, before, before
    t0 = predict(0.0)[1]
    slope = before - t0
    scale = min(max((measured_s - t0) / slope, 0.0), max_scale) if slope > 0 else 1.0
    calibrated, after = predict(scale)
    return calibrated, scale, before, after
