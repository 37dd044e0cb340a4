"""The config's checks of one layout dimension against the others (interleaving,
``overlap_fb``, context parallelism): each raises :class:`ConfigError` with one line
naming the keys. Called by :meth:`oases.config.schema.Config.validate`."""

from __future__ import annotations

from oases.errors import ConfigError

_NO_FUSED_PAIRS = {  # why overlap_fb finds no B, F pairs to fuse, by schedule
    "zb-h1": "its stages run a W (weight gradient), not a forward, after most Bs",
    "eager-zb-h1": "its stages run a W (weight gradient), not a forward, after most Bs",
    "interleaved-1f1b": "a B and the F after it run on different chunks (other layers)",
}


def interleaving_needs(pp: int, virtual: int, n_layer: int, micro_batches: int) -> None:
    """Megatron's virtual pipeline: pp x v equal stages, micro-batches in groups of pp."""
    if pp < 2:
        raise ConfigError(f"parallel.pp_virtual={virtual} needs parallel.pp >= 2, got {pp}")
    if n_layer % (pp * virtual):
        raise ConfigError(f"model.n_layer={n_layer} layers do not divide into parallel.pp="
                          f"{pp} x parallel.pp_virtual={virtual} equal stages")
    if micro_batches % pp:
        raise ConfigError(f"interleaved-1f1b runs micro-batches in groups of parallel.pp={pp} "
                          f"(Megatron's order): train.grad_accum={micro_batches} is not a "
                          f"multiple of {pp}")


def overlap_fb_needs(pp: int, micro_batches: int, kind: str) -> None:
    """A backward pairs with the next micro-batch's forward: at pp=1 there must be two
    micro-batches; in a pipeline the pairs must not wait on each other across stages,
    which takes eager-1f1b's warm-up (python -m oases.schedule --overlap-fb shows why)."""
    if pp == 1 and micro_batches < 2:
        raise ConfigError("parallel.overlap_fb pairs a micro-batch's backward with the next "
                          "one's forward: it needs train.grad_accum >= 2")
    if pp > 1 and kind in _NO_FUSED_PAIRS:
        raise ConfigError(f"parallel.overlap_fb cannot run with parallel.pp_schedule={kind}: "
                          f"{_NO_FUSED_PAIRS[kind]}")
    if pp > 1 and kind != "eager-1f1b":
        raise ConfigError(f"parallel.overlap_fb in a pipeline needs parallel.pp_schedule="
                          f"eager-1f1b, not {kind}: under 1f1b each fused pair waits for the "
                          f"next stage's whole pair, which halves the rate")


def cp_needs(cfg, cp: int | None = None) -> None:
    """Context parallelism (``parallel.cp`` > 1, docs/context-parallel.md): each cp rank
    holds two head-tail chunks of every sequence, and what the ring does not take is
    refused here, before any process group exists (the model refuses the same pairs).
    ``cp``: the degree to check (default ``parallel.cp``): the layout search asks which
    degrees it may price (oases.planner.stages.job_from_config)."""
    par, m = cfg.parallel, cfg.model
    cp = par.cp if cp is None else cp
    pair = f"parallel.cp={cp}"
    if m.seq_len % (2 * cp):
        raise ConfigError(f"{pair} splits each sequence into 2 x cp = {2 * cp} equal chunks: "
                          f"model.seq_len={m.seq_len} does not divide by {2 * cp}")
    refused = [(par.compile == "strict", "parallel.compile=strict: the ring's point-to-point "
                                         "exchanges break the attention region's graph"),
               (bool(m.sliding_window) and m.sliding_window < m.seq_len,
                f"model.sliding_window={m.sliding_window}: ring attention has no window"),
               # the layout search prices cp and writes plans that run it (one degree per
               # stage, even stages); tp-only chooses per-block degrees, which do not
               (par.plan == "auto" and par.plan_search == "tp-only",
                "parallel.plan=auto and parallel.plan_search=tp-only: per-block TP degrees "
                "do not run under cp (plan_search=uniap or amp chooses cp with the layout)")]
    for bad, why in refused:
        if bad:
            raise ConfigError(f"{pair} with {why}")
