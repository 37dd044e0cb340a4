"""Bytes on the links per training step, fp32 against bf16, with the bf16 wire and without.

    .venv/bin/python -m benchmarks.wire_bytes [--steps 1] [key=value ...]

Each case spawns its world of local gloo ranks (no root, no cluster) and runs one real
``train_step`` per precision through the runtime, counting every collective and every
pipeline message by kind (:class:`oases.parallel.comm.CommCounter`: ``all_gather``,
``reduce_scatter``, ``all_reduce``; the cross-mesh transfers' ``send`` and ``fan_out``).
Figures are bytes per step summed over the world's ranks (each rank counts what it
sends or contributes; ``send`` is what crosses the stage boundaries). Three precisions:

* ``fp32``: no autocast;
* ``bf16 before``: bf16 autocast with the wire forced to each tensor's own dtype: the
  pipeline's sends in the parameters' dtype and the sequence-parallel gathers of the
  norm outputs in fp32, which is what oases sent before the wire dtype
  (tests/test_sequence_parallel.py checks the forward equals it bit for bit);
* ``bf16``: bf16 autocast, the wire dtype (:mod:`oases.parallel.wire`).

Bytes do not depend on the machine's speed or load. Writes
benchmarks/results/wire_bytes.{md,json}.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.driver import report_head
from benchmarks.lib.ranks import init_gloo, spawn_ranks, write_result

PRECISIONS = ("fp32", "bf16 before", "bf16")
KINDS = ("send", "fan_out", "all_gather", "reduce_scatter", "all_reduce")
# (name, world, overrides, plan stages or None)
CASES = [
    ("tp2, SP, megatron", 2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                              "parallel.schedule=megatron", "parallel.recompute=full"], None),
    ("tp2, SP, oases", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"], None),
    ("pp2 x dp2", 4, ["parallel.pp=2"], None),
    ("pp2 x tp2, SP", 4, ["parallel.pp=2", "parallel.tp=2",
                          "parallel.sequence_parallel=true"], None),
    ("pp2: tp2, then dp2 (fan-out)", 4, ["parallel.pp=2"],
     [{"layers": [0, 1], "dp": 1, "tp": 2}, {"layers": [1, 2], "dp": 2, "tp": 1}]),
]


def _plain_wire():
    """The wire forced to each tensor's own dtype (the code before the wire dtype)."""
    from unittest import mock  # deferred: the "bf16 before" precision only

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("oases.pipeline.runner.wire_dtype",
                                   lambda amp, device, local: local))
    for where in ("oases.parallel.sequence", "oases.overlap.sequence"):
        stack.enter_context(mock.patch(f"{where}.to_wire", lambda x: x))
    return stack


def _worker(rank: int, world: int, store: str, overrides: list, stages, steps: int,
            out: str) -> None:
    init_gloo(rank, world, store)
    import torch  # deferred: the parent only spawns

    from oases.config import load_config
    from oases.parallel.comm import CommCounter
    from oases.parallel.groups import build_pipeline_context, build_context
    from oases.parallel.layout import stages_layout, uniform_layout
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches
    from oases.runtime.step import train_step

    res = {}
    for precision in PRECISIONS:
        cfg = load_config(None, [*overrides, "train.precision=" + precision.split()[0]]
                          ).validate(world)
        par = cfg.parallel
        if par.pp > 1:
            layout = (stages_layout(stages, world, cfg.model.n_layer, "wire_bytes",
                                    cfg.pipeline_batch) if stages else
                      uniform_layout(world, par.pp, par.tp, cfg.model.n_layer))
            ctx = build_pipeline_context(layout, torch.device("cpu"),
                                         bool(cfg.model.tie_embeddings))
        else:
            ctx = build_context(par.tp, torch.device("cpu"))
        tracker = seed_tracker(cfg, ctx)
        model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
        ts = build_train_state(cfg, ctx, model, tracker)
        batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                               cfg.pipeline_batch // ctx.dp, ctx.dp_rank, ctx.dp, cfg.seed)
        with (_plain_wire() if precision == "bf16 before" else contextlib.nullcontext()), \
                CommCounter() as counter:
            for _ in range(steps):
                loss, _ = train_step(ts, batches, cfg.train.lr)
        res[precision] = {"bytes": {k: counter.bytes[k] / steps for k in KINDS},
                          "loss": loss}
    write_result(out, rank, res)


