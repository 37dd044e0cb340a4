"""Validate and measure oases on this machine's GPUs, in one command, within a budget.

    make gpu-check                     # python -m benchmarks.gpu_check
    python -m benchmarks.gpu_check --budget-s 300 --skip-tests     # quicker

In this order, each part given what is left of ``--budget-s`` and the results file
rewritten after each: the environment, waits (:mod:`benchmarks.lib.gpu_wait`), host
against GPU (:mod:`benchmarks.lib.gpu_host`), the cuda-marked tests, speed on one GPU,
overlap on two (:mod:`benchmarks.lib.kernel_overlap`); what each runs and needs is in
docs/gpu-check.md. Writes ``benchmarks/results/gpu-<gpu name>.md`` and ``.json``.
Without a CUDA device it prints the environment and why it skips, writes nothing and
exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from benchmarks.lib.gpu_env import REPO, describe, environment, run_cuda_tests, slug
from benchmarks.lib.driver import rerender
from benchmarks.lib.gpu_report import write_report
from benchmarks.lib.kernel_overlap import trace_hidden_fraction
from oases.config import load_config
from oases.parallel.groups import init_distributed
from oases.planner.api import run_shape
from oases.planner.cluster import Cluster
from oases.planner.cost import CostModel, ModelShape
from oases.parallel.nccl_env import kernel_order
from oases.planner.profile import get_profile
from oases.runtime.build import fast_init, build_rank_model, seed_tracker, build_train_state
from oases.runtime.step import train_step

MODES = {"megatron": ["parallel.schedule=megatron", "parallel.recompute=none"],
         "oases-fine": ["parallel.schedule=oases", "parallel.recompute=fine",
                        "parallel.sub_batches=2"],
         "oases-fine-1": ["parallel.schedule=oases", "parallel.recompute=fine",
                          "parallel.sub_batches=1"],
         "selective": ["parallel.schedule=megatron", "parallel.recompute=selective"]}
TP2_MODES = {"megatron-full": ["parallel.schedule=megatron", "parallel.recompute=full"],
             "oases-fine": MODES["oases-fine"],
             "oases-fine-noop": [*MODES["oases-fine"], "parallel.tp_comm_noop=true"]}


def largest_fitting(fits: Callable[[int], bool], candidates: list[int]) -> Optional[int]:
    """The largest of the ascending ``candidates`` for which ``fits`` holds, trying them
    in order and stopping at the first that does not (None: not even the first)."""
    best = None
    for c in candidates:
        if not fits(c):
            break
        best = c
    return best


def _cfg(model: str, mode: str, mbs: int, extra: tuple = ()):
    return load_config(None, [f"model.name={model}", "train.precision=bf16",
                              "data.kind=synthetic", f"train.micro_batch_size={mbs}",
                              "wandb.mode=disabled",
                              "train.grad_accum=1", *MODES.get(mode, TP2_MODES.get(mode, [])),
                              *extra])


class _Batch:
    """One random micro-batch on the device, over and over."""

    def __init__(self, cfg, device) -> None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.model.vocab_size,
                            (cfg.train.micro_batch_size, cfg.model.seq_len + 1), generator=g)
        self.x, self.y = ids[:, :-1].to(device), ids[:, 1:].to(device)

    def next_batch(self):
        return self.x, self.y


def _build(cfg, ctx):
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, None)
    fast_init(model)
    return build_train_state(cfg, ctx, model, tracker)


def _free(state) -> None:
    if state is not None:
        state.reducer.close()
    gc.collect()
    torch.cuda.empty_cache()


def _step_times(state, batch, n: int) -> list[float]:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        train_step(state, batch, state.cfg.train.lr)
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(n)]


def _probe(model: str, mode: str, ctx, max_mbs: int) -> Optional[int]:
    """The largest power-of-two micro-batch (>= 2) that trains two steps in ``mode``."""
    state = _build(_cfg(model, mode, 2).validate(1), ctx)

    def fits(mbs: int) -> bool:
        try:
            _step_times(state, _Batch(_cfg(model, mode, mbs).validate(1), ctx.device), 2)
            return True
        except torch.cuda.OutOfMemoryError:
            return False
    try:
        return largest_fitting(fits, [2 ** k for k in range(1, max_mbs.bit_length())
                                      if 2 ** k <= max_mbs])
    finally:
        _free(state)


def _predicted_bytes(cfg, ctx) -> Optional[float]:
    """The planner's peak memory for ``cfg`` on one GPU, from a profile measured here."""
    run = run_shape(cfg)
    prof = get_profile(cfg, run, ctx.device, None, log=lambda s: None)
    total = torch.cuda.get_device_properties(ctx.device).total_memory / 2**30
    cm = CostModel(ModelShape.from_config(cfg.model), run, Cluster("local", 1, 1, total, 1, 1),
                   prof, [1])
    return cm.plan_memory([1] * cm.n)


