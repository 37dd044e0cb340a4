"""Ring attention's CUDA kernels on one GPU, against PyTorch's own attention.

    python -m benchmarks.ring_cuda [--seq 4096 8192 16384] [--out PREFIX]

One rank (``group=None``), so the ring's one step is the rank's own block, causal: in
bf16 the forward takes flash's kernel that returns an lse and the backward flash's
backward fed the global output and lse; ``FUSED_ON_CUDA = False``
(:mod:`oases.parallel.ring_attention`) runs the fp32 matmul + softmax path instead, as
documents do. At cp > 1 each step runs the same kernels on a smaller block, so the
figures here are what a rank's blocks cost and how exact they are; the transfers need
two GPUs.

Per sequence length T (B 1, 16 query heads, 4 kv heads, head dim 128, bf16, causal):

* **error**: the output and the q/k/v gradients of the ring and of
  ``F.scaled_dot_product_attention`` (flash, bf16), each against SDPA in fp32 (the
  memory-efficient kernel, fp32 throughout, no TF32); max |x - ref| / max |ref|. The
  ring's math path with TF32 off and on (``torch.backends.cuda.matmul.allow_tf32``).
* **time**: forward + backward in ms, CUDA events, median of ``--iters`` after 2 warm-up
  ones, SDPA, the ring and the ring's math path interleaved iteration by iteration (the
  math path up to ``--math-up-to`` tokens: its memory grows as T^2).
* **memory**: peak allocated above the inputs during one forward + backward.

Writes PREFIX.json and PREFIX.md (default ``benchmarks/results/ring-cuda-<gpu>``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.lib import driver
from oases.parallel import ring_kernels as ra
from oases.parallel.ring_attention import ring_attention

REPO = Path(__file__).resolve().parents[1]
HQ, HKV, D = 16, 4, 128


def _inputs(T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = lambda h: (1, h, T, D)  # noqa: E731
    q = torch.randn(shape(HQ), device="cuda", generator=g)
    k = torch.randn(shape(HKV), device="cuda", generator=g)
    v = torch.randn(shape(HKV), device="cuda", generator=g)
    dout = torch.randn(shape(HQ), device="cuda", generator=g)
    return q, k, v, dout


def _sdpa(q, k, v):
    r = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1),
                                          v.repeat_interleave(r, 1), is_causal=True)


def _ring(q, k, v):
    return ring_attention(q, k, v, None, causal=True)


def _run(fn, q, k, v, dout, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout.to(dtype))
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def _errors(res, ref) -> dict:
    names = ("out", "dq", "dk", "dv")
    return {n: float((a - b).abs().max() / b.abs().max()) for n, a, b in zip(names, res, ref)}


def _reference(q, k, v, dout):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return _run(_sdpa, q, k, v, dout, torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _timed(fn, leaves, dout, fused: bool = True) -> float:
    """ms of one forward + backward; ``fused`` False: the ring's fp32 math throughout."""
    for t in leaves:
        t.grad = None
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ra.FUSED_ON_CUDA = fused
    try:
        a.record()
        fn(*leaves).backward(dout)
        b.record()
        b.synchronize()
    finally:
        ra.FUSED_ON_CUDA = True
    return a.elapsed_time(b)