def _sp_embedding(overrides: list) -> dict:
    """Under SP, the embedding's fp32 collective bytes per step summed over the ranks of
    the first stage (dp 1 in these cases): its partial sums' reduce-scatter, B T d x 4
    bytes per micro-batch and rank, and its gradient's all-gather, 1/tp of that."""
    from oases.config import load_config  # deferred: the parent stays light until here

    cfg = load_config(None, overrides)
    par, m = cfg.parallel, cfg.model
    if not par.sequence_parallel:
        return {}
    rs = par.tp * cfg.train.grad_accum * cfg.train.micro_batch_size * m.seq_len * m.d_model * 4
    return {"reduce_scatter": rs, "all_gather": rs / par.tp}


def _common(data: dict) -> list:
    """The overrides every case shares (the model and the run; a row names the rest)."""
    sets = [per["overrides"] for per in data["cases"].values()]
    return [o for o in sets[0] if all(o in s for s in sets)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def render(out: Path, data: dict) -> None:
    lines = [*report_head("# Bytes on the links per step: fp32, and bf16 before and after "
                          "the wire dtype", data),
             f"Settings of every case: {' '.join(_common(data))}; {data['steps']} step(s). "
             "MiB per training step, summed over the ranks "
             "(each rank counts what it sends or contributes to a collective; `send`: "
             "the pipeline messages, which cross the stage boundaries, `fan_out`: the "
             "receiving replica's broadcasts of them). `bf16 before`: the wire forced to "
             "each tensor's own dtype, as oases sent before the wire dtype.", "",
             "| case | kind | fp32 | bf16 before | bf16 | bf16 / fp32 | bf16 / before | "
             "bf16 / fp32, less the embedding's |",
             "|---|---|---|---|---|---|---|---|"]
    for name, per in data["cases"].items():
        for kind in KINDS:
            f32, old, new = (per[p]["bytes"][kind] for p in PRECISIONS)
            if not f32:
                continue
            emb = per["embedding"].get(kind)
            less = f"{(new - emb) / (f32 - emb):.3f}" if emb else ""
            lines.append(f"| {name} | {kind} | {_mib(f32)} | {_mib(old)} | {_mib(new)} | "
                         f"{new / f32:.3f} | {new / old:.3f} | {less} |")
    lines += ["", "Pipeline messages and fan-outs move exactly half of fp32's bytes under "
              "bf16 (before: the same as fp32). So do the sequence-parallel all-gathers and "
              "reduce-scatters, but for the embedding's: its partial sums enter the fp32 "
              "residual stream, so its reduce-scatter and its gradient's all-gather stay "
              "fp32 (the last column leaves them out: B T d x 4 bytes per micro-batch and "
              "rank, and 1/tp of that). The all-reduces (the loss's statistics, the "
              "blocks' partial sums without SP, already bf16 under autocast, and the fp32 "
              "gradients' data-parallel reduction) are the same with the wire and without.",
              ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = driver.parser(__doc__)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="key=value for every case")
    driver.report_flags(ap, "wire_bytes")
    args = ap.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, _derive, out=args.out)
    from benchmarks.lib.machine import machine_info  # deferred: the report only

    base = ["model.name=gpt-tiny", "model.d_model=512", "model.n_layer=2", "model.n_head=8",
            "model.n_kv_heads=8", "model.ffn_hidden=2048", "model.seq_len=128",
            "model.vocab_size=256", "model.dropout=0.0", "train.micro_batch_size=8",
            "train.grad_accum=4", "data.kind=synthetic", "wandb.mode=disabled",
            "parallel.schedule=oases", "parallel.recompute=fine", *args.overrides]
    t0 = time.time()
    cases = {}
    for name, world, over, stages in CASES:
        print(f"{name}: {world} ranks, {', '.join(PRECISIONS)} ...", flush=True)
        ranks = spawn_ranks(_worker, world, [*base, *over], stages, args.steps)
        cases[name] = {p: {"bytes": {k: sum(r[p]["bytes"][k] for r in ranks) for k in KINDS},
                           "loss": [r[p]["loss"] for r in ranks]} for p in PRECISIONS}
        cases[name]["overrides"] = [*base, *over]
    data = {"machine": machine_info(), "command": driver.command("benchmarks.wire_bytes", argv),
            "elapsed_min": (time.time() - t0) / 60, "steps": args.steps, "cases": cases}
    driver.save(driver.out_prefix(args, "wire_bytes"), _derive(data), render)
    return 0


def _derive(data: dict) -> dict:
    """The figures a report derives from its runs' settings (the embedding's bytes)."""
    for per in data["cases"].values():
        per["embedding"] = _sp_embedding(per["overrides"])
    return data


if __name__ == "__main__":
    raise SystemExit(main())
