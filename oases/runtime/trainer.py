"""The training loop: config -> groups -> model -> optimizer -> steps.

Kept flat on purpose: ``run`` sets things up and loops, ``train_step`` is one
optimizer step (micro-batches, DP reduction, clipping, AdamW), ``evaluate`` the
validation loss.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from models import build_model
from oases.config import Config, save_config
from oases.errors import CollectiveError, NonFiniteError, UserError
from oases.parallel.comm import NoopCollectives, all_reduce
from oases.parallel.groups import ParallelContext, init_distributed
from oases.parallel.random import TPRNGTracker
from oases.runtime import checkpoint as ckpt
from oases.runtime.data import TrainBatches, ValBatches
from oases.runtime.dp import GradReducer
from oases.runtime.metrics import MetricsLogger
from oases.parallel.reshard import grad_group_of
from oases.runtime.optim import build_optimizer, clip_grads, lr_at
from oases.runtime.planning import resolve_plan
from oases.schedule.engines import MegatronSchedule, build_schedule
from oases.schedule.trace import Tracer


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


def model_shape(cfg: Config) -> dict:
    return {k: getattr(cfg.model, k) for k in ckpt.SHAPE_KEYS}


def autocast(cfg: Config, ctx: ParallelContext):
    if cfg.train.precision == "bf16":
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(model, batches: TrainBatches, opt, reducer: GradReducer, cfg: Config,
               ctx: ParallelContext, lr: float, schedule=None) -> tuple[float, float]:
    """One optimizer step over ``grad_accum`` micro-batches; returns (loss, grad_norm),
    the loss averaged over micro-batches and DP ranks.

    A non-finite loss or gradient norm leaves the step out: no optimizer update (weights
    and Adam state untouched) and zeroed gradients; the caller sees the non-finite
    values and decides (``train.on_nonfinite``). Every rank decides alike: the norm is
    reduced over TP and identical over DP after the DP reduction, the loss is reduced
    over DP and identical over TP (the vocab-parallel loss reduces it)."""
    for g in opt.param_groups:
        g["lr"] = lr
    reducer.zero_grad()
    n = cfg.train.grad_accum
    schedule = schedule or MegatronSchedule()
    total = torch.zeros((), device=ctx.device)
    for i in range(n):
        x, y = batches.next_batch()
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        if i == n - 1:
            reducer.arm()  # DP all-reduce overlaps the last backward
        total += schedule.forward_backward(model, x, y, 1.0 / n, amp=lambda: autocast(cfg, ctx))
    reducer.finish()
    norm = clip_grads(model, cfg.train.grad_clip, ctx.tp_group)
    total /= n
    if ctx.dp > 1:
        all_reduce(total, ctx.dp_group)
        total /= ctx.dp
    loss = float(total)
    if math.isfinite(loss) and math.isfinite(norm):
        opt.step()
    else:
        reducer.zero_grad()
    return loss, norm


def _build_model(cfg: Config, ctx: ParallelContext, tracker: TPRNGTracker,
                 degrees: Optional[list[int]], seed: Optional[int]):
    par = cfg.parallel
    return build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker,
                       par.recompute if par.schedule == "megatron" else "none",
                       seed=seed, device=ctx.device, degrees=degrees,
                       degree_groups=ctx.degree_groups() if degrees is not None else None)


def _build_training(cfg: Config, ctx: ParallelContext, model, tracker: TPRNGTracker, tracer):
    """Schedule, optimizer and gradient reducer of ``model`` (put in training mode)."""
    par = cfg.parallel
    schedule = build_schedule(par.schedule, ctx.tp_group, par.sub_batches, par.recompute,
                              tracker, tracer)
    model.train()
    opt = build_optimizer(model, cfg.train, ctx.device)
    reducer = GradReducer(model, ctx.dp_group, par.dp_bucket_mb,
                          group_of=grad_group_of(ctx, ctx.tp))
    return schedule, opt, reducer


class _FixedBatches:
    """One random micro-batch, over and over (timing only)."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        ids = torch.randint(0, cfg.model.vocab_size,
                            (cfg.train.micro_batch_size, cfg.model.seq_len + 1), generator=g)
        self.x, self.y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def next_batch(self):
        return self.x, self.y


