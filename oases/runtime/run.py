"""A training run on this rank, built once: :func:`build_run` makes the :class:`Run` (state,
data, logger, checkpointer, evaluator, profiler, stop signals); the loop in
:func:`oases.runtime.trainer.train` drives it. Each component decides its own timing
(``maybe_save(step)``, ``maybe_eval(step)``, ``maybe_log(...)``), and the run enters all
of them through one :class:`~contextlib.ExitStack`."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import torch

from oases.config import Config, save_config
from oases.errors import NonFiniteError, Preempted
from oases.models import model_stats
from oases.parallel.comm import NoopCollectives
from oases.parallel.compile import CompileLog
from oases.parallel.groups import ParallelContext
from oases.parallel.timing import IntervalTimer
from oases.planner.calibrate import time_throwaway
from oases.planner.online import resolve_plan
from oases.runtime import checkpoint as ckpt
from oases.runtime import sub_batches
from oases.runtime.build import build_rank_model, seed_tracker, throwaway_step, build_train_state
from oases.runtime.checkpointer import Checkpointer
from oases.runtime.cp_data import CpShards
from oases.runtime.data import TrainBatches, ValBatches
from oases.runtime.evaluator import Evaluator
from oases.runtime.metrics import MetricsLogger
from oases.runtime.observe import comm_clock_for, layout_name, run_config
from oases.runtime.optim import lr_at
from oases.runtime.preempt import StopSignals, host_group
from oases.runtime.profiling import StepProfiler
from oases.runtime.resume import eval_only, load_init_from, resume, trim_metrics
from oases.runtime.state import TrainState
from oases.runtime.step import train_step

__all__ = ["Run", "StepResult", "build_data", "build_run"]


class StepResult(NamedTuple):
    loss: float
    grad_norm: float
    lr: float


@dataclass
class Run:
    """What one rank's training run holds between steps. ``start``: the first step to run
    (a resumed run's checkpoint step); ``skipped``: non-finite steps left out so far."""
    cfg: Config
    ctx: ParallelContext
    state: TrainState
    batches: TrainBatches
    val: Optional[ValBatches]
    logger: MetricsLogger
    checkpointer: Checkpointer
    evaluator: Evaluator
    profiler: StepProfiler
    stop: StopSignals
    start: int = 0
    skipped: int = 0
    step_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        # Step times on the device's timeline: on CUDA the host runs ahead of the device,
        # so a host clock would need a synchronize around every step; CUDA events need
        # none and are read (one wait) only at log steps.
        self.step_clock = IntervalTimer(ctx.device)
        # Exposed and hidden TP communication, timed on the last step of each log interval
        # only: the clock stamps every wait (CUDA events on CUDA, a completion callback on
        # the CPU), host work that the other steps are spared.
        self.comm_clock = comm_clock_for(self.state.model, ctx) if cfg.metrics.comm_clock \
            else None
        self.compiled = CompileLog() if cfg.parallel.compile else None
        self.tokens_per_step = cfg.global_batch_size * cfg.model.seq_len
        self._stack = contextlib.ExitStack()

    @property
    def complete(self) -> bool:
        return self.start >= self.cfg.train.steps

    def __enter__(self) -> "Run":
        par, ctx, stack = self.cfg.parallel, self.ctx, self._stack
        # last in, first out: the logger closes last, after a save in flight is published
        stack.callback(self.logger.close)
        stack.callback(self.profiler.close)
        stack.enter_context(self.checkpointer)
        stack.enter_context(self.stop)
        if par.tp_comm_noop and ctx.tp > 1:
            stack.enter_context(NoopCollectives(ctx.tp_group))
        if ctx.device.type == "cuda":  # the run's peak, not start-up's or the planner's
            torch.cuda.reset_peak_memory_stats(ctx.device)
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)

    def logged(self, step: int) -> bool:
        return step % self.cfg.train.log_interval == 0 or step == self.cfg.train.steps

    def step(self, step: int) -> StepResult:
        """Optimizer step ``step + 1`` (``step`` steps done before it), timed."""
        cfg, ctx, first = self.cfg, self.ctx, step == self.start
        t0 = self.step_clock.start()
        lr = lr_at(step, cfg.train)
        self.profiler.before(step + 1)
        t_host = time.perf_counter() if self.compiled is not None and first else 0.0
        timed = self.comm_clock is not None and self.logged(step + 1)
        with self.comm_clock if timed else contextlib.nullcontext():
            loss, norm = train_step(self.state, self.batches, lr)
        self.step_clock.stop(t0)
        if self.compiled is not None and first and ctx.is_main:
            print(self.compiled.first_step(time.perf_counter() - t_host), flush=True)
        if self.profiler.after(step + 1) is not None and ctx.is_main:
            out, window = cfg.out_dir, self.profiler.window
            view = f" and {out}/trace_rank*.json" if cfg.parallel.trace else ""
            print(f"wrote {out}/profile/rank*.json{view} (steps {window[0]}-{window[1]})",
                  flush=True)
        return StepResult(loss, norm, lr)

    def check_finite(self, step: int, r: StepResult) -> None:
        """A non-finite loss or norm (the step did not update): stop the run
        (``train.on_nonfinite=stop``) or count it as skipped."""
        if math.isfinite(r.loss) and math.isfinite(r.grad_norm):
            return
        said = f"step {step}: non-finite loss ({r.loss}) or gradient norm ({r.grad_norm}); "
        if self.cfg.train.on_nonfinite == "stop":
            self.checkpointer.close()  # the good checkpoint in flight is published first
            last = ckpt.latest_name(self.cfg.out_dir) or "none"
            raise NonFiniteError(f"{said}stopped before updating the weights "
                                 f"(train.on_nonfinite=stop); last checkpoint: {last}")
        self.skipped += 1
        if self.ctx.is_main:
            print(f"{said}step skipped ({self.skipped} so far, train.on_nonfinite=skip)",
                  flush=True)

    def maybe_log(self, step: int, r: StepResult) -> None:
        """At log steps: the interval's mean step time and throughput, to the console,
        metrics.jsonl and W&B."""
        if not self.logged(step):
            return
        taken = self.step_clock.take_each()  # the steps since the last log
        self.step_times += taken
        recent = self.step_times[-10:]
        eta = sum(recent) / len(recent) * (self.cfg.train.steps - step)
        extra = {"skipped_steps": self.skipped}
        if self.ctx.pp > 1:
            extra["pipeline_bubble"] = self.state.stats.bubble
        store = self.state.reducer.ownership.store
        if store is not None:  # ZeRO-3: rank 0's wait for all-gathers
            extra["zero_gather_wait_s"] = store.take_wait() / len(taken)
        ring = self.state.model.cp_clock if self.ctx.cp > 1 else None
        if ring is not None:  # context parallelism: rank 0's wait for ring transfers
            extra["cp_ring_wait_s"] = ring.take() / len(taken)
        self.logger.log(step, r.loss, r.lr, r.grad_norm, sum(taken) / len(taken),
                        self.tokens_per_step, step_times_left=eta, extra=extra,
                        comm=self.comm_clock and self.comm_clock.per_step(1))
        again = self.compiled.since(step) if self.compiled is not None else None
        if again and self.ctx.is_main:
            print(again, flush=True)

    def maybe_stop(self, step: int, saved: Optional[str]) -> None:
        """A stop signal every rank has seen (SIGTERM, SIGINT, SIGUSR1): save, and end
        with :class:`~oases.errors.Preempted` (exit status 5)."""
        sig = self.stop.agreed()
        if sig is None or step >= self.cfg.train.steps:
            return
        self.stop.finish()
        saved = saved or self.checkpointer.save(step, self.skipped)
        self.checkpointer.wait()
        raise Preempted(f"{sig} received: stopped after step {step}/{self.cfg.train.steps}; "
                        f"checkpoint {saved or 'not saved (non-finite weights)'}; "
                        f"resume=auto continues")

    def finish(self) -> None:
        """After the last step: the final evaluation and checkpoint, unless the intervals
        took them."""
        self.stop.finish()
        final = self.cfg.train.steps
        self.evaluator.final(final)
        self.checkpointer.save_final(final, self.skipped)

    def say_complete(self) -> None:
        if self.ctx.is_main:
            print(f"the run in {self.cfg.out_dir} is complete (step {self.start}/"
                  f"{self.cfg.train.steps}); raise train.steps to continue it", flush=True)


