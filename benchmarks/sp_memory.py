"""Saved activation bytes per rank with sequence parallelism against without (CPU, gloo).

    .venv/bin/python -m benchmarks.sp_memory [--tp 2 4] [--dropout 0.1] [key=value ...]
    .venv/bin/python -m benchmarks.sp_memory --tp 1 --out /tmp/recompute   # each recompute mode

For each TP degree, ``tp`` local ranks run one micro-batch's forward and backward per
(engine, recompute) mode, with and without ``parallel.sequence_parallel``, and report
what autograd and the engine's stash keep from forward to backward on rank 0
(:class:`oases.overlap.memory.SavedTensorMeter`, parameters excluded). The default
shape is the overlap benchmark's (GPT d 512, 2 layers, 8 heads, seq 128, micro-batch 8).
Bytes do not depend on the machine's load. Writes benchmarks/results/sp_memory.{md,json}.

What SP shrinks by tp: the norms' inputs, the dropout masks and the residual stream
(Korthikanti et al.: 10 of the 34 s b h bytes per layer without SP, fp16 terms). What
it does not: the inputs of the column-parallel matmuls (the gathered sequence, which
their weight gradients need; Megatron-LM re-gathers them in backward instead, which
costs one more all-gather per block), and everything inside the TP region.
"""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.driver import machine_line
from benchmarks.lib.ranks import init_gloo, spawn_ranks, write_result

MODES = [("megatron", "none"), ("megatron", "selective"), ("megatron", "full"),
         ("oases", "none"), ("oases", "selective"), ("oases", "fine"), ("oases", "full")]


def _worker(rank: int, world: int, store: str, overrides: list, mbs: int, out: str) -> None:
    init_gloo(rank, world, store)
    import torch  # deferred: the parent only spawns

    from oases.models import build_model
    from oases.config import load_config
    from oases.overlap.engines import build_engine
    from oases.overlap.memory import SavedTensorMeter
    from oases.parallel.groups import build_context
    from oases.parallel.random import TPRNGTracker

    ctx = build_context(world, torch.device("cpu"))
    cfg = load_config(None, [*overrides, f"parallel.tp={world}"]).validate(world)
    ids = torch.randint(0, cfg.model.vocab_size, (mbs, cfg.model.seq_len),
                        generator=torch.Generator().manual_seed(0))
    res = {}
    for sched, rc in MODES:
        for sp in (False, True)[:1 + (world > 1)]:  # tp 1: what each recompute mode keeps
            tracker = TPRNGTracker(ctx.device)
            tracker.seed(1, ctx.tp_rank)
            model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker,
                                rc if sched == "megatron" or rc == "selective" else "none",
                                seed=1)
            model.set_sequence_parallel(sp)
            with SavedTensorMeter() as meter:
                build_engine(sched, ctx.tp_group, 2, rc, tracker).forward_backward(
                    model, ids, ids)
            res[f"{sched}/{rc}/{int(sp)}"] = meter.forward_bytes
    write_result(out, rank, res)


def render(out: Path, data: dict) -> None:
    lines = ["# Sequence parallelism: saved activations per rank", "",
             machine_line(data["machine"]), "", f"Command: `{data['command']}`.", "",
             f"Model: {data['shape']}; fp32; rank 0's bytes (every rank keeps the same).", "",
             "| tp | schedule | recompute | without SP (MiB) | with SP (MiB) | SP / without |",
             "|---|---|---|---|---|---|"]
    for tp, res in data["by_tp"].items():
        for sched, rc in MODES:
            a, b = res[f"{sched}/{rc}/0"], res.get(f"{sched}/{rc}/1")
            lines.append(f"| {tp} | {sched} | {rc} | {a / 2**20:.2f} | " + (
                f"{b / 2**20:.2f} | {b / a:.3f} |" if b else "- | - |"))
    lines += ["", "SP shrinks by tp the norms' inputs, the dropout masks, the residual "
              "stream and what `fine` keeps outside the region (the block input and the "
              "reduce-scattered output); the gathered input of each region (what the "
              "column-parallel weight gradient needs, and what `fine` keeps so as not to "
              "re-issue the all-gather) stays whole, as does everything inside the region.",
              ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = driver.parser(__doc__)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("overrides", nargs="*", help="model.key=value")
    driver.report_flags(ap, "sp_memory")
    args = ap.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    from benchmarks.lib.machine import machine_info  # deferred: the report only

    overrides = ["model.name=gpt-tiny", "model.d_model=512", "model.n_layer=2",
                 "model.n_head=8", "model.n_kv_heads=8", "model.ffn_hidden=2048",
                 "model.seq_len=128", "model.vocab_size=256",
                 f"model.dropout={args.dropout}", *args.overrides]
    t0 = time.time()
    by_tp = {}
    for tp in args.tp:
        print(f"tp {tp}: {len(MODES)} modes, with and without SP ...", flush=True)
        by_tp[str(tp)] = spawn_ranks(_worker, tp, overrides, args.micro_batch_size)[0]
    shape = " ".join(o for o in overrides) + f", micro-batch {args.micro_batch_size}"
    driver.save(driver.out_prefix(args, "sp_memory"), {
        "machine": machine_info(), "command": driver.command("benchmarks.sp_memory", argv),
        "elapsed_min": (time.time() - t0) / 60, "shape": shape, "by_tp": by_tp}, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