def time_steps(cfg: Config, ctx: ParallelContext, degrees: Optional[list[int]], steps: int,
               warmup: int = 2) -> float:
    """Median wall time of ``steps`` real training steps (after ``warmup``) with these
    per-block degrees (None: every block at tp), on a throwaway model fed one random
    micro-batch; the slowest rank's figure. Collective: every rank calls it. It draws
    random numbers: callers that must not be affected fork the random state
    (``resolve_plan`` does)."""
    tracker = TPRNGTracker(ctx.device)
    tracker.seed(cfg.seed, ctx.tp_rank, ctx.dp_rank)
    model = _build_model(cfg, ctx, tracker, degrees, cfg.seed)
    schedule, opt, reducer = _build_training(cfg, ctx, model, tracker, None)
    batches = _FixedBatches(cfg, ctx.device)
    times = []
    for i in range(warmup + steps):
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        t0 = time.perf_counter()
        train_step(model, batches, opt, reducer, cfg, ctx, cfg.train.lr, schedule)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del model, opt, reducer
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    res = torch.tensor([statistics.median(times)], dtype=torch.float64, device=ctx.device)
    if dist.is_initialized():
        dist.all_reduce(res, op=dist.ReduceOp.MAX)
    return float(res)


@torch.no_grad()
def evaluate(model, val: ValBatches, cfg: Config, ctx: ParallelContext) -> float:
    """Mean loss over the val file's first windows, contiguous and in order."""
    model.eval()
    s = torch.zeros(2, device=ctx.device)  # (sum of losses, batches)
    for x, y in val:
        with autocast(cfg, ctx):
            s[0] += model(x.to(ctx.device), y.to(ctx.device)).float()
        s[1] += 1
    if ctx.dp > 1:
        all_reduce(s, ctx.dp_group)
    model.train()
    return float(s[0] / s[1])


