"""Step time around a checkpoint save: ``checkpoint.async_save`` false (DCP ``save``) vs
true (DCP ``async_save``: staged to host memory, written by a background thread).

    .venv/bin/python -m benchmarks.async_save                 # 3 rounds, both modes
    .venv/bin/python -m benchmarks.async_save --repeats 1     # a smoke run

CPU processes (gloo) train GPT (d 512, 12 layers, vocab 50257: 63.5M parameters) at
``parallel.zero=3`` through the trainer's pieces; step 4 of 8 saves. Per run, each
iteration's wall time on rank 0 (the step, plus the save call where there is one, plus
``AsyncSaver.poll``), after a barrier so every rank starts it together. Reported per
mode: the median over rounds of the steady step (the median of steps 2, 3), of the
iteration with the save, and of the two after it, and the save's write time (sync:
the call; async: until the background write finished, read at the end). The modes run
interleaved, round by round, in fresh processes. CPU time is the scarce resource here
(the background write competes with the steps for the same cores; on a GPU node the
steps run on the device), so the figures say what the option costs on CPU, not what it
saves on GPUs. Writes benchmarks/results/async_save.{md,json}.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from benchmarks.lib import driver
from benchmarks.lib.ranks import spawn_ranks, write_result
from benchmarks.zero_ckpt_memory import MODEL, start_rank

STEPS, SAVE_AT = 8, 4


def _worker(rank: int, world: int, store: str, out_dir: str, mode: str, overrides: list[str],
            result_dir: str) -> None:
    import torch.distributed as dist  # deferred: the parent process only spawns

    from oases.runtime import checkpoint as ckpt  # deferred: as torch
    from oases.runtime.resume import layout_meta, model_shape
    from oases.runtime.step import train_step

    ctx, cfg, tracker, model, ts, batches = start_rank(rank, world, store, out_dir, overrides)
    saver = ckpt.AsyncSaver() if mode == "async" else None
    times, write_s, done = [], 0.0, []
    for step in range(1, STEPS + 1):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(ts, batches, 1e-4)
        if saver is not None:
            saver.poll()
        if step == SAVE_AT:
            meta = {"step": step, "data": batches.state_dict(), "model_shape": model_shape(cfg),
                    **layout_meta(ctx)}
            args = (out_dir, step, model, ts.opt, ctx, meta, tracker.get_states())
            ts_save = time.perf_counter()
            if saver is None:
                ckpt.save(*args, shards=ts.reducer.ownership)
                write_s = time.perf_counter() - ts_save
            else:
                saver.save(*args, shards=ts.reducer.ownership)
                fut = saver.pending[0]
                fut.add_done_callback(lambda f, t=ts_save: done.append(time.perf_counter() - t))
        times.append(time.perf_counter() - t0)
    if saver is not None:
        saver.wait()
        write_s = done[0] if done else float("nan")
    if rank == 0:
        write_result(result_dir, rank, {"times": times, "write_s": write_s})
    dist.barrier()
    dist.destroy_process_group()


def measure(_, mode: str, args) -> dict:
    """One run of ``mode`` in fresh processes: rank 0's iteration times, and the figures."""
    with tempfile.TemporaryDirectory() as out_dir:
        r = spawn_ranks(_worker, args.world, out_dir, mode, args.set)[0]
    med = statistics.median
    return {**r, "steady_s": med(r["times"][1:SAVE_AT - 1]), "save_step_s": r["times"][SAVE_AT - 1],
            "next_two_s": sum(r["times"][SAVE_AT: SAVE_AT + 2]) / 2}


def render(out, data: dict) -> None:
    meta = data["meta"]
    lines = [*driver.report_head("# Step time around a checkpoint save: sync vs async", meta),
             "The machine was shared with other work: absolute times are noise, compare the "
             "modes.", "",
             f"Model: {' '.join(MODEL + meta['set'])}; parallel.zero=3, dp {meta['world']}; "
             f"step {SAVE_AT} of {STEPS} saves; medians over {meta['rounds']} interleaved "
             "rounds.", "", "| mode | steady step s | step + save s | next two steps s (mean) "
             "| write s |", "|---|---|---|---|---|"]
    for mode, r in data["modes"].items():
        lines.append(f"| {mode} | {r['steady_s']:.2f} | {r['save_step_s']:.2f} "
                     f"| {r['next_two_s']:.2f} | {r['write_s']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _flags(p) -> None:
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides")


SUITE = driver.Suite("async_save", "benchmarks.async_save", dict.fromkeys(("sync", "async")),
                     measure, render, flags=_flags, min_rounds=1,
                     metrics=("steady_s", "save_step_s", "next_two_s", "write_s"))

if __name__ == "__main__":
    sys.exit(driver.run_suite(SUITE, __doc__))
