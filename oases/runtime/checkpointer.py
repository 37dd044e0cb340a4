"""When and what a run saves: :class:`Checkpointer` decides its own timing
(``checkpoint.interval``, the final step, a stop signal) and writes through
:mod:`oases.runtime.checkpoint`, in the foreground or (``checkpoint.async_save``) in the
background."""

from __future__ import annotations

from typing import Optional

from oases.config import Config
from oases.parallel.groups import ParallelContext
from oases.parallel.random import TPRNGTracker
from oases.runtime import checkpoint as ckpt
from oases.runtime.data import TrainBatches
from oases.runtime.resume import layout_meta, model_section, model_shape
from oases.runtime.state import TrainState


class Checkpointer:
    """Saves the run's weights, optimizer, data position and RNG states. A context
    manager: leaving it (an error, Ctrl-C, the end) publishes a save still in flight.
    ``skipped``, where a save takes it: the non-finite steps left out so far, recorded in
    the checkpoint."""

    def __init__(self, cfg: Config, ctx: ParallelContext, state: TrainState,
                 batches: TrainBatches, tracker: TPRNGTracker) -> None:
        self.cfg, self.ctx, self.state = cfg, ctx, state
        self.batches, self.tracker = batches, tracker
        self.interval = cfg.checkpoint.interval
        self.saver = ckpt.AsyncSaver(cfg.parallel.timeout_s) if cfg.checkpoint.async_save \
            else None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        if self.saver is not None:
            self.saver.close()

    def due(self, step: int) -> bool:
        return bool(self.interval) and step % self.interval == 0

    def maybe_save(self, step: int, skipped: int) -> Optional[str]:
        """After step ``step``: a save when the interval says so (and a finished
        background save published on the way)."""
        if self.saver is not None:
            self.saver.poll()
        return self.save(step, skipped) if self.due(step) else None

    def save_final(self, final: int, skipped: int) -> None:
        """``checkpoint.save_final``: the last step's state, unless the interval saved it."""
        if self.cfg.checkpoint.save_final and not self.due(final):
            self.save(final, skipped)
        self.wait()

    def wait(self) -> None:
        """The background save in flight, published (nothing without async_save)."""
        if self.saver is not None:
            self.saver.wait()

    def close(self) -> None:
        """Publish a background save in flight before an error ends the run."""
        if self.saver is not None:
            self.saver.close()

    def save(self, step: int, skipped: int) -> Optional[str]:
        """Write the checkpoint of step ``step``; None (nothing written) when the weights
        are not finite: a good checkpoint is never replaced by a broken one."""
        cfg, ctx, state = self.cfg, self.ctx, self.state
        shards = state.reducer.ownership
        if not ckpt.all_finite(state.model, ctx, shards):
            if ctx.is_main:
                print(f"step {step}: the weights are not finite; checkpoint not saved",
                      flush=True)
            return None
        meta = {"step": step, "data": self.batches.state_dict(), "model_shape": model_shape(cfg),
                "model": model_section(cfg), "corpus": self.batches.corpus,
                **layout_meta(ctx, cfg.parallel.pp_virtual),
                "padded_vocab_size": cfg.padded_vocab_size, "skipped_steps": skipped,
                "sub_batches": cfg.sub_batches}
        # each rank writes what it owns (ZeRO: its ranges of the buckets), nothing gathered
        write = ckpt.save if self.saver is None else self.saver.save
        path = write(cfg.out_dir, step, state.model, state.opt, ctx, meta,
                     self.tracker.get_states(), cfg.checkpoint.keep, shards=shards)
        if ctx.is_main:
            print(f"{'saved' if self.saver is None else 'saving (in the background)'} "
                  f"checkpoint {path}", flush=True)
        return path
