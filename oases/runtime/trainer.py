"""The training loop: config -> groups -> model -> steps -> checkpoints and metrics.

Kept flat on purpose, nanoGPT-style: :func:`run` joins the process groups,
:func:`_run` builds, resumes, then loops: step, log, evaluate, save. The pieces
live next door: :mod:`oases.runtime.build` (model, engine, optimizer, reducer,
pipeline), :mod:`oases.runtime.step` (one step, evaluation),
:mod:`oases.runtime.resume` (checkpoint, init_from, eval.only).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from oases.models import model_stats
from oases.config import Config, save_config
from oases.config.schema import resolve_precision
from oases.errors import CollectiveError, NonFiniteError, Preempted, UserError
from oases.parallel.comm import NoopCollectives
from oases.parallel.compile import CompileLog
from oases.parallel.groups import (ParallelContext, backend_for, init_distributed, init_kwargs,
                                   join_world, pick_device)
from oases.parallel.nccl_env import error_handling, kernel_order, prepare_backend
from oases.parallel.timing import IntervalTimer
from oases.planner import auto_layout
from oases.planner.calibrate import time_throwaway
from oases.planner.online import resolve_layout, resolve_plan
from oases.runtime import checkpoint as ckpt
from oases.runtime import sub_batches
from oases.runtime.build import model_for, seed_tracker, throwaway_step, training_for
from oases.runtime.data import TrainBatches, ValBatches
from oases.runtime.metrics import MetricsLogger
from oases.runtime.observe import comm_clock_for, layout_name, run_config
from oases.runtime.optim import lr_at
from oases.runtime.preempt import StopSignals, host_group
from oases.runtime.profiling import StepProfiler
from oases.runtime.resume import (eval_only, layout_meta, load_init_from, model_section,
                                  model_shape, resume, trim_metrics)
from oases.runtime.run_dir import RunLock, check_shared
from oases.runtime.step import evaluate, train_step

__all__ = ["run", "train", "train_step", "evaluate", "model_shape", "check_out_dir", "trim_metrics",
           "for_device", "use_tf32"]


def for_device(cfg: Config, device: torch.device) -> Config:
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
    cfg = for_device(cfg, device)
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
        if auto_layout.wanted(cfg):  # the layout itself is searched: before the run's groups
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
                               cfg.model.n_kv_heads, cfg.parallel.nccl_high_priority_tp)
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
    try:
        _run(cfg, ctx, _claimer(cfg, ctx, lock), cuda_note)
    except (RuntimeError, ckpt.CheckpointException) as e:
        if not _collective_failure(e):
            raise
        failed = True
        raise CollectiveError(
            f"[rank {ctx.rank}] a collective failed or did not complete within "
            f"parallel.timeout_s={cfg.parallel.timeout_s:g}: a peer rank died or hangs "
            f"({ckpt.first_line(ckpt.cause(e), None)})") from e
    finally:
        if dist.is_initialized() and failed and dist.get_backend() == "nccl":
            # NCCL's graceful teardown flushes every communicator's work in flight, which
            # waits on the peer that is gone, before the one line is printed: abort
            dist.distributed_c10d._abort_process_group()
        elif dist.is_initialized():
            dist.destroy_process_group()


_COMM_FAILURE = ("timed out", "timeout", "connection reset", "connection closed", "broken pipe",
                 "gloo", "nccl", "socket")


def _collective_failure(e: BaseException) -> bool:
    """A collective timed out or lost its peer (gloo, NCCL and DCP word it differently)."""
    if isinstance(e, ckpt.CheckpointException):  # DCP wraps each rank's exception
        return any(_collective_failure(v[0] if isinstance(v, tuple) else v)
                   for v in e.failures.values())
    if isinstance(e, dist.DistError):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(k in text for k in _COMM_FAILURE)


def train(cfg: Config, ctx: ParallelContext) -> None:
    """The run on this rank, in a world already joined (``ctx``): what :func:`run` does
    after the process groups exist; tests and benchmarks drive whole runs through it."""
    _run(cfg, ctx)


def _run(cfg: Config, ctx: ParallelContext, claim: Callable[[], None] = lambda: None,
         cuda_note: str = "") -> None:
    """The run on this rank; ``claim()`` before its first write into out_dir
    (:func:`_claimer`); ``cuda_note``: the start-up line's words on CUDA's and NCCL's
    settings (empty off CUDA)."""
    # CPU kernels used here are deterministic already (the resume test checks bit-exact
    # curves); torch.use_deterministic_algorithms would cost an inductor import per process.
    out = Path(cfg.out_dir)
    tracker = seed_tracker(cfg, ctx)
    # Data first: a bad data file is a user error, found before the model is built. A
    # pipeline stage's replica takes its share of the pipeline's micro-batch.
    mbs = cfg.pipeline_batch // ctx.dp if ctx.layout is not None else cfg.train.micro_batch_size
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, mbs,
                           ctx.dp_rank, ctx.dp, cfg.seed)
    val = None
    if cfg.data.val_path:
        val = ValBatches(cfg.data.val_path, cfg.data.dtype, cfg.model.seq_len,
                         cfg.model.vocab_size, mbs, ctx.dp_rank, ctx.dp, cfg.eval.max_batches)
    degrees = None
    if ctx.layout is None:  # per-block TP degrees, or None: all at tp
        if cfg.parallel.plan == "auto":
            claim()  # the planner writes plan.yaml and profile.json
        planned = cfg
        cfg, degrees = resolve_plan(planned, ctx,
                                    lambda d, n: time_throwaway(
                                        throwaway_step(planned, ctx, d), ctx.device, n))
        if degrees is not None and ctx.is_main:
            print(f"plan: per-block TP degrees {degrees}", flush=True)
    cfg, split = sub_batches.resolve(cfg, ctx, degrees)  # parallel.sub_batches=auto: decided
    par = cfg.parallel
    if ctx.layout is not None and ctx.is_main:
        print(f"pipeline: {ctx.layout.describe()} | {par.pp_schedule}, "
              f"{cfg.train.grad_accum} micro-batches of {cfg.pipeline_batch} sequences",
              flush=True)
    model = model_for(cfg, ctx, tracker, degrees, None if cfg.model.init_from else cfg.seed)
    if cfg.model.init_from:  # every parameter is overwritten (no random init above)
        load_init_from(cfg, ctx, model)
    if cfg.data.reset_attention_at_eos:  # attention stays inside documents
        model.attend_within_documents(batches.eos_id)
    state = training_for(cfg, ctx, model, tracker)
    opt, reducer = state.opt, state.reducer

    if not reducer.shards.sharded and (par.zero or reducer.norm_by_terms) and ctx.is_main:
        print("parallel.zero: no gradient group of this layout has more than one rank "
              "(dp = 1, no replicated blocks): nothing is sharded", flush=True)

    def run_eval() -> float:
        return evaluate(model, val, cfg, ctx, state.pipe)

    if cfg.eval.only:
        eval_only(cfg, ctx, model, opt, val, run_eval, reducer.shards, claim)
        return

    start, skipped, resumed = 0, 0, False  # skipped: non-finite steps left out
    if cfg.resume == "auto":
        meta = resume(cfg, ctx, model, opt, batches, tracker, reducer.shards)
        if meta is not None:
            start, skipped, resumed = meta["step"], int(meta.get("skipped_steps", 0)), True
    claim()  # everything above only read
    if ctx.is_main:
        if cfg.resume == "auto":  # records past the checkpoint (or of a run never saved)
            trim_metrics(cfg.out_dir, start)
        save_config(cfg, out / "config.yaml")

    tokens_per_step = cfg.global_batch_size * cfg.model.seq_len
    n_params, flops_per_token = model_stats(cfg.model, cfg.padded_vocab_size)
    logger = MetricsLogger(cfg.out_dir, ctx.is_main, cfg.train.steps, flops_per_token,
                           ctx.world_size, ctx.device, cfg.wandb,
                           run_config(cfg, ctx, n_params, flops_per_token, degrees),
                           resume=resumed, precision=cfg.train.precision,
                           tensorboard=cfg.metrics.tensorboard, start_step=start,
                           group=layout_name(cfg, ctx))
    if ctx.is_main:
        layout = f"pp {ctx.pp} x " if ctx.pp > 1 else ""
        print(f"oases: {cfg.model.name} ({cfg.model.arch}, {n_params / 1e6:.1f}M params) | "
              f"world {ctx.world_size} = {layout}dp {cfg.dp} x tp {par.tp} | {ctx.device.type} | "
              f"schedule {par.schedule}, recompute {par.recompute}"
              f"{f', {split}' if split else ''}"
              f"{', sequence parallel' if par.sequence_parallel else ''}"
              f"{f', zero {par.zero}' if par.zero else ''} | "
              f"global batch {cfg.global_batch_size} x {cfg.model.seq_len} tokens | "
              f"{cfg.train.precision} | out_dir {out}", flush=True)
        if cuda_note:
            print(f"cuda: {cuda_note}", flush=True)

    saver = ckpt.AsyncSaver(par.timeout_s) if cfg.checkpoint.async_save else None

    def save(step: int):
        # never replace a good checkpoint by a broken one
        if not ckpt.all_finite(model, ctx, reducer.shards):
            if ctx.is_main:
                print(f"step {step}: the weights are not finite; checkpoint not saved",
                      flush=True)
            return None
        meta = {"step": step, "data": batches.state_dict(), "model_shape": model_shape(cfg),
                "model": model_section(cfg), "corpus": batches.corpus, **layout_meta(ctx),
                "padded_vocab_size": cfg.padded_vocab_size, "skipped_steps": skipped,
                "sub_batches": cfg.sub_batches}
        # each rank writes what it owns (ZeRO: its ranges of the buckets), nothing gathered
        write = ckpt.save if saver is None else saver.save
        path = write(cfg.out_dir, step, model, opt, ctx, meta, tracker.get_states(),
                     cfg.checkpoint.keep, shards=reducer.shards)
        if ctx.is_main:
            print(f"{'saved' if saver is None else 'saving (in the background)'} checkpoint "
                  f"{path}", flush=True)
        return path

    if start >= cfg.train.steps:
        if ctx.is_main:
            print(f"the run in {out} is complete (step {start}/{cfg.train.steps}); "
                  f"raise train.steps to continue it", flush=True)
        logger.close()
        return
    step_times: list[float] = []
    # Step times on the device's timeline: on CUDA the host runs ahead of the device, so
    # a host clock would need a synchronize around every step; CUDA events need none and
    # are read (one wait) only at log steps.
    step_clock = IntervalTimer(ctx.device)
    # Exposed and hidden TP communication, timed on the last step of each log interval
    # only: the clock stamps every wait (CUDA events on CUDA, a completion callback on the
    # CPU), host work that the other steps are spared.
    comm_clock = comm_clock_for(model, ctx) if cfg.metrics.comm_clock else None

    def logged(done: int) -> bool:
        return done % cfg.train.log_interval == 0 or done == cfg.train.steps
    window = cfg.profile.window()
    if par.trace and (window is None or window[1] <= start):  # one step after warm-up
        window = (min(start + 3, cfg.train.steps),) * 2
    prof = StepProfiler(window, cfg.out_dir, ctx.rank, ctx.device,
                        cfg.profile.memory_snapshot, view=par.trace)
    noop = (NoopCollectives(ctx.tp_group) if par.tp_comm_noop and ctx.tp > 1
            else contextlib.nullcontext())
    if par.tp_comm_noop and ctx.is_main:
        print("parallel.tp_comm_noop=true: TP collectives are skipped; losses are NOT valid "
              "(timing only)", flush=True)
    compiled = CompileLog() if par.compile else None
    stop = StopSignals(host_group())
    try:
        noop.__enter__()
        stop.__enter__()
        if ctx.device.type == "cuda":  # the run's peak, not start-up's or the planner's
            torch.cuda.reset_peak_memory_stats(ctx.device)
        for step in range(start, cfg.train.steps):
            t0 = step_clock.start()
            lr = lr_at(step, cfg.train)
            prof.before(step + 1)
            t_host = time.perf_counter() if compiled is not None and step == start else 0.0
            timed = comm_clock is not None and logged(step + 1)
            with comm_clock if timed else contextlib.nullcontext():
                loss, norm = train_step(state, batches, lr)
            step_clock.stop(t0)
            if compiled is not None and step == start and ctx.is_main:
                print(compiled.first_step(time.perf_counter() - t_host), flush=True)
            if prof.after(step + 1) is not None and ctx.is_main:
                view = f" and {out}/trace_rank*.json" if par.trace else ""
                print(f"wrote {out}/profile/rank*.json{view} (steps {window[0]}-{window[1]})",
                      flush=True)
            if saver is not None:
                saver.poll()
            done = step + 1
            if not (math.isfinite(loss) and math.isfinite(norm)):  # train_step did not update
                if cfg.train.on_nonfinite == "stop":
                    if saver is not None:  # the good checkpoint in flight is published first
                        saver.close()
                    last = ckpt.latest_name(cfg.out_dir) or "none"
                    raise NonFiniteError(
                        f"step {done}: non-finite loss ({loss}) or gradient norm ({norm}); "
                        f"stopped before updating the weights (train.on_nonfinite=stop); last "
                        f"checkpoint: {last}")
                skipped += 1
                if ctx.is_main:
                    print(f"step {done}: non-finite loss ({loss}) or gradient norm ({norm}); "
                          f"step skipped ({skipped} so far, train.on_nonfinite=skip)", flush=True)
            if logged(done):
                taken = step_clock.take_each()  # the steps since the last log
                step_times += taken
                dt = sum(taken) / len(taken)  # the interval's mean, so its throughput
                recent = step_times[-10:]
                eta = sum(recent) / len(recent) * (cfg.train.steps - done)
                extra = {"skipped_steps": skipped}
                if ctx.pp > 1:
                    extra["pipeline_bubble"] = state.stats.bubble
                if reducer.shards.store is not None:  # ZeRO-3: rank 0's wait for all-gathers
                    extra["zero_gather_wait_s"] = reducer.shards.store.take_wait() / len(taken)
                logger.log(done, loss, lr, norm, dt, tokens_per_step, step_times_left=eta,
                           extra=extra, comm=comm_clock and comm_clock.per_step(1))
                again = compiled.since(done) if compiled is not None else None
                if again and ctx.is_main:
                    print(again, flush=True)
            if val is not None and cfg.eval.interval and done % cfg.eval.interval == 0:
                logger.log_eval(done, run_eval())
            saved = None
            if cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0:
                saved = save(done)
            sig = stop.agreed()
            if sig is not None and done < cfg.train.steps:
                stop.finish()
                saved = saved or save(done)
                if saver is not None:
                    saver.wait()
                raise Preempted(f"{sig} received: stopped after step {done}/{cfg.train.steps}; "
                                f"checkpoint {saved or 'not saved (non-finite weights)'}; "
                                f"resume=auto continues")
        stop.finish()
        final = cfg.train.steps
        if val is not None and not (cfg.eval.interval and final % cfg.eval.interval == 0) \
                and start < final:
            logger.log_eval(final, run_eval())
        if cfg.checkpoint.save_final and start < final and not (
                cfg.checkpoint.interval and final % cfg.checkpoint.interval == 0):
            save(final)
        if saver is not None:
            saver.wait()
    finally:
        if saver is not None:  # an error or Ctrl-C: the save in flight is still published
            saver.close()
        stop.__exit__(None, None, None)
        noop.__exit__(None, None, None)
        prof.close()
        logger.close()
