"""The training loop: config -> groups -> model -> steps -> checkpoints and metrics.

Kept flat on purpose, nanoGPT-style: :func:`run` joins the process groups,
:func:`_run` builds, resumes, then loops: step, log, evaluate, save. The pieces
live next door: :mod:`oases.runtime.build` (model, engine, optimizer, reducer,
pipeline), :mod:`oases.runtime.step` (one step, evaluation),
:mod:`oases.runtime.resume` (checkpoint, init_from, eval.only).
"""

from __future__ import annotations

import datetime
import gc
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from oases.config import Config
from oases.config.schema import resolve_precision
from oases.errors import CollectiveError, UserError
from oases.parallel.groups import (ParallelContext, backend_for, init_distributed, init_kwargs,
                                   join_world, pick_device)
from oases.parallel.nccl_env import error_handling, kernel_order, prepare_backend
from oases.parallel.nccl_watch import watch_run
from oases.planner.online import resolve_layout
from oases.runtime import checkpoint as ckpt
from oases.runtime.build import throwaway_step
from oases.runtime.resume import model_shape, trim_metrics
from oases.runtime.run import Run, build_run
from oases.runtime.run_dir import RunLock, check_shared
from oases.runtime.step import evaluate, train_step

__all__ = ["run", "train", "build_run", "Run", "collective_failure", "train_step", "evaluate", "model_shape", "check_out_dir", "trim_metrics",
           "with_device_precision", "use_tf32"]


def with_device_precision(cfg: Config, device: torch.device) -> Config:
    """``cfg`` with ``train.precision`` resolved for ``device`` (``auto``: bf16 on CUDA,
    fp32 elsewhere): what the run logs, saves and plans with (the same config if
    nothing changes)."""
    precision = resolve_precision(cfg.train.precision, device.type)
    if precision == cfg.train.precision:
        return cfg
    return cfg.with_changes({"train.precision": precision})


def use_tf32(device: torch.device) -> None:
    """On CUDA, fp32 matmuls and convolutions run on TF32 tensor cores (10-bit mantissa,
    fp32 range and accumulation): fp32 runs, and the parts of bf16 runs that autocast
    leaves in fp32, at several times the plain fp32 rate. The MFU of an fp32 run is
    taken against the TF32 peak accordingly (:mod:`oases.runtime.metrics`)."""
    if device.type != "cuda":
        return
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