def build_data(cfg: Config, ctx: ParallelContext) -> tuple[TrainBatches, Optional[ValBatches]]:
    """A bad data file is a user error, found before the model is built. A pipeline
    stage's replica takes its share of the pipeline's micro-batch."""
    mbs = cfg.pipeline_batch // ctx.data_dp if ctx.layout is not None \
        else cfg.train.micro_batch_size
    # a data replica's rows; under cp its cp ranks read the same ones and keep their chunks
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, mbs,
                           ctx.data_rank, ctx.data_dp, cfg.seed)
    val = None
    if cfg.data.val_path:
        val = ValBatches(cfg.data.val_path, cfg.data.dtype, cfg.model.seq_len,
                         cfg.model.vocab_size, mbs, ctx.data_rank, ctx.data_dp,
                         cfg.eval.max_batches,
                         documents=batches.documents)  # the training data's documents' EOS
    if ctx.cp > 1:
        batches = CpShards(batches, ctx.cp, ctx.cp_rank)
        val = None if val is None else CpShards(val, ctx.cp, ctx.cp_rank)
    return batches, val


def _degrees(cfg: Config, ctx: ParallelContext,
             claim: Callable[[], None]) -> tuple[Config, Optional[list[int]]]:
    """Per-block TP degrees of the plan (``parallel.plan``), or None: all at tp."""
    if ctx.layout is not None:
        return cfg, None
    if cfg.parallel.plan == "auto":
        claim()  # the planner writes plan.yaml and profile.json
    planned = cfg
    cfg, degrees = resolve_plan(planned, ctx, lambda d, n: time_throwaway(
        throwaway_step(planned, ctx, d), ctx.device, n))
    if degrees is not None and ctx.is_main:
        print(f"plan: per-block TP degrees {degrees}", flush=True)
    return cfg, degrees