def speed_one_gpu(model: str, ctx, args, peak: Optional[float], log=print) -> dict:
    """Section 3 for one model: probe, then the modes interleaved over rounds."""
    largest = {m: (_probe(model, m, ctx, args.max_mbs) if args.probe else args.mbs)
               for m in MODES}
    log(f"  {model}: largest micro-batch per mode {largest}")
    fitting = [v for v in largest.values() if v]
    if not fitting:
        return {"model": model, "error": "no micro-batch of 2 fits in any mode"}
    mbs = min(fitting)
    times: dict = {m: [] for m in MODES if largest[m]}
    mem: dict = {}
    for r in range(args.rounds):
        for mode in times:
            cfg = _cfg(model, mode, mbs).validate(1)
            state = _build(cfg, ctx)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            batch = _Batch(cfg, ctx.device)
            _step_times(state, batch, args.warmup)
            t = statistics.median(_step_times(state, batch, args.steps))
            times[mode].append(t)
            mem[mode] = torch.cuda.max_memory_allocated(ctx.device)
            fpt = state.model.flops_per_token()
            _free(state)
            state = None
            log(f"  {model} round {r + 1} {mode}: {1e3 * t:.0f} ms/step")
    out = {"model": model, "micro_batch_size": mbs, "largest_micro_batch": largest,
           "modes": {}}
    tokens = mbs * cfg.model.seq_len
    for mode, ts in times.items():
        step = statistics.median(ts)
        cfg = _cfg(model, mode, mbs).validate(1)
        try:
            pred = _predicted_bytes(cfg, ctx)
        except Exception as e:  # a prediction that fails is reported, not fatal
            pred, why = None, f"{type(e).__name__}: {e}"
        else:
            why = None
        tps = tokens / step
        out["modes"][mode] = {
            "step_s": step, "step_s_rounds": ts, "tokens_per_s": tps,
            "tflops": fpt * tps / 1e12, "mfu": fpt * tps / peak if peak else None,
            "peak_mem_gib": mem[mode] / 2**30,
            "predicted_mem_gib": pred / 2**30 if pred else None, "prediction_error": why}
    base = out["modes"].get("megatron")
    if base:
        for m in out["modes"].values():
            m["vs_megatron"] = base["step_s"] / m["step_s"]
    return out


def _torchrun(args: list[str], log_path: Path, timeout: float = 900) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *args]
    with open(log_path, "w") as f:
        return subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode


