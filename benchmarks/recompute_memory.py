"""Saved activation bytes of each recompute mode, measured (one process, CPU).

    .venv/bin/python -m benchmarks.recompute_memory [--dropout 0.1] [key=value ...]

Runs one forward of one micro-batch per mode under the engine that runs it and
reports what autograd and the engine's stash keep from forward to backward
(:class:`oases.overlap.memory.SavedTensorMeter`, parameters excluded), the
default shape being the overlap benchmark's (GPT d 512, 2 layers, 8 heads, seq 128,
micro-batch 8) at tp = 1. Writes nothing; prints a Markdown table.
"""

from __future__ import annotations

import argparse

import torch

from oases.models import build_model
from oases.config import load_config
from oases.overlap.engines import build_schedule
from oases.overlap.memory import SavedTensorMeter
from oases.parallel.random import TPRNGTracker

MODES = [("megatron", "none"), ("megatron", "selective"), ("megatron", "full"),
         ("oases", "none"), ("oases", "selective"), ("oases", "fine"), ("oases", "full")]


def measure(cfg, sched: str, rc: str, mbs: int) -> int:
    tracker = TPRNGTracker(torch.device("cpu"))
    tracker.seed(1, 0)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, tracker,
                        rc if sched == "megatron" or rc == "selective" else "none", seed=1)
    ids = torch.randint(0, cfg.model.vocab_size, (mbs, cfg.model.seq_len))
    with SavedTensorMeter() as meter:
        build_schedule(sched, None, 2, rc, tracker).forward_backward(model, ids, ids)
    return meter.forward_bytes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("overrides", nargs="*", help="model.key=value")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(None, ["model.name=gpt-tiny", "model.d_model=512", "model.n_layer=2",
                             "model.n_head=8", "model.n_kv_heads=8", "model.ffn_hidden=2048",
                             "model.seq_len=128", "model.vocab_size=256",
                             f"model.dropout={args.dropout}", *args.overrides]).validate(1)
    m = cfg.model
    print(f"GPT d {m.d_model}, {m.n_layer} layers, {m.n_head} heads, seq {m.seq_len}, "
          f"micro-batch {args.micro_batch_size}, dropout {m.dropout}, fp32, tp 1\n")
    print("| schedule | recompute | saved activations (MiB) | vs none |")
    print("|---|---|---|---|")
    base = {}
    for sched, rc in MODES:
        b = measure(cfg, sched, rc, args.micro_batch_size)
        base.setdefault(sched, b)
        print(f"| {sched} | {rc} | {b / 2**20:.1f} | {b / base[sched]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