def _peak(fn, leaves, dout, fused: bool) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    _timed(fn, leaves, dout, fused)
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def one_length(T: int, iters: int, math_up_to: int) -> dict:
    q, k, v, dout = _inputs(T)
    row: dict = {"T": T}
    ref = _reference(q, k, v, dout)
    torch.backends.cuda.matmul.allow_tf32 = False
    row["error_ring_bf16"] = _errors(_run(_ring, q, k, v, dout, torch.bfloat16), ref)
    row["error_sdpa_bf16"] = _errors(_run(_sdpa, q, k, v, dout, torch.bfloat16), ref)
    if T <= math_up_to:
        ra.FUSED_ON_CUDA = False
        try:
            for tf32 in (False, True):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                row["error_ring_math_bf16" + ("_tf32" if tf32 else "")] = _errors(
                    _run(_ring, q, k, v, dout, torch.bfloat16), ref)
        finally:
            ra.FUSED_ON_CUDA = True
    del ref
    leaves = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    d16 = dout.to(torch.bfloat16)
    modes = {"sdpa": (_sdpa, True), "ring": (_ring, True), "ring_math": (_ring, False)}
    if T > math_up_to:
        del modes["ring_math"]
    times: dict = {m: [] for m in modes}
    for i in range(iters + 2):
        for m, (fn, fused) in modes.items():
            t = _timed(fn, leaves, d16, fused)
            if i >= 2:
                times[m].append(t)
    row["ms"] = {m: statistics.median(ts) for m, ts in times.items()}
    row["peak_gib"] = {m: _peak(fn, leaves, d16, fused) for m, (fn, fused) in modes.items()}
    torch.cuda.empty_cache()
    return row


def _pair(r: dict, name: str, what: str) -> str:
    e = r.get(name)
    return "-" if e is None else f"{e[what]:.1e}"


def _md(res: dict) -> str:
    lines = [f"# Ring attention's kernels on one {res['gpu']}", "",
             f"`{res['command']}`; torch {res['torch']}. One rank (the ring's own causal "
             f"block), B 1, {HQ} query heads, {HKV} kv heads, head dim {D}, bf16. Errors: "
             "max |x - ref| / max |ref| against SDPA in fp32 (memory-efficient kernel, no "
             "TF32), as ring (flash forward and backward) / ring's fp32 math (TF32 off; "
             "on) / SDPA's flash. Times: forward + backward, median of "
             f"{res['iters']}, modes interleaved. Peak: allocated above the inputs.", "",
             "| T | out | dq | dk | dv | ms sdpa | ms ring | ms ring math | GiB sdpa | "
             "GiB ring | GiB ring math |", "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['error']} ||||||||||")
            continue
        errs = [" / ".join([_pair(r, "error_ring_bf16", w), _pair(r, "error_ring_math_bf16", w)
                            + "; " + _pair(r, "error_ring_math_bf16_tf32", w),
                            _pair(r, "error_sdpa_bf16", w)]) for w in ("out", "dq", "dk", "dv")]
        ms, gib = r["ms"], r["peak_gib"]
        fmt = lambda d, m: f"{d[m]:.2f}" if m in d else "-"  # noqa: E731
        lines.append(f"| {r['T']} | " + " | ".join(errs) + " | " + " | ".join(
            fmt(d, m) for d in (ms, gib) for m in ("sdpa", "ring", "ring_math")) + " |")
    return "\n".join(lines) + "\n"


def _render(prefix: Path, res: dict) -> None:
    prefix.with_suffix(".md").write_text(_md(res))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ring_cuda", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", nargs="+", type=int, default=[4096, 8192, 16384])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--math-up-to", type=int, default=8192,
                   help="longest T at which the fp32 math path is run too (memory: T^2)")
    p.add_argument("--out", help="prefix of the .json and .md")
    p.add_argument("--from-json", help="write the .md of a saved results JSON again (no "
                   "runs), beside it or to the --out prefix")
    args = p.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), _render, out=args.out)
    if not torch.cuda.is_available():
        print("ring_cuda: skipped: no CUDA device is visible")
        return 0
    name = torch.cuda.get_device_name(0)
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"ring-cuda-{slug}"
    res = {"gpu": name, "torch": torch.__version__, "iters": args.iters, "rows": [],
           "command": "python -m benchmarks.ring_cuda " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv)}
    for T in args.seq:
        try:
            res["rows"].append(one_length(T, args.iters, args.math_up_to))
        except torch.cuda.OutOfMemoryError as e:
            res["rows"].append({"T": T, "error": f"out of memory: {str(e).splitlines()[0]}"})
            torch.cuda.empty_cache()
        print(json.dumps(res["rows"][-1]), flush=True)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1))
        _render(out, res)
    print(_md(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