def overlap_two_gpus(mbs: int, rounds: int, tmp: Path, log=print) -> dict:
    """Section 4: tp = 2 throughput of each TP2_MODES entry, and the traces."""
    steps, warm = 12, 4
    tps: dict = {m: [] for m in TP2_MODES}
    errors = {}
    for r in range(rounds):
        for mode, extra in TP2_MODES.items():
            out = tmp / f"tp2-{mode}-{r}"
            rc = _torchrun(["train.py", "model.name=gpt-1.3b", "parallel.tp=2",
                            "parallel.device=cuda", "train.precision=bf16",
                            "data.kind=synthetic", f"train.micro_batch_size={mbs}",
                            f"train.steps={steps}", "train.log_interval=1", "eval.interval=0",
                            "wandb.mode=disabled", "checkpoint.save_final=false",
                            "resume=none", f"out_dir={out}", *extra], tmp / f"{out.name}.log")
            if rc != 0:
                errors[mode] = f"exit {rc}: see {tmp / (out.name + '.log')}"
                continue
            recs = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
            tps[mode].append(statistics.median(
                x["tokens_per_s"] for x in recs if "tokens_per_s" in x and x["step"] > warm))
            log(f"  tp=2 round {r + 1} {mode}: {tps[mode][-1]:,.0f} tokens/s")
    res = {"micro_batch_size": mbs, "tokens_per_s": {m: statistics.median(v) if v else None
                                                     for m, v in tps.items()},
           "errors": errors, "traces": {}}
    for mode in ("megatron-full", "oases-fine"):
        trace = tmp / f"trace-{mode}.json"
        rc = _torchrun(["--module", "benchmarks.gpu_check", "--trace-worker", str(trace),
                        "--trace-mode", mode, "--mbs", str(mbs)], tmp / f"trace-{mode}.log")
        res["traces"][mode] = (trace_hidden_fraction(trace) if rc == 0 and trace.exists()
                               else {"error": f"exit {rc}: see {tmp / f'trace-{mode}.log'}"})
    return res


def trace_worker(path: str, mode: str, mbs: int) -> None:
    """Under torchrun (2 ranks): one profiled step of gpt-1.3b at tp = 2; rank 0 writes it."""
    ctx = init_distributed(2, "cuda")
    cfg = _cfg("gpt-1.3b", mode, mbs, ("parallel.tp=2",)).validate(ctx.world_size)
    state = _build(cfg, ctx)
    batch = _Batch(cfg, ctx.device)
    _step_times(state, batch, 3)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        _step_times(state, batch, 1)
    if ctx.rank == 0:
        prof.export_chrome_trace(path)
    torch.distributed.barrier()
    os._exit(0)  # skip the slow process-group teardown


def _sub(module: str, args: list[str], env: dict, timeout: float, log_path: Path) -> int:
    """``python -m module args`` with ``env``, its output in ``log_path``; its status
    (None: it ran past ``timeout``)."""
    with open(log_path, "w") as f:
        try:
            return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None


