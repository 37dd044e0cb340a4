"""The host's budget: host time and ATen calls per block per sub-batch, and per collective.

    .venv/bin/python -m benchmarks.host_overhead              # ~3 min on a quiet 2-core machine
    .venv/bin/python -m benchmarks.host_overhead --rounds 5 --modes megatron+full oases+fine+1

On a GPU the host only issues work: a segment's Python, its ATen calls and their kernel
launches must take less time than the GPU needs to run them, or the GPU waits for the
host. A 1.3B GPT block's segment is 20-230 us of H100 time. This measures what the
host spends per block and per collective, with nothing else in the way: two ranks
(tp = 2, gloo over loopback, one intra-op thread each), tiny shapes whose compute is
next to nothing, fp32, and the TP collectives skipped (``NoopCollectives``, as
``parallel.tp_comm_noop``), so that a forward-backward's time is the host's work; rank
0 runs them alone while rank 1 waits. With
one intra-op thread and nothing to wait for, all of it runs on the calling thread
(autograd's CPU backward included): its CPU time (``time.thread_time``) is the figure,
which other tenants of a shared machine leave alone, where wall time would not.

* **Per block per sub-batch**: each mode runs ``engine.forward_backward`` on the same
  model at two depths (``--layers``, default 2 and 6 layers); the difference, over the
  blocks added (two per layer: attention and MLP) and over the sub-batches, is one
  block's forward and backward for one sub-batch (recompute included), with the
  embedding, the loss and the fixed costs taken out. Host microseconds (the thread's CPU
  time) are the median over ``--rounds`` interleaved rounds of each round's fastest of
  ``--reps`` calls (the work itself; interference on a shared machine only adds to it);
  ATen calls are counted once (a ``TorchDispatchMode``; the count is exact, timing
  under it is not taken).
* **Per collective**: an all-reduce of a 16-float tensor over the TP group, real (gloo
  over loopback), issued and waited ``--calls`` times per round: torch's
  ``dist.all_reduce``, oases' ``all_reduce`` (counters, observers and no-op groups
  consulted), and oases' with the exposed-communication clock on
  (``metrics.comm_clock``). The figure is the calling thread's CPU time per call (gloo
  moves the bytes on its own threads, and a wait that blocks costs no CPU time): the
  host's work to issue and wait. What oases adds is the difference to torch's call, and,
  without gloo's noise, oases' call with torch's stubbed out (it answers at once).

Modes: ``<engine>+<recompute>[+<sub-batches>]``. Writes
``benchmarks/results/host_overhead.{md,json}``; ``--before`` keeps another tree's JSON
(the one before a change) side by side in the report.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.machine import machine_info
from benchmarks.lib.ranks import init_gloo, spawn_ranks, write_result

MODES = ["megatron+none", "megatron+selective", "megatron+full", "oases+none+1",
         "oases+none+2", "oases+full+2", "oases+fine+1", "oases+fine+2", "oases+fine+4"]
SHAPE = ["model.name=gpt-tiny", "model.d_model=64", "model.n_head=4", "model.n_kv_heads=4",
         "model.ffn_hidden=128", "model.seq_len=16", "model.vocab_size=128",
         "model.dropout=0", "train.micro_batch_size=4", "train.precision=fp32",
         "data.kind=synthetic", "parallel.tp=2"]
COLLECTIVES = ["torch", "oases", "oases+clock"]


def _config(mode: str, layers: int):
    from oases.config import load_config  # deferred: the parent process only spawns

    engine, recompute, *n = mode.split("+")
    over = [f"parallel.schedule={engine}", f"parallel.recompute={recompute}",
            f"model.n_layer={layers}"]
    if n:
        over.append(f"parallel.sub_batches={n[0]}")
    return load_config(None, SHAPE + over).validate(2)


def _build(mode: str, layers: int, ctx):
    """(engine, model, ids, targets, sub-batches) of a mode at a depth, as train.py builds it."""
    import torch

    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state

    cfg = _config(mode, layers)
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, seed=cfg.seed)
    state = build_train_state(cfg, ctx, model, tracker)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size,
                        (cfg.train.micro_batch_size, cfg.model.seq_len + 1), generator=g)
    n = cfg.sub_batches if cfg.parallel.schedule == "oases" else 1
    return state.engine, model, ids[:, :-1], ids[:, 1:], n


def _aten_calls(fn) -> int:
    """ATen (and c10d) operator calls made by ``fn()``."""
    from torch.utils._python_dispatch import TorchDispatchMode  # deferred: as above

    calls: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return sum(calls.values())


def _timed(fn, reps: int, before=None, clock=time.perf_counter, pick=statistics.median
           ) -> float:
    """``pick`` (median) of the seconds of ``reps`` calls of ``fn`` (``before()`` untimed
    before each) on ``clock``."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return pick(times)