def _trim_metrics(out_dir: str, step: int) -> None:
    """After a resume from step N, drop records of steps > N written before the crash."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return
    keep = []
    for ln in path.read_text().splitlines():
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError:  # a line torn by the crash
            continue
        if isinstance(rec, dict) and rec.get("step", 0) <= step:
            keep.append(ln)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)


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
    import datetime

    from oases.parallel.groups import pick_device

    dev = pick_device(cfg.parallel.device)
    backend = cfg.parallel.backend
    if backend == "auto":
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if backend == "nccl" and dev.type != "cuda":
        return  # init_distributed refuses it with a clear message
    timeout = datetime.timedelta(seconds=cfg.parallel.timeout_s)
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    attempt = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"oases/attempt_{attempt}/", store),
                            rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                            timeout=timeout)


def run(cfg: Config) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg.validate(world)  # before any process group: bad config fails fast on every rank
    if int(os.environ.get("RANK", "0")) == 0:
        check_out_dir(cfg)
    _init_torchelastic_attempt(cfg)
    ctx = init_distributed(cfg.parallel.tp, cfg.parallel.device, cfg.parallel.backend,
                           cfg.parallel.timeout_s)
    try:
        _run(cfg, ctx)
    except (RuntimeError, ckpt.CheckpointException) as e:
        if not _collective_failure(e):
            raise
        raise CollectiveError(
            f"[rank {ctx.rank}] a collective failed or did not complete within "
            f"parallel.timeout_s={cfg.parallel.timeout_s:g}: a peer rank died or hangs "
            f"({_first_line(e)})") from e
    finally:
        if dist.is_initialized():
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


def _first_line(e: BaseException) -> str:
    for exc in (e, *(v[0] if isinstance(v, tuple) else v
                     for v in (getattr(e, "failures", None) or {}).values())):
        if not isinstance(exc, ckpt.CheckpointException):
            lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
            return lines[0] if lines else type(exc).__name__
    return type(e).__name__


def _run(cfg: Config, ctx: ParallelContext) -> None:
    # CPU kernels used here are deterministic already (the resume test checks bit-exact
    # curves); torch.use_deterministic_algorithms would cost an inductor import per process.
    out = Path(cfg.out_dir)
    tracker = TPRNGTracker(ctx.device)
    tracker.seed(cfg.seed, ctx.tp_rank, ctx.dp_rank)

    # Data first: a bad data file is a user error, found before the model is built.
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp, cfg.seed)
    val = None
    if cfg.data.val_path:
        val = ValBatches(cfg.data.val_path, cfg.data.dtype, cfg.model.seq_len,
                         cfg.model.vocab_size, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp,
                         cfg.eval.max_batches)
    par = cfg.parallel
    # per-block TP degrees, or None: all at tp
    degrees = resolve_plan(cfg, ctx, lambda d, n: time_steps(cfg, ctx, d, n))
    if degrees is not None and ctx.is_main:
        print(f"plan: per-block TP degrees {degrees}", flush=True)
    model = _build_model(cfg, ctx, tracker, degrees, None if cfg.model.init_from else cfg.seed)
    if cfg.model.init_from:  # every parameter is overwritten (no random init above)
        existing = ckpt.latest_checkpoint(cfg.out_dir) if cfg.resume == "auto" else None
        if existing is not None:  # resume wins: the checkpoint loaded below overwrites all
            if ctx.is_main:
                print(f"model.init_from={cfg.model.init_from} not loaded: resume=auto "
                      f"continues from {existing}", flush=True)
        else:
            from models.hf import load_hf_weights
            from oases.hf_config import hf_dir_of

            load_hf_weights(model, hf_dir_of(cfg.model.init_from), ctx.tp_rank, ctx.tp)
            if ctx.is_main:
                print(f"model.init_from: loaded {cfg.model.init_from}", flush=True)
    tracer = Tracer(ctx.rank) if par.trace else None
    schedule, opt, reducer = _build_training(cfg, ctx, model, tracker, tracer)

    if cfg.eval.only:
        # Validation loss of the loaded weights (resume=auto's checkpoint, else init_from
        # or the seeded init), then exit: one metrics.jsonl record is all that is written.
        step, src = 0, cfg.model.init_from or f"seed {cfg.seed}"
        path = ckpt.latest_checkpoint(cfg.out_dir) if cfg.resume == "auto" else None
        if path is not None:
            step, src = ckpt.load(path, model, opt, ctx, model_shape(cfg))[0]["step"], str(path)
        val_loss = evaluate(model, val, cfg, ctx)
        if ctx.is_main:
            print(f"eval.only: val_loss {val_loss:.4f} | step {step} | weights {src} | "
                  f"{len(val)} batches x {cfg.train.micro_batch_size * ctx.dp} x "
                  f"{cfg.model.seq_len} tokens of {cfg.data.val_path}", flush=True)
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "val_loss": val_loss}) + "\n")
        return

    start = 0
    skipped = 0  # steps left out for a non-finite loss or gradient (train.on_nonfinite=skip)
    resumed = False
    if cfg.resume == "auto":
        path = ckpt.latest_checkpoint(cfg.out_dir)
        if path is None:
            if ctx.is_main:
                print(f"resume=auto: no checkpoint in {out}; starting from step 0", flush=True)
                _trim_metrics(cfg.out_dir, 0)  # records of a run that crashed before saving
        else:
            meta, rng = ckpt.load(path, model, opt, ctx, model_shape(cfg))
            start = meta["step"]
            skipped = int(meta.get("skipped_steps", 0))
            batches.load_state_dict(meta["data"])
            if rng is not None:
                tracker.set_states(rng)
            resumed = True
            if ctx.is_main:
                print(f"resumed from {path} at step {start}", flush=True)
                _trim_metrics(cfg.out_dir, start)
    if ctx.is_main:
        save_config(cfg, out / "config.yaml")

    tokens_per_step = cfg.global_batch_size * cfg.model.seq_len
    logger = MetricsLogger(cfg.out_dir, ctx.is_main, cfg.train.steps, model.flops_per_token(),
                           ctx.world_size, ctx.device, cfg.wandb, cfg.to_dict(), resume=resumed)
    if ctx.is_main:
        n = model.num_params()
        print(f"oases: {cfg.model.name} ({cfg.model.arch}, {n / 1e6:.1f}M params) | "
              f"world {ctx.world_size} = dp {ctx.dp} x tp {ctx.tp} | {ctx.device.type} | "
              f"schedule {cfg.parallel.schedule}, recompute {cfg.parallel.recompute} | "
              f"global batch {cfg.global_batch_size} x {cfg.model.seq_len} tokens | "
              f"{cfg.train.precision} | out_dir {out}", flush=True)

    def save(step: int) -> None:
        if not ckpt.all_finite(model, ctx):  # never replace a good checkpoint by a broken one
            if ctx.is_main:
                print(f"step {step}: the weights are not finite; checkpoint not saved",
                      flush=True)
            return
        meta = {"step": step, "data": batches.state_dict(), "model_shape": model_shape(cfg),
                "world_size": ctx.world_size, "tp": ctx.tp, "dp": ctx.dp,
                "padded_vocab_size": cfg.padded_vocab_size, "skipped_steps": skipped}
        path = ckpt.save(cfg.out_dir, step, model, opt, ctx, meta, tracker.get_states(),
                         cfg.checkpoint.keep)
        if ctx.is_main:
            print(f"saved checkpoint {path}", flush=True)

    if start >= cfg.train.steps:
        if ctx.is_main:
            print(f"the run in {out} is complete (step {start}/{cfg.train.steps}); "
                  f"raise train.steps to continue it", flush=True)
        logger.close()
        return
    has_val = val is not None
    step_times: list[float] = []
    noop = (NoopCollectives(ctx.tp_group) if cfg.parallel.tp_comm_noop and ctx.tp > 1
            else contextlib.nullcontext())
    if cfg.parallel.tp_comm_noop and ctx.is_main:
        print("parallel.tp_comm_noop=true: TP collectives are skipped; losses are NOT valid "
              "(timing only)", flush=True)
    try:
        noop.__enter__()
        for step in range(start, cfg.train.steps):
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            t0 = time.perf_counter()
            lr = lr_at(step, cfg.train)
            traced = tracer is not None and step == min(start + 2, cfg.train.steps - 1)
            if traced:  # trace one step after warm-up
                tracer.events.clear()
                tracer.t0 = time.perf_counter()
            with tracer if traced else contextlib.nullcontext():
                loss, norm = train_step(model, batches, opt, reducer, cfg, ctx, lr, schedule)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            dt = time.perf_counter() - t0
            step_times.append(dt)
            done = step + 1
            if not (math.isfinite(loss) and math.isfinite(norm)):  # train_step did not update
                last = ckpt.latest_name(cfg.out_dir) or "none"
                if cfg.train.on_nonfinite == "stop":
                    raise NonFiniteError(
                        f"step {done}: non-finite loss ({loss}) or gradient norm ({norm}); "
                        f"stopped before updating the weights (train.on_nonfinite=stop); last "
                        f"checkpoint: {last}")
                skipped += 1
                if ctx.is_main:
                    print(f"step {done}: non-finite loss ({loss}) or gradient norm ({norm}); "
                          f"step skipped ({skipped} so far, train.on_nonfinite=skip)", flush=True)
            if traced:
                tracer.save(out / f"trace_rank{ctx.rank}.json")
                if ctx.is_main:
                    print(f"wrote {out}/trace_rank*.json (step {done})", flush=True)
                tracer = schedule.tracer = None
            if done % cfg.train.log_interval == 0 or done == cfg.train.steps:
                recent = step_times[-10:]
                eta = sum(recent) / len(recent) * (cfg.train.steps - done)
                logger.log(done, loss, lr, norm, dt, tokens_per_step, step_times_left=eta,
                           extra={"skipped_steps": skipped})
            if has_val and cfg.eval.interval and done % cfg.eval.interval == 0:
                logger.log_eval(done, evaluate(model, val, cfg, ctx))
            if cfg.checkpoint.interval and done % cfg.checkpoint.interval == 0:
                save(done)
        final = cfg.train.steps
        if has_val and not (cfg.eval.interval and final % cfg.eval.interval == 0) and start < final:
            logger.log_eval(final, evaluate(model, val, cfg, ctx))
        if cfg.checkpoint.save_final and start < final and not (
                cfg.checkpoint.interval and final % cfg.checkpoint.interval == 0):
            save(final)
    finally:
        noop.__exit__(None, None, None)
        logger.close()