def _env(**set_or_drop) -> dict:
    """This environment with each variable set (a str) or dropped (None)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k, v in set_or_drop.items():
        env.pop(k, None) if v is None else env.__setitem__(k, v)
    return env


WAIT_SETTINGS = {  # NCCL's wait mode, read when the process group is created
    "blocking (TORCH_NCCL_BLOCKING_WAIT=1, the old default)": dict(
        TORCH_NCCL_BLOCKING_WAIT="1", TORCH_NCCL_ASYNC_ERROR_HANDLING=None),
    "oases (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)": dict(
        TORCH_NCCL_BLOCKING_WAIT=None, TORCH_NCCL_ASYNC_ERROR_HANDLING="2")}


def waits(work: Path, left) -> dict:
    """Part 2: :mod:`benchmarks.lib.gpu_wait` under each wait mode."""
    out = {}
    for name, env in WAIT_SETTINGS.items():
        path = work / f"wait-{len(out)}.json"
        rc = _sub("benchmarks.lib.gpu_wait", ["--out", str(path)], _env(**env),
                  min(120, left()), work / f"wait-{len(out)}.log")
        out[name] = json.loads(path.read_text()) if rc == 0 and path.exists() else \
            {"error": f"exit {rc}: see {work / f'wait-{len(out)}.log'}"}
        print(f"  {name}: {out[name]}", flush=True)
    return out


def host_budget(work: Path, tps: list[int], mbs: int, left) -> dict:
    """Part 3: :mod:`benchmarks.lib.gpu_host` at each tp with CUDA_DEVICE_MAX_CONNECTIONS=1,
    and at the first tp unset too."""
    runs = [(tp, "1") for tp in tps] + [(tps[0], None)]
    out = {}
    for tp, conn in runs:
        key = f"tp{tp}-connections-{conn or 'unset'}"
        if left() < 60:
            out[key] = {"error": "skipped: the budget ran out"}
            continue
        path = work / f"host-{key}.json"
        rc = _sub("benchmarks.lib.gpu_host", ["--tp", str(tp), "--mbs", str(mbs),
                                              "--out", str(path)],
                  _env(CUDA_DEVICE_MAX_CONNECTIONS=conn), min(240, left()),
                  work / f"host-{key}.log")
        out[key] = json.loads(path.read_text()) if rc == 0 and path.exists() else \
            {"error": f"exit {rc}: see {work / f'host-{key}.log'}"}
        print(f"  {key}: done", flush=True)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    order = kernel_order()  # before this process's CUDA context (environment() makes it)
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="the whole check's time; each part gets what is left")
    p.add_argument("--models", nargs="+", default=["gpt-1.3b"])
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--mbs", type=int, default=4, help="micro-batch for every mode")
    p.add_argument("--probe", action="store_true", help="probe each mode's largest "
                   "power-of-two micro-batch (up to --max-mbs) instead of --mbs")
    p.add_argument("--max-mbs", type=int, default=64)
    p.add_argument("--host-tp", nargs="+", type=int, default=[2, 8],
                   help="tp shapes of the host part")
    p.add_argument("--skip-tests", action="store_true", help="leave out the cuda tests")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"),
                   help="folder of gpu-<device>.md/.json")
    p.add_argument("--from-json", help="write the .md of a saved results JSON again (no "
                   "runs), beside it or to the --out prefix")
    p.add_argument("--trace-worker", help=argparse.SUPPRESS)
    p.add_argument("--trace-mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.from_json:
        out = args.out if args.out != p.get_default("out") else None
        return rerender(Path(args.from_json), lambda prefix, data: write_report(
            data, prefix, json_too=False), out=out)
    if args.trace_worker:
        trace_worker(args.trace_worker, args.trace_mode, args.mbs)
        return 0
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    t0 = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - t0)

    env = environment()
    for ln in describe(env):
        print(ln, flush=True)
    if not env["gpus"]:
        print("gpu-check: skipped: no CUDA device is visible (torch.cuda.is_available() is "
              "False); nothing was run or written", flush=True)
        return 0
    env["kernel_order"] = order
    res = {"environment": env, "command": "python -m benchmarks.gpu_check " +
           " ".join(argv if argv is not None else sys.argv[1:]),
           "date": datetime.date.today().isoformat(), "budget_s": args.budget_s}
    out = Path(args.out) / f"gpu-{slug(env['gpus'][0]['name'])}"
    work = REPO / "runs" / "gpu-check"  # the parts' logs, and the traces, stay there
    work.mkdir(parents=True, exist_ok=True)

    def save(part: str) -> None:
        res["seconds"] = time.monotonic() - t0
        write_report(res, out)
        print(f"gpu-check: {part} done at {res['seconds']:.0f} s; wrote {out}.md", flush=True)

    print("waits: blocking against oases' (one-rank NCCL group)", flush=True)
    res["waits"] = waits(work, left)
    save("waits")
    print(f"host against GPU (gpt-1.3b at tp {args.host_tp} shapes):", flush=True)
    res["host"] = host_budget(work, args.host_tp, 2, left)
    save("host")
    if not args.skip_tests and left() > 90:
        print("correctness: pytest -m cuda tests ...", flush=True)
        res["tests"] = run_cuda_tests(timeout_s=min(240.0, left() - 60))
        print(f"  {res['tests']['counts']} in {res['tests']['seconds']:.0f} s", flush=True)
        save("tests")
    if left() > 60:
        ctx = init_distributed(1, "cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
        print("speed, one GPU (bf16):", flush=True)
        res["one_gpu"] = [speed_one_gpu(m, ctx, args, env["peak_bf16_flops"])
                          for m in args.models]
        save("speed")
    if len(env["gpus"]) >= 2 and left() > 120:
        print("overlap, two GPUs (tp=2, gpt-1.3b):", flush=True)
        first = next((r for r in res.get("one_gpu", [])
                      if r["model"] == "gpt-1.3b" and "error" not in r), None)
        res["two_gpus"] = overlap_two_gpus(first["micro_batch_size"] if first else 4,
                                           args.rounds, work)
        save("overlap")
    print(f"wrote {out}.md and .json in {res['seconds'] / 60:.1f} min", flush=True)
    failed = res.get("tests", {}).get("counts", {}).get("failed", 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