def _blocks(ctx, modes: list[str], layers: tuple, rounds: int, reps: int) -> dict:
    from oases.parallel.comm import NoopCollectives

    built = {(m, L): _build(m, L, ctx) for m in modes for L in layers}

    def step(key):
        engine, model, x, y, _ = built[key]
        return lambda: engine.forward_backward(model, x, y, 1.0)

    def zero(key):
        return lambda: built[key][1].zero_grad(set_to_none=True)

    out = {m: {"us": [], "n": built[m, layers[0]][4]} for m in modes}
    with NoopCollectives(ctx.tp_group):
        for key in built:  # warm-up, and the exact ATen counts
            _timed(step(key), 2, zero(key))
        aten = {key: _aten_calls(step(key)) for key in built}
        for _ in range(rounds):
            for m in modes:
                t = [_timed(step((m, L)), reps, zero((m, L)), time.thread_time, min)
                     for L in layers]
                out[m]["us"].append(t)
    added = 2 * (layers[1] - layers[0])  # blocks: attention and MLP per layer
    for m, r in out.items():
        per = [(b - a) / added / r["n"] * 1e6 for a, b in r["us"]]
        r["block_us_rounds"] = per
        r["block_us"] = statistics.median(per)
        r["block_aten"] = (aten[m, layers[1]] - aten[m, layers[0]]) / added / r["n"]
        r["step_us"] = [statistics.median(t[i] for t in r["us"]) * 1e6
                        for i in range(len(layers))]
        del r["us"]
    return out


def _collectives(ctx, rounds: int, calls: int) -> dict:
    import torch
    import torch.distributed as dist

    from oases.overlap.comm_clock import CommClock
    from oases.parallel.comm import all_reduce

    g, t = ctx.tp_group, torch.ones(16)
    clock = CommClock("cpu", [g])

    def clocked():
        with clock:
            all_reduce(t, g, async_op=True).wait()
        clock.take()

    class Done:
        def wait(self, timeout=None):
            return True

    real = dist.all_reduce

    def stubbed():  # oases' own work alone: torch's call answers at once
        dist.all_reduce = lambda *a, **k: Done()
        try:
            all_reduce(t, g, async_op=True).wait()
        finally:
            dist.all_reduce = real

    fns = {"torch": lambda: dist.all_reduce(t, group=g, async_op=True).wait(),
           "oases": lambda: all_reduce(t, g, async_op=True).wait(),
           "oases+clock": clocked, "oases, torch's call stubbed": stubbed}
    out = {k: {"us_rounds": [], "aten": _aten_calls(f)} for k, f in fns.items()}
    for k, f in fns.items():
        _timed(f, 20)
    for _ in range(rounds):
        for k, f in fns.items():
            out[k]["us_rounds"].append(_timed(f, calls, clock=time.thread_time) * 1e6)
    for r in out.values():
        r["us"] = statistics.median(r["us_rounds"])
    return out


def _worker(rank, world, store, modes, layers, rounds, reps, calls, result_dir) -> None:
    import torch

    from oases.parallel.groups import build_context

    import torch.distributed as dist

    init_gloo(rank, world, store)
    ctx = build_context(world, torch.device("cpu"))
    # blocks: rank 0 alone (the TP collectives are skipped, so nothing needs rank 1, and a
    # second rank computing on the other core would share caches and the memory bus)
    blocks = _blocks(ctx, modes, layers, rounds, reps) if rank == 0 else None
    dist.barrier()
    result = {"blocks": blocks, "collectives": _collectives(ctx, rounds, calls)}
    write_result(result_dir, rank, result)
    os._exit(0)  # skip the slow process-group teardown