def _describe(cfg: Config, ctx: ParallelContext, n_params: int, split: str) -> str:
    par = cfg.parallel
    layout = f"pp {ctx.pp} x " if ctx.pp > 1 else ""
    # a model from init_from is that directory's, whatever model.name says
    name = cfg.model.init_from or cfg.model.name
    return (f"oases: {name} ({cfg.model.arch}, {n_params / 1e6:.1f}M params) | "
            f"world {ctx.world_size} = {layout}dp {cfg.dp} x "
            f"{f'cp {par.cp} x ' if par.cp > 1 else ''}tp {par.tp} | {ctx.device.type} | "
            f"schedule {par.schedule}, recompute {par.recompute}"
            f"{f', {split}' if split else ''}"
            f"{', sequence parallel' if par.sequence_parallel else ''}"
            f"{f', zero {par.zero}' if par.zero else ''}"
            f"{' (node-local secondary shard)' if par.zero_secondary == 'node' else ''} | "
            f"global batch {cfg.global_batch_size} x {cfg.model.seq_len} tokens | "
            f"{cfg.train.precision} | out_dir {cfg.out_dir}")


def _nothing() -> None:
    pass


def build_run(cfg: Config, ctx: ParallelContext, claim: Callable[[], None] = _nothing,
              cuda_note: str = "") -> Optional[Run]:
    """Build this rank's run: data, plan, model (seeded, from ``model.init_from`` or from
    the checkpoint ``resume=auto`` finds), optimizer, and the components that time
    themselves. ``claim()`` comes before the run's first write into out_dir; ``cuda_note``
    is the start-up line's words on CUDA's and NCCL's settings (empty off CUDA).
    ``eval.only``: the evaluation is done here, and there is no run to return (None)."""
    tracker = seed_tracker(cfg, ctx)
    batches, val = build_data(cfg, ctx)
    cfg, degrees = _degrees(cfg, ctx, claim)
    cfg, split = sub_batches.resolve(cfg, ctx, degrees)  # parallel.sub_batches=auto: decided
    par = cfg.parallel
    if ctx.layout is not None and ctx.is_main:
        print(f"pipeline: {ctx.layout.describe(par.pp_virtual)} | {par.pp_schedule}, "
              f"{cfg.train.grad_accum} micro-batches of {cfg.pipeline_batch} sequences",
              flush=True)
    model = build_rank_model(cfg, ctx, tracker, degrees, None if cfg.model.init_from else cfg.seed)
    if cfg.model.init_from:  # every parameter is overwritten (no random init above)
        load_init_from(cfg, ctx, model)
    state = build_train_state(cfg, ctx, model, tracker)
    shards = state.reducer.ownership
    if not shards.sharded and (par.zero or state.reducer.norm_by_terms) and ctx.is_main:
        print("parallel.zero: no gradient group of this layout has more than one rank "
              "(dp = 1, no replicated blocks): nothing is sharded", flush=True)
    if cfg.eval.only:
        eval_only(cfg, ctx, model, state.opt, val,
                  lambda: Evaluator(cfg, ctx, state, val, None)(), shards, claim)
        return None

    start, skipped, resumed = 0, 0, False
    if cfg.resume == "auto":
        meta = resume(cfg, ctx, model, state.opt, batches, tracker, shards)
        if meta is not None:
            start, skipped, resumed = meta["step"], int(meta.get("skipped_steps", 0)), True
    claim()  # everything above only read
    if ctx.is_main:
        if cfg.resume == "auto":  # records past the checkpoint (or of a run never saved)
            trim_metrics(cfg.out_dir, start)
        save_config(cfg, Path(cfg.out_dir) / "config.yaml")
    n_params, flops_per_token = model_stats(cfg.model, cfg.padded_vocab_size)
    logger = MetricsLogger(cfg.out_dir, ctx.is_main, cfg.train.steps, flops_per_token,
                           ctx.world_size, ctx.device, cfg.wandb,
                           run_config(cfg, ctx, n_params, flops_per_token, degrees),
                           resume=resumed, precision=cfg.train.precision,
                           tensorboard=cfg.metrics.tensorboard, start_step=start,
                           group=layout_name(cfg, ctx))
    if ctx.is_main:
        print(_describe(cfg, ctx, n_params, split), flush=True)
        if cuda_note:
            print(f"cuda: {cuda_note}", flush=True)
        if par.tp_comm_noop:
            print("parallel.tp_comm_noop=true: TP collectives are skipped; losses are NOT "
                  "valid (timing only)", flush=True)
    window = cfg.profile.window()
    if par.trace and (window is None or window[1] <= start):  # one step after warm-up
        window = (min(start + 3, cfg.train.steps),) * 2
    # nothing in a Run refers back to it: it (and the process groups' work it holds) is
    # freed when the loop returns, before the groups are destroyed, not by a late GC
    return Run(cfg, ctx, state, batches, val, logger,
               Checkpointer(cfg, ctx, state, batches, tracker),
               Evaluator(cfg, ctx, state, val, logger),
               StepProfiler(window, cfg.out_dir, ctx.rank, ctx.device,
                            cfg.profile.memory_snapshot, view=par.trace),
               StopSignals(host_group()), start=start, skipped=skipped)
