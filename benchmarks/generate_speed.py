"""Decoding speed of ``oases.runtime.generate`` on CPU: gpt-125m, one process, tp = 1.

    .venv/bin/python -m benchmarks.generate_speed                  # ~10 min, loaded 2 cores
    .venv/bin/python -m benchmarks.generate_speed --modes b1-cache b8-cache --rounds 3

A gpt-125m shape with random weights (``model.name=gpt-125m``), a prompt of ``--prompt``
random tokens per row, ``--new`` new tokens, greedy, no EOS (every row runs to the end).
Modes: batch 1 and 8 with the KV cache, and batch 1 without it (the whole sequence
recomputed at each step: what a decoder without a cache does). Every round runs every
mode once, in turn (interleaved, so machine noise hits all alike); a mode's figure is the
median over rounds. One intra-op thread, fp32. Tokens/s is given against wall time and
against the main thread's CPU time (with one thread, all of the compute: the figure the
other tenants of a shared machine leave alone).

Writes ``benchmarks/results/generate.{md,json}``.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from benchmarks.lib import driver
from oases.models import build_model
from oases.config import load_config
from oases.parallel.groups import ParallelContext
from oases.runtime.generate import generate

MODES = {"b1-cache": (1, True), "b8-cache": (8, True), "b1-nocache": (1, False)}


def run_once(model, batch: int, cache: bool, prompt: int, new: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, prompt), generator=g).tolist()
    c0 = time.thread_time()
    out = generate(model, prompts, new, cache=cache)
    cpu = time.thread_time() - c0
    n = sum(out.lengths)
    assert n == batch * new, out.lengths
    return {"wall_s": out.seconds, "cpu_s": cpu, "tokens": n,
            "tokens_per_s": n / out.seconds, "tokens_per_cpu_s": n / cpu}


SETUP = ("Model: gpt-125m ({params_m:.0f}M parameters, random weights), fp32, one process, "
         "one intra-op thread. Prompt {prompt} tokens per row, {new} new tokens per row, "
         "greedy, no EOS. {rounds} interleaved rounds; figures are medians over rounds. CPU = "
         "the main thread's CPU time (all the compute with one thread): the figure the other "
         "tenants' load leaves alone.")
TABLE = ["| mode | batch | KV cache | tokens/s (wall) | per round | tokens/s (CPU) | per round |",
         "|---|---|---|---|---|---|---|"]


def render(prefix: Path, data: dict) -> None:
    meta, per = data["meta"], data["modes"]
    lines = [*driver.report_head("# Decoding speed: gpt-125m on CPU, tp = 1", meta),
             SETUP.format(**meta), "", *TABLE]
    for mode, r in per.items():
        batch, cache = MODES[mode]
        wall = ", ".join(f"{x:.1f}" for x in r["rounds"]["tokens_per_s"])
        cpu = ", ".join(f"{x:.1f}" for x in r["rounds"]["tokens_per_cpu_s"])
        lines.append(f"| {mode} | {batch} | {'yes' if cache else 'no'} | "
                     f"{r['tokens_per_s']:.1f} | {wall} | {r['tokens_per_cpu_s']:.1f} | {cpu} |")
    if "b1-cache" in per and "b1-nocache" in per:
        speed = per["b1-cache"]["tokens_per_cpu_s"] / per["b1-nocache"]["tokens_per_cpu_s"]
        lines += ["", f"The KV cache at batch 1: {speed:.1f}x the tokens/s of recomputing the "
                      f"sequence at every step (CPU time)."]
    lines += ["", "Raw numbers: `generate.json`."]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def prepare(args):
    torch.set_num_threads(1)
    cfg = load_config(None, ["model.name=gpt-125m", "model.dropout=0"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=cfg.seed).eval()
    run_once(model, 1, True, args.prompt, 8, cfg.model.vocab_size)  # warm-up
    return model, cfg.model.vocab_size


def _flags(p) -> None:
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=128, help="new tokens per row")


SUITE = driver.Suite(
    "generate", "benchmarks.generate_speed", MODES,
    lambda state, mode, args: run_once(state[0], *MODES[mode], args.prompt, args.new, state[1]),
    render, metrics=("tokens_per_s", "tokens_per_cpu_s"), flags=_flags,
    setup=lambda args: contextlib.nullcontext(prepare(args)),
    meta=lambda args, state: {"threads": 1, "device": ParallelContext.single().device.type,
                              "params_m": state[0].num_params() / 1e6})


if __name__ == "__main__":
    raise SystemExit(driver.run_suite(SUITE, __doc__))