def render(prefix: Path, data: dict) -> None:
    meta, blocks, coll = data["meta"], data["blocks"], data["collectives"]
    lines = [*driver.report_head("# The host's budget per block and per collective", meta),
             f"Shape: {meta['shape']}; depths {meta['layers'][0]} and {meta['layers'][1]} "
             f"layers. Two ranks (tp = 2, gloo over loopback), one intra-op thread each. "
             f"Blocks: TP collectives skipped (`NoopCollectives`), rank 0 alone, so a "
             f"forward-backward is "
             f"host work, timed as the calling thread's CPU time; per block per sub-batch "
             f"= the difference of the two depths over the blocks added and the "
             f"sub-batches. Median over {meta['rounds']} "
             f"interleaved rounds of each round's fastest of {meta['reps']} calls (rank 0). "
             f"Collectives: a 16-float all-reduce over the TP group, real, issued and "
             f"waited {meta['calls']} times a round; the calling thread's CPU time per call "
             f"(the host's work to issue and wait).", "",
             "| mode | sub-batches | host us / block / sub-batch | per round | ATen calls / "
             "block / sub-batch | forward-backward us (shallow, deep) |",
             "|---|---|---|---|---|---|"]
    for m, r in blocks.items():
        rnd = ", ".join(f"{x:.0f}" for x in r["block_us_rounds"])
        steps = ", ".join(f"{x:.0f}" for x in r["step_us"])
        lines.append(f"| {m} | {r['n']} | {r['block_us']:.0f} | {rnd} | "
                     f"{r['block_aten']:.1f} | {steps} |")
    base = coll["torch"]["us"]
    lines += ["", "| collective | host us / call | per round | over torch's | ATen calls |",
              "|---|---|---|---|---|"]
    for k, r in coll.items():
        rnd = ", ".join(f"{x:.0f}" for x in r["us_rounds"])
        over = "(oases' part alone)" if "stubbed" in k else f"{r['us'] - base:+.1f}"
        lines.append(f"| {k} | {r['us']:.1f} | {rnd} | {over} | {r['aten']} |")
    if "before" in data:
        bm, bb, bc = data["before"]["meta"], data["before"]["blocks"], data["before"]["collectives"]
        lines += ["", f"Before (`{bm['command']}` on oases {bm['machine']['git']}, "
                      f"{bm['machine']['date']}):", "",
                  "| mode | host us / block / sub-batch | ATen calls / block / sub-batch |",
                  "|---|---|---|"]
        lines += [f"| {m} | {r['block_us']:.0f} | {r['block_aten']:.1f} |" for m, r in bb.items()]
        lines += ["", "| collective | host us / call | ATen calls |", "|---|---|---|"]
        lines += [f"| {k} | {r['us']:.1f} | {r['aten']} |" for k, r in bc.items()]
    lines += ["", "Raw numbers: `host_overhead.json`."]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = driver.parser(__doc__)
    ap.add_argument("--modes", nargs="+", default=MODES)
    ap.add_argument("--layers", nargs=2, type=int, default=[2, 6])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--before", help="this benchmark's JSON from another tree (the one before "
                    "a change): its figures are kept in the report, side by side")
    driver.report_flags(ap, "host_overhead")
    args = ap.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (medians of >= 3 interleaved rounds)")
    if args.layers[1] <= args.layers[0]:
        ap.error("--layers: the second depth must be larger than the first")
    for m in args.modes:
        parts = m.split("+")
        if len(parts) not in (2, 3) or parts[0] not in ("megatron", "oases"):
            ap.error(f"mode {m!r} is not <engine>+<recompute>[+<sub-batches>]")
    t0 = time.monotonic()
    results = spawn_ranks(_worker, 2, args.modes, tuple(args.layers), args.rounds, args.reps,
                          args.calls)
    shape = ", ".join(s.split(".", 1)[1] for s in SHAPE if s.startswith(("model.", "train.")))
    meta = {"machine": machine_info(), "command": driver.command("benchmarks.host_overhead", argv),
            "elapsed_min": (time.monotonic() - t0) / 60, "rounds": args.rounds,
            "reps": args.reps, "calls": args.calls, "layers": args.layers, "shape": shape}
    data = {"meta": meta, **results[0]}
    if args.before:
        before = json.loads(Path(args.before).read_text())
        data["before"] = {k: before[k] for k in ("meta", "blocks", "collectives")}
    driver.save(driver.out_prefix(args, "host_overhead"), data, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
