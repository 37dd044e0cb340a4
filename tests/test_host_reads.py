"""How often a training step reads a tensor back to the host.

On a GPU each read (``.item()``, ``.tolist()``, ``int(t)``, ``float(t)``, ``bool(t)``)
waits for the device to finish everything queued before it: the host stops issuing
work and the GPU drains its queue and idles. A step needs one: the loss and the
gradient norm, read together, decide whether the optimizer updates. The token count of
the loss weights needs none (every target counts in a token corpus, and a masked
batch's counts are summed on the device), and the stop-signal flag travels on a host
(gloo) group, read a step after it was sent.

The reads counted are those oases' own code makes (the caller's file is in ``oases/``
or ``models/``), of any tensor: on these CPU ranks no read blocks anything, so the count,
not the time, is what a GPU run would pay for.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.support.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
OURS = (str(REPO / "oases"), str(REPO / "models"))
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


class HostReads:
    """Counts the reads oases' code makes while entered, by caller (file:line)."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self._saved: dict = {}

    def __enter__(self) -> "HostReads":
        for name in READS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def counted(t, *a, _orig=orig, **k):
                f = sys._getframe(1)
                if f.f_code.co_filename.startswith(OURS):
                    self.calls[f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"] += 1
                return _orig(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)


class _Masked:
    """Micro-batches whose targets are partly IGNORE_INDEX (a fine-tuning set's prompts)."""

    masked = True

    def __init__(self, inner) -> None:
        self.inner = inner

    def next_batch(self):
        from oases.parallel.loss import IGNORE_INDEX

        x, y = self.inner.next_batch()
        y = y.clone()
        y[:, : y.shape[1] // 3] = IGNORE_INDEX
        return x, y


def _body(ctx, engine: str) -> None:
    from oases.config import load_config
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches
    from oases.runtime.step import train_step

    cfg = load_config(None, ["model.name=gpt-tiny", "model.seq_len=16", "data.kind=synthetic",
                             "train.micro_batch_size=4", "train.grad_accum=2",
                             f"parallel.tp={ctx.tp}", f"parallel.schedule={engine}",
                             "parallel.recompute=fine" if engine == "oases" else
                             "parallel.recompute=full"]).validate(ctx.world_size)
    tracker = seed_tracker(cfg, ctx)
    state = build_train_state(cfg, ctx, build_rank_model(cfg, ctx, tracker, None, cfg.seed), tracker)
    plain = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                         cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp, cfg.seed)
    assert plain.masked is False
    for batches in (plain, _Masked(plain)):
        train_step(state, batches, 1e-3)  # warm: first calls may read what they cache
        with HostReads() as reads:
            for _ in range(3):
                train_step(state, batches, 1e-3)
        # one read a step: the loss and the gradient norm, together (step.py's tolist)
        assert sum(reads.calls.values()) == 3, (type(batches).__name__, reads.calls)
        (where,) = reads.calls
        assert where.startswith("step.py:"), reads.calls


@pytest.mark.parametrize("engine,world,tp", [("megatron", 2, 1), ("oases", 2, 2)])
def test_a_step_reads_the_host_once(engine, world, tp):
    """megatron at dp = 2 (the token count, a masked batch's too, is a DP sum), oases at
    tp = 2 (the engine's sub-batches, collectives and recompute)."""
    run_distributed(_body, world=world, tp=tp, args=(engine,))


def _stop_body(ctx) -> None:
    import os
    import signal

    from oases.runtime.preempt import StopSignals, host_group

    group = host_group()  # None: the default group is gloo here
    with StopSignals(group) as stop, HostReads() as reads:
        assert stop.agreed() is None  # nothing sent before the first call
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # one rank only
        assert stop.agreed() is None  # the flags of the previous call: none yet
        assert stop.agreed() == "SIGUSR1"  # a step later, on every rank
        flag, _ = stop._pending
        assert flag.device.type == "cpu"  # the flag never touches a GPU
        stop.finish()
    # each call reads the flag the previous call sent, from host memory: never a device
    assert sum(reads.calls.values()) <= 3, reads.calls


def test_stop_signals_agree_a_step_late_on_the_host():
    run_distributed(_stop_body, world=2, tp=1)