def check_out_dir(cfg: Config) -> None:
    """Refuse an out_dir that is a file, unwritable, or holds another run (unless resuming)."""
    out = Path(cfg.out_dir)
    if out.exists() and not out.is_dir():
        raise UserError(f"out_dir {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else e.strerror
        raise UserError(f"out_dir {out} cannot be created: {why}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(f"out_dir {out} is not writable")
    if cfg.resume == "none" and not cfg.eval.only:  # eval.only only appends to metrics.jsonl
        clash = [p for p in ("metrics.jsonl", "checkpoints") if (out / p).exists()]
        if clash:
            raise UserError(f"out_dir {out} already holds a run ({', '.join(clash)}); "
                            f"pass resume=auto to continue it or choose another out_dir")


def _init_torchelastic_attempt(cfg: Config) -> None:
    """Under ``torchrun`` the workers share the agent's rendezvous TCPStore, which lives
    across ``--max-restarts`` restarts: a restarted group would read the dead group's
    gloo/NCCL addresses from it and fail to connect (pytorch/pytorch#135712). Give each
    restart attempt its own key namespace. Single node only (one agent, so one restart
    count); multi-node runs set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead."""
    env = os.environ
    if (dist.is_initialized() or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or env.get("LOCAL_WORLD_SIZE") != env.get("WORLD_SIZE")):
        return
    dev = pick_device(cfg.parallel.device)
    backend = backend_for(dev, cfg.parallel.backend)
    if backend == "nccl" and dev.type != "cuda":
        return  # init_distributed refuses it with a clear message
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    prepare_backend(backend)
    dist.init_process_group(backend, store=dist.PrefixStore(f"oases/attempt_{attempt}/", store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                            timeout=timeout, **init_kwargs(backend, dev))


def run(cfg: Config) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # before any process group: a bad config fails fast on every rank; from here on the
    # config is read-only (what the run derives lives in its TrainState)
    cfg = cfg.validate(world).freeze()
    # the device is known from here (no process group needed): everything after this,
    # the layout search and the planner included, sees the precision the run uses
    order = kernel_order()  # before the CUDA context exists (pick_device creates it)
    device = pick_device(cfg.parallel.device)
    cfg = with_device_precision(cfg, device)
    # NCCL's error handling and flight recorder, before any process group (nccl_env)
    backend = backend_for(device, cfg.parallel.backend)
    prepare_backend(backend, str(Path(cfg.out_dir) / "nccl_trace"))
    cuda_note = "" if device.type != "cuda" else \
        f"{order}; {error_handling()}" if backend == "nccl" else order
    use_tf32(device)
    main = int(os.environ.get("RANK", "0")) == 0
    # rank 0 holds the run directory's lock from the run's first write into it to its end
    lock = RunLock(cfg.out_dir)
    try:
        if main:
            lock.refuse_if_held()  # a double launch stops here, before any work
        if cfg.parallel.searches_layout:  # before the run's groups
            # deferred: the search and its solver (pulp) load only for a run that searches
            from oases.planner import auto_layout
            if main:
                check_out_dir(cfg)
                lock.acquire()  # the search writes plan.yaml
            searched, par = cfg, cfg.parallel
            cfg = auto_layout.choose_layout(searched, world, lambda: (
                _init_torchelastic_attempt(searched),
                join_world(par.device, par.backend, par.timeout_s)), throwaway_step)
        layout = resolve_layout(cfg, world) if cfg.parallel.pp > 1 else None
        if main:
            check_out_dir(cfg)
        _init_torchelastic_attempt(cfg)
        ctx = init_distributed(cfg.parallel.tp, cfg.parallel.device, cfg.parallel.backend,
                               cfg.parallel.timeout_s, layout, bool(cfg.model.tie_embeddings),
                               cfg.model.n_kv_heads, cfg.parallel.nccl_high_priority_tp,
                               cfg.parallel.cp)
        _run_in_world(cfg, ctx, lock, cuda_note)
    finally:
        lock.release()


def _claimer(cfg: Config, ctx: ParallelContext, lock: RunLock):
    """``claim()``: the run's first write into out_dir comes after it (collective, the
    first call only): rank 0 takes the lock (a run that fails on bad input before it
    leaves out_dir as it was), and every rank checks that it sees rank 0's lock file."""
    done = []

    def claim() -> None:
        if done:
            return
        done.append(True)
        if ctx.is_main:
            lock.acquire()
        check_shared(cfg.out_dir, lock.token if ctx.is_main else None)
    return claim


def _run_in_world(cfg: Config, ctx: ParallelContext, lock: RunLock,
                  cuda_note: str = "") -> None:
    failed = False
    # NCCL: a hung collective ends the run at once, not after the watchdog's sleeps
    watch = watch_run(ctx.rank, cfg.parallel.timeout_s) if dist.get_backend() == "nccl" else None
    try:
        train(cfg, ctx, _claimer(cfg, ctx, lock), cuda_note)
    except BaseException as e:  # DCP's CheckpointException is one; told without importing DCP
        if not ((isinstance(e, RuntimeError) or ckpt.is_dcp_failure(e))
                and collective_failure(e)):
            raise
        failed = True
        raise CollectiveError(
            f"[rank {ctx.rank}] a collective failed or did not complete within "
            f"parallel.timeout_s={cfg.parallel.timeout_s:g}: a peer rank died or hangs "
            f"({ckpt.first_line(ckpt.cause(e), None)})") from e
    finally:
        if watch is not None:
            watch.stop()
        if dist.is_initialized() and failed and dist.get_backend() == "nccl":
            # NCCL's graceful teardown flushes every communicator's work in flight, which
            # waits on the peer that is gone, before the one line is printed: abort
            dist.distributed_c10d._abort_process_group()
        elif dist.is_initialized():
            # the run's model, reducer and engines sit in reference cycles (hooks): freed
            # here, while their groups live, not at interpreter exit, where a gloo work's
            # thread destroyed out of order aborts the process ("terminate called
            # without an active exception") after a run that succeeded
            gc.collect()
            dist.destroy_process_group()


_COMM_FAILURE = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe",
                 "gloo", "nccl", "socket")


def collective_failure(e: BaseException) -> bool:
    """A collective timed out or lost its peer (gloo, NCCL and DCP word it differently)."""
    if ckpt.is_dcp_failure(e):  # DCP wraps each rank's exception
        return any(collective_failure(v[0] if isinstance(v, tuple) else v)
                   for v in e.failures.values())
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(k in text for k in _COMM_FAILURE)


def train(cfg: Config, ctx: ParallelContext, claim: Callable[[], None] = lambda: None,
          cuda_note: str = "") -> None:
    """The run on this rank, in a world already joined (``ctx``): build it once, then
    step, log, evaluate, save and watch for stop signals until ``train.steps``.
    ``claim()`` before the run's first write into out_dir (:func:`_claimer`);
    ``cuda_note``: the start-up line's words on CUDA's and NCCL's settings."""
    # CPU kernels used here are deterministic already (the resume test checks bit-exact
    # curves); torch.use_deterministic_algorithms would cost an inductor import per process.
    run = build_run(cfg, ctx, claim, cuda_note)
    if run is None:  # eval.only: evaluated and recorded
        return
    with run:
        if run.complete:
            run.say_complete()
            return
        for step in range(run.start, cfg.train.steps):
            result = run.step(step)
            done = step + 1
            run.check_finite(done, result)
            run.maybe_log(done, result)
            run.evaluator.maybe_eval(done)
            saved = run.checkpointer.maybe_save(done, run.skipped)
            run.maybe_stop(done, saved)
        run.finish()
