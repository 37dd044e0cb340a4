"""Peak memory of a ZeRO-3 run around checkpoints: steady training, the save step, resume.

    .venv/bin/python -m benchmarks.zero_ckpt_memory                  # GPT 63.5M, dp 4, zero 3
    .venv/bin/python -m benchmarks.zero_ckpt_memory --quick          # 2 layers, fewer steps

Four CPU processes (gloo, one FileStore) train GPT (d 512, 12 layers, vocab 50257: 63.5M
parameters; 16 bytes of state per parameter, 1.0 GB in all, 254 MB per rank at dp 4)
with ``parallel.zero=3`` through the trainer's own pieces (``build_train_state``,
``train_step``, :func:`oases.runtime.checkpoint.save` / ``load``). Each rank reads its
peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``) in three phases:

* steady: the peak over training steps 3-5 (after two warm-up steps);
* save: the peak over step 6 followed by the checkpoint save;
* resume: new processes build the model, then ``load`` the checkpoint; the peak over
  the load, and the peak over two steps after it.

Ratios are the phase's peak over the steady peak of the same rank (the target: save and
resume at most 1.1x). ``MALLOC_MMAP_THRESHOLD_=65536`` makes glibc return every freed
tensor to the system, so the resident set follows what is allocated (without it, a freed
bucket may stay in the heap and show as resident). Memory does not depend on CPU
contention, so the figures hold on a shared machine.
Writes benchmarks/results/zero_ckpt_memory.{md,json} (``--quick``: zero_ckpt_memory-quick.*).
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.machine import machine_info
from benchmarks.lib.ranks import init_gloo, reset_peak, spawn_ranks, status_kib, write_result

REPO = driver.REPO
MODEL = ["model.name=gpt-125m", "model.d_model=512", "model.n_head=8", "model.n_kv_heads=8",
         "model.ffn_hidden=2048", "model.n_layer=12", "model.seq_len=64", "model.dropout=0"]


def _rss_peak_mb() -> float:
    return status_kib("VmHWM") / 1024


def _config(out_dir: str, overrides: list[str], world: int):
    from oases.config import load_config  # deferred: the workers import torch, not the parent

    return load_config(None, [*MODEL, "parallel.zero=3", "data.kind=synthetic",
                              "data.val_path=", "train.micro_batch_size=1", "train.grad_accum=1",
                              "train.warmup_steps=0", f"out_dir={out_dir}",
                              *overrides]).validate(world)


def start_rank(rank: int, world: int, store: str, out_dir: str, overrides: list[str]):
    """One worker's run, built as the trainer builds it: (ctx, cfg, tracker, model, train
    state, batches) of a ``world``-rank gloo group over the FileStore ``store``."""
    import torch  # deferred: the parent process only spawns

    from oases.parallel.groups import build_context  # deferred: as torch
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches

    init_gloo(rank, world, store)
    ctx = build_context(1, torch.device("cpu"))
    cfg = _config(out_dir, overrides, world)
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
    ts = build_train_state(cfg, ctx, model, tracker)
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp, cfg.seed)
    return ctx, cfg, tracker, model, ts, batches


def _worker(rank: int, world: int, store: str, out_dir: str, phase: str, overrides: list[str],
            result_dir: str) -> None:
    import torch.distributed as dist  # deferred: the parent process only spawns

    from oases.runtime import checkpoint as ckpt  # deferred: as torch
    from oases.runtime.resume import layout_meta, model_shape
    from oases.runtime.step import train_step

    ctx, cfg, tracker, model, ts, batches = start_rank(rank, world, store, out_dir, overrides)
    shards = ts.reducer.ownership
    out: dict[str, float] = {}
    if phase == "train" and rank == 0:  # export reads the run's config next to checkpoints/
        from oases.config import save_config  # deferred: as torch
        save_config(cfg, Path(out_dir) / "config.yaml")
    if phase == "train":
        for _ in range(2):
            train_step(ts, batches, 1e-4)
        reset_peak()
        for _ in range(3):
            train_step(ts, batches, 1e-4)
        out["steady"] = _rss_peak_mb()
        reset_peak()
        train_step(ts, batches, 1e-4)
        meta = {"step": 6, "data": batches.state_dict(), "model_shape": model_shape(cfg),
                **layout_meta(ctx)}
        ckpt.save(out_dir, 6, model, ts.opt, ctx, meta, tracker.get_states(), shards=shards)
        out["save"] = _rss_peak_mb()
    else:
        dist.barrier()
        reset_peak()
        ckpt.load(ckpt.latest_checkpoint(out_dir), model, ts.opt, ctx, model_shape(cfg),
                  layout_meta(ctx), shards=shards)
        out["resume"] = _rss_peak_mb()
        reset_peak()
        for _ in range(2):
            train_step(ts, batches, 1e-4)
        out["steady_after_resume"] = _rss_peak_mb()
    write_result(result_dir, rank, out)
    dist.barrier()
    dist.destroy_process_group()


def _run(phase: str, world: int, out_dir: str, overrides: list[str]) -> list[dict]:
    return spawn_ranks(_worker, world, out_dir, phase, overrides)


_PEAK = ("import resource, sys; sys.argv = {argv!r}; {imports}; {call}; "
         "print('PEAK', open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")


def _cli_peak(argv: list[str], imports: str, call: str, pythonpath: str) -> float:
    """Peak resident set (MiB) of a fresh process running ``call``."""
    import subprocess  # deferred: as torch

    code = _PEAK.format(argv=argv, imports=imports, call=call)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=pythonpath)
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-2000:])
    return int(res.stdout.split("PEAK")[-1].split()[0]) / 1024


def streaming_peaks(out_dir: str, pythonpath: str) -> dict:
    """Peak resident sets of ``python -m oases.consolidate`` and ``python -m oases.export``
    on the checkpoint, and of a process that only imports what they import (baseline)."""
    import torch  # deferred: as in _worker

    from oases.runtime import checkpoint as ckpt  # deferred: as torch

    ck = ckpt.latest_checkpoint(out_dir)
    largest = max(math.prod(md.size) * md.properties.dtype.itemsize
                  for k, md in ckpt.read_metadata(ck).items() if k.startswith("model/"))
    model = sum(math.prod(md.size) * md.properties.dtype.itemsize
                for k, md in ckpt.read_metadata(ck).items() if k.startswith("model/"))
    del torch
    imports = ("from oases.cli.consolidate import main as c; "
               "from oases.cli.export import main as e")
    with tempfile.TemporaryDirectory() as d:
        return {
            "baseline": _cli_peak([], imports, "None", pythonpath),
            "consolidate": _cli_peak([], imports, f"c([{str(ck)!r}, '--out', '{d}/m.pt'])",
                                     pythonpath),
            "export": _cli_peak([], imports, f"e([{str(ck)!r}, '--to-hf', '{d}/hf'])",
                                pythonpath),
            "largest_tensor_mib": largest / 2**20, "model_mib": model / 2**20}


def measure(world: int, overrides: list[str], tools_from: str = "") -> dict:
    with tempfile.TemporaryDirectory() as out_dir:
        train = _run("train", world, out_dir, overrides)
        resume = _run("resume", world, out_dir, overrides)
        size = sum(f.stat().st_size for f in Path(out_dir).rglob("*") if f.is_file())
        streams = streaming_peaks(out_dir, str(REPO))
        if tools_from:  # the same tools of another checkout, on the same checkpoint
            streams["other"] = {"path": tools_from, **streaming_peaks(out_dir, tools_from)}
    ranks = []
    for r, (a, b) in enumerate(zip(train, resume)):
        ranks.append({"rank": r, **a, **b, "save_ratio": a["save"] / a["steady"],
                      "resume_ratio": b["resume"] / a["steady"]})
    return {"ranks": ranks, "checkpoint_mb": size / 2**20, "streaming": streams}


def rank_rows(ranks: list[dict]) -> list[str]:
    return ["| rank | steady MiB | save step MiB | resume MiB | after resume MiB "
            "| save / steady | resume / steady |", "|---|---|---|---|---|---|---|",
            *(f"| {r['rank']} | {r['steady']:.0f} | {r['save']:.0f} | {r['resume']:.0f} "
              f"| {r['steady_after_resume']:.0f} | {r['save_ratio']:.3f} "
              f"| {r['resume_ratio']:.3f} |" for r in ranks)]


def render(out: Path, res: dict) -> None:
    """``<out>.md`` from the results JSON (``previous_code``: the same measurement on an
    older tree, with its ``note``)."""
    worst = max(max(r["save_ratio"], r["resume_ratio"]) for r in res["ranks"])
    st = res["streaming"]
    lines = ["# ZeRO-3 checkpoint memory", "", f"Command: `{res['command']}`", "",
             f"Machine: {res['machine']} (shared with other work: memory does not depend "
             f"on it)", "",
             f"Model: {' '.join(MODEL + res['set'])}; parallel.zero=3, dp {res['world']}, "
             f"tp 1; checkpoint {res['checkpoint_mb']:.0f} MiB on disk.", "",
             *rank_rows(res["ranks"]), "", f"Worst ratio: {worst:.3f} (target <= 1.1).", "",
             "Single-process tools on that checkpoint (peak resident set, MiB; baseline: a "
             "process that imports the same modules and does nothing):", "",
             "| baseline | consolidate | export | largest tensor | model |",
             "|---|---|---|---|---|",
             f"| {st['baseline']:.0f} | {st['consolidate']:.0f} | {st['export']:.0f} "
             f"| {st['largest_tensor_mib']:.0f} | {st['model_mib']:.0f} |", ""]
    if "other" in st:
        o = st["other"]
        lines += [f"The same tools from {o['path']} (`--tools-from`): baseline "
                  f"{o['baseline']:.0f}, consolidate {o['consolidate']:.0f}, export "
                  f"{o['export']:.0f} MiB.", ""]
    if "previous_code" in res:
        pc = res["previous_code"]
        lines += [f"## The same measurement on commit {pc['commit']}", "", pc["note"], "",
                  *rank_rows(pc["ranks"]), "", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main(argv=None) -> int:
    p = driver.parser(__doc__)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--set", nargs="*", default=[], help="extra config overrides")
    p.add_argument("--quick", action="store_true", help="2 layers (a smoke run)")
    p.add_argument("--tools-from", default="",
                   help="another checkout whose consolidate/export to measure as well")
    driver.report_flags(p, "zero_ckpt_memory")
    args = p.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    if args.quick:
        args.set = ["model.n_layer=2", *args.set]
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the workers
    res = measure(args.world, args.set, args.tools_from)
    m = machine_info()
    driver.save(driver.out_prefix(args, "zero_ckpt_memory"), {
        "command": driver.command("benchmarks.zero_ckpt_memory", argv),
        "machine": f"{m['cpu']}, {m['cores']} cores, {m['mem_gib']} GiB, torch {m['torch']}, "
                   f"git {m['git']}, {m['date']}", "world": args.world, "set": args.set, **res},
        render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
