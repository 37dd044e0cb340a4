"""Memory per rank under context parallelism against cp = 1 (CPU, gloo).

    .venv/bin/python -m benchmarks.cp_memory [--seq 2048 4096 8192] [--cp 1 2 4] [key=value ...]
    .venv/bin/python -m benchmarks.cp_memory --seq 2048 --cp 1 2        # a smoke run

For each sequence length and cp degree, ``cp`` local gloo ranks (fresh processes, one
intra-op thread each) build the same GPT (default d 256, 2 layers, 4 heads, vocab 256,
no dropout; ``model.name=llama-tiny model.n_kv_heads=2`` for LLaMA with GQA) with the
world as its cp group (cp = 1: no group, the model as it trains without CP) and run one
micro-batch of 1 row, forward and backward, each rank on its head-tail tokens
(:func:`oases.parallel.cp_chunks.shard_sequence` of the ids and the targets). Rank 0
reports:

* saved activations: what autograd keeps from forward to backward
  (:class:`oases.overlap.memory.SavedTensorMeter` at the end of the forward), less the
  parameters autograd saves (the same storages at every shape, found by a short forward
  under a hook that matches saved storages against the parameters');
* peak resident set growth over the step: ``VmHWM`` after the step less ``VmRSS``
  before it, the peak restarted through ``/proc/self/clear_refs``
  (:func:`benchmarks.lib.ranks.reset_peak`; where the kernel refuses, the growth of
  ``resource.getrusage`` ru_maxrss, which only sees a new peak above the process's
  earlier one); ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns freed tensors and
  the resident set follows what is allocated;
* the step's wall time (informative: the machine is shared, and the ring's ranks share
  its cores).

Each figure is also given against cp = 1 at the same length (the target for the saved
activations: about 1/cp). Bytes do not depend on the machine's load. Writes
benchmarks/results/cp_memory.{md,json}.
"""

from __future__ import annotations

import gc
import os
import resource
import time
from pathlib import Path

from benchmarks.lib import driver
from benchmarks.lib.driver import machine_line
from benchmarks.lib.ranks import init_gloo, reset_peak, spawn_ranks, status_kib, write_result

MODEL = ["model.name=gpt-tiny", "model.d_model=256", "model.n_layer=2", "model.n_head=4",
         "model.n_kv_heads=4", "model.ffn_hidden=1024", "model.vocab_size=256",
         "model.dropout=0"]
PROBE_TOKENS = 8  # the short forward finding the saved parameters; even: two chunks under cp


def saved_parameter_bytes(model, ids, targets) -> int:
    """Bytes of the parameter storages autograd saves in a forward of ``ids``: which
    ones does not depend on the length (the same layers, the same matmuls)."""
    import torch  # deferred: the parent process only spawns

    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key in params:
            seen[key] = params[key]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, targets)
    return sum(seen.values())


def _worker(rank: int, world: int, store: str, overrides: list, seq: int, out: str) -> None:
    init_gloo(rank, world, store)
    # deferred: the parent process only spawns, torch and oases load in the ranks
    import torch
    import torch.distributed as dist
    from oases.config import load_config
    from oases.models import build_model
    from oases.overlap.memory import SavedTensorMeter
    from oases.parallel.cp_chunks import shard_sequence

    cfg = load_config(None, [*overrides, f"model.seq_len={seq}"]).validate(1)
    group = dist.group.WORLD if world > 1 else None
    model = build_model(cfg.model, cfg.padded_vocab_size, cp_group=group, seed=1)
    g = torch.Generator().manual_seed(0)
    whole_ids = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=g)
    whole_y = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=g)
    ids = shard_sequence(whole_ids, world, rank, dim=1)
    y = shard_sequence(whole_y, world, rank, dim=1)
    probe = ids[:, :PROBE_TOKENS], y[:, :PROBE_TOKENS]
    param_saved = saved_parameter_bytes(model, *probe)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gc.collect()
    dist.barrier()
    rss0 = status_kib("VmRSS")
    hwm_reset = reset_peak(strict=False)
    ru0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    with SavedTensorMeter() as meter:
        loss = model(ids, y)
        SavedTensorMeter.end_of_forward()
        # the gradient's scale (a rank's share of the targets) changes no byte
        loss.backward()
    wall = time.perf_counter() - t0
    growth_kib = (status_kib("VmHWM") - rss0 if hwm_reset
                  else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - ru0)
    dist.barrier()
    write_result(out, rank, {
        "saved_bytes": meter.forward_bytes - param_saved, "saved_param_bytes": param_saved,
        "saved_peak_bytes": meter.peak_bytes, "param_bytes": param_bytes,
        "rss_growth_bytes": growth_kib * 1024, "rss_before_bytes": rss0 * 1024,
        "rss_source": "VmHWM" if hwm_reset else "ru_maxrss", "wall_s": wall,
        "loss": loss.item()})


def _ratio(a, b) -> str:
    return f"{a / b:.3f}" if b else "-"


def render(out: Path, data: dict) -> None:
    mib = 2**20
    lines = ["# Context parallelism: memory per rank", "", machine_line(data["machine"]), "",
             driver.command_line(data), "",
             f"Model: {data['shape']}; fp32; rank 0's figures, each (seq, cp) in fresh "
             f"processes. Peak resident set: {data['rss_source']}. Excess: the peak growth "
             "beyond cp 1's divided by cp.", "",
             "| seq | cp | tokens per rank | saved activations (MiB) | vs cp 1 | 1/cp | "
             "peak RSS growth (MiB) | vs cp 1 | excess (MiB) | step (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for seq, by_cp in data["by_seq"].items():
        base = by_cp.get("1")
        for cp, r in by_cp.items():
            if r is None:
                lines.append(f"| {seq} | {cp} | - | not run: {data['skipped'][seq][cp]} "
                             "| - | - | - | - | - | - |")
                continue
            s0, m0 = (base["saved_bytes"], base["rss_growth_bytes"]) if base else (0, 0)
            tail = (f"{(r['rss_growth_bytes'] - m0 / int(cp)) / mib:.1f}"
                    if cp != "1" and m0 else "-")
            lines.append(
                f"| {seq} | {cp} | {int(seq) // int(cp)} | {r['saved_bytes'] / mib:.1f} | "
                f"{_ratio(r['saved_bytes'], s0)} | {1 / int(cp):.3f} | "
                f"{r['rss_growth_bytes'] / mib:.1f} | {_ratio(r['rss_growth_bytes'], m0)} | "
                f"{tail} | {r['wall_s']:.2f} |")
    rows = [r for by_cp in data["by_seq"].values() for r in by_cp.values() if r]
    spread = max(abs(x[k] - r[k]) for r in rows for x in r["ranks"]
                 for k in ("saved_bytes", "rss_growth_bytes"))
    params = ", ".join(f"{next(r for r in by_cp.values() if r)['param_bytes'] / mib:.2f} at "
                       f"seq {seq}" for seq, by_cp in data["by_seq"].items()
                       if any(by_cp.values()))
    lines += ["", f"Every rank's figures are within {spread / mib:.1f} MiB of rank 0's.", "",
              f"Parameters (MiB, every rank, the same at every cp: CP replicates the "
              f"weights, their gradients and optimizer state as DP does): {params} (a "
              f"learned position table grows with seq_len); "
              f"{rows[0]['saved_param_bytes'] / mib:.2f} MiB of them are saved by autograd "
              "and left out of the saved activations above.", "",
              *NOTES, ""]
    out.with_suffix(".md").write_text("\n".join(lines))


NOTES = [
    "**Saved activations** follow 1/cp: every per-token activation (embeddings, norms, "
    "MLPs, q, k, v, the attention output and its log-sum-exp, the logits) is of the "
    "rank's T/cp tokens, and the ring lays its output out (B, T/cp, H, D), so the heads' "
    "merge before the output projection is a view, as after torch's CPU flash kernel at "
    "cp 1 (the projection keeps the tensor the ring saved, not a copy). The rank's global "
    "positions (T/cp int64) are kept for the position embedding's backward.",
    "",
    "**The peak resident set** holds, beyond the saved activations, the transient "
    "tensors of the step. Attention is torch's CPU flash kernel "
    "(`_scaled_dot_product_flash_attention_for_cpu`, forward and backward) at cp 1 and "
    "in each ring step alike (the ring's backward feeds it the whole sequence's output "
    "and log-sum-exp), so neither keeps a T x T tensor. With documents or dropout the "
    "ring takes its fp32 math path instead, in tiles of "
    "`oases.parallel.ring_kernels.MATH_ROWS` query rows whose (B, Hq, rows, T/cp) score "
    "matrices it holds four at a time in backward (none here).",
    "",
    "Beside it, what does not shrink by cp: the parameters and their gradients (above), "
    "whole on every rank; the ring's kv blocks in flight (the one attended and the next "
    "one, (2, B, Hkv, T/cp, D) each) and in backward the fp32 dk/dv accumulators (held, "
    "received, sent on), of T/cp tokens but absent at cp 1; and, where documents are "
    "used, the whole rows' document ids on every rank (none here).",
]


def main(argv=None) -> int:
    ap = driver.parser(__doc__)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("overrides", nargs="*", help="model.key=value")
    driver.report_flags(ap, "cp_memory")
    args = ap.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    from benchmarks.lib.machine import machine_info  # deferred: the report only

    # inherited by the spawned ranks: freed tensors go back to the system at once
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    overrides = [*MODEL, *args.overrides]
    t0 = time.time()
    by_seq: dict = {}
    skipped: dict = {}
    for seq in args.seq:
        by_seq[str(seq)] = {}
        for cp in args.cp:
            if seq % (2 * cp):
                why = f"{seq} tokens do not split into 2cp = {2 * cp} chunks"
                skipped.setdefault(str(seq), {})[str(cp)] = why
                by_seq[str(seq)][str(cp)] = None
                continue
            print(f"seq {seq}, cp {cp} ...", flush=True)
            res = spawn_ranks(_worker, cp, overrides, seq)
            by_seq[str(seq)][str(cp)] = {**res[0], "ranks": res}
    sources = {r["rss_source"] for by_cp in by_seq.values() for r in by_cp.values() if r}
    driver.save(driver.out_prefix(args, "cp_memory"), {
        "machine": machine_info(), "command": driver.command("benchmarks.cp_memory", argv),
        "elapsed_min": (time.time() - t0) / 60,
        "shape": " ".join(overrides) + ", micro-batch 1",
        "rss_source": " and ".join(sorted(sources)),
        "by_seq": by_seq, "skipped": skipped}, render)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
