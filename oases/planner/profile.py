"""The profiler: measured block compute per degree, constants, and collectives.

Compute is measured in one process on the device it runs on: a block at degree
t is a block with 1/t of the heads and of the MLP width, fed the rows a rank
processes at that degree (``micro_batch / sub_batches * t / T``). Forward and
backward are timed (median of a few repeats after warm-up); the saved-tensor
bytes of its forward come from :class:`SavedTensorMeter`. A block's compute is
measured at two row counts (the run's and twice as many): on a small model a
fixed part (kernel launches, Python) does not shrink with the rows, and a
pipeline's micro-batches are smaller than the profiled one
(:func:`oases.planner.stages.scale_profile` fits ``a + b * rows``). Collectives
are measured by :mod:`oases.planner.comm_profile`.

Results go to a profile DB (JSON), keyed by hardware and model/run shape, and
are reused when present.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from oases.models import arch_class, build_model
from oases.models.attention import ParallelAttention
from oases.config import Config, ModelConfig
from oases.config.archs import get_arch
from oases.config.heads import local_kv_heads
from oases.config.schema import BF16_PRECISIONS, resolve_precision
from oases.overlap.memory import SavedTensorMeter
from oases.parallel.sharding import init_parameters
from oases.planner.cost import ModelShape, Profile, RunShape
from oases.progress import bar_safe, progress


def default_db() -> Path:
    """``~/.cache/oases/profile_db.json``, with ``~`` as it is now (not when imported)."""
    return Path.home() / ".cache" / "oases" / "profile_db.json"


def hardware_key(device: torch.device) -> str:
    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:
        dev = f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    return f"{platform.node()} | {dev} | torch {torch.__version__}"


def run_precision(cfg: Config, device: Optional[torch.device] = None) -> str:
    """``train.precision`` as ``cfg``'s run uses it on ``device`` (default: the device
    ``parallel.device`` picks on this machine). A run resolves ``auto`` before it plans;
    the plan command and direct callers may hand it over unresolved."""
    kind = device.type if device is not None else cfg.parallel.device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_precision(cfg.train.precision, kind)


def profile_key(device: torch.device, shape: ModelShape, run: RunShape, precision: str) -> str:
    s = dataclasses.asdict(shape)
    # "bf16" was autocast over fp32 weights before bf16 weights: those entries stay unread
    key = {"hw": hardware_key(device), "shape": s, "tp": run.tp, "mbs": run.micro_batch_size,
           "sub_batches": run.sub_batches,
           "precision": "bf16-weights" if precision == "bf16" else precision}
    if run.recompute == "selective":  # attention profiled with its core recomputed
        key["selective"] = True
    return json.dumps(key, sort_keys=True)


def load_db(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def save_db(path: Path, db: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(db, indent=1))
    tmp.replace(path)


@dataclasses.dataclass
class _ShardShape(ModelConfig):
    """A ModelConfig whose heads/width are one rank's share at some degree, with the
    head dimension of the full model."""
    fixed_head_dim: int = 0

    @property
    def head_dim(self) -> int:  # type: ignore[override]
        return self.fixed_head_dim


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), before reading a clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timeit(fn: Callable[[], None], device: torch.device, reps: int, warmup: int,
            barrier: Optional[Callable[[], None]] = None) -> float:
    return _time_phases(lambda: (fn(),), device, reps, warmup, barrier=barrier)[0]


def _time_phases(step: Callable[[], tuple], device: torch.device, reps: int,
                 warmup: int, min_s: float = 0.05,
                 barrier: Optional[Callable[[], None]] = None) -> list[float]:
    """Duration of each phase of ``step``: a callable that runs its first phase and
    returns one closure per later phase (e.g. forward, returning the backward).

    Each measurement repeats the step until it has run ``min_s`` and averages, so a
    process that shares its cores with others (the other ranks of a step, on an
    oversubscribed host) sees its average share of them rather than a lucky time
    slice; the figure is the median of ``reps`` such measurements. ``barrier`` (when
    every rank of a job profiles at once) lines the ranks up before each measurement,
    so they contend as in a step rather than drift apart."""

    def once() -> list[float]:
        sync_device(device)
        t0 = time.perf_counter()
        rest = [p for p in step() if callable(p)]
        sync_device(device)
        times = [time.perf_counter() - t0]
        for phase in rest:
            t0 = time.perf_counter()
            phase()
            sync_device(device)
            times.append(time.perf_counter() - t0)
        return times

    for _ in range(warmup):
        first = once()
    inner = max(1, int(min_s / max(sum(first), 1e-6)) + 1)
    per_phase: list[list[float]] = [[] for _ in first]
    for _ in range(reps):
        if barrier is not None:
            barrier()
        acc = [0.0] * len(first)
        for _ in range(inner):
            for k, t in enumerate(once()):
                acc[k] += t
        for k in range(len(acc)):
            per_phase[k].append(acc[k] / inner)
    return [statistics.median(p) for p in per_phase]


def make_block(kind: str, cfg: ModelConfig, t: int):
    sc = _ShardShape(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)},
                     fixed_head_dim=cfg.head_dim)
    # one rank's share; above n_kv_heads ranks it holds one (replicated) kv head
    sc.n_head, sc.ffn_hidden = cfg.n_head // t, cfg.ffn_hidden // t
    sc.n_kv_heads = local_kv_heads(cfg.n_kv_heads, t)
    proto = arch_class(cfg.arch)
    lm = proto.__new__(proto)  # only for make_norm / make_mlp / make_rotary
    if kind == "attn":
        rot = proto.make_rotary(lm, cfg)
        return ParallelAttention(sc, proto.make_norm(lm, cfg), None, None, rot,
                                 get_arch(cfg.arch).qkv_bias)
    return proto.make_mlp(lm, sc, proto.make_norm(lm, cfg), None)


def _time_block(blk, x: torch.Tensor, amp, device: torch.device, reps: int, warmup: int,
                barrier: Optional[Callable[[], None]]) -> list[float]:
    """(forward, backward) seconds of ``blk`` on input ``x``."""
    g = torch.randn_like(x)

    def fwd_then_bwd():
        with amp:
            out = blk(x)
        return (lambda: out.backward(g),)

    return _time_phases(fwd_then_bwd, device, reps, warmup, barrier=barrier)


def profile_compute(cfg: Config, run: RunShape, device: torch.device, reps: int = 5,
                    warmup: int = 2, log: Callable[[str], None] = print,
                    barrier: Optional[Callable[[], None]] = None) -> Profile:
    """Measure every (block kind, degree) and the constant parts on this device
    (``barrier``: every rank of a job runs this at once; see :func:`_time_phases`)."""
    m = cfg.model
    shape = ModelShape.from_config(m)
    degrees = shape.valid_degrees(run.tp)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16)
           if run_precision(cfg, device) in BF16_PRECISIONS else torch.autocast(device.type, enabled=False))
    # bf16 weights over fp32 masters: the blocks hold bf16 parameters, and the residual
    # stream they read is bf16 (what the run computes and saves)
    wdt = torch.bfloat16 if run_precision(cfg, device) == "bf16" else torch.float32
    blocks: dict = {"attn": {}, "mlp": {}}
    todo = [(k, t) for t in degrees for k in ("attn", "mlp")]
    t_start = time.perf_counter()
    log = bar_safe(log)  # the per-block lines below, printed above the bar
    for n_done, (kind, t) in enumerate(progress(todo, desc="profile", unit="block",
                                                lines=False), 1):
        rows = run.micro_batch_size / run.sub_batches * t / run.tp
        if rows < 1 or rows != int(rows):
            continue  # this degree cannot split the sub-batch: not a candidate
        rows = int(rows)
        blk = make_block(kind, m, t).to(device)
        if kind == "attn":  # its backward then recomputes the core, and it saves less
            blk.selective = run.recompute == "selective"
        init_parameters(blk, 0, 0, 1)
        blk.to(wdt)
        x = torch.randn(rows, m.seq_len, m.d_model, device=device, dtype=wdt, requires_grad=True)
        t_f, t_b = _time_block(blk, x, amp, device, reps, warmup, barrier)
        with SavedTensorMeter() as meter:
            with amp:
                out = blk(x)
            SavedTensorMeter.end_of_forward()
        del out
        # a second row count: the fixed part of the block's time (module docstring)
        x2 = torch.randn(2 * rows, m.seq_len, m.d_model, device=device, dtype=wdt,
                         requires_grad=True)
        t_f2, t_b2 = _time_block(blk, x2, amp, device, reps, warmup, barrier)
        blocks[kind][str(t)] = {"fwd": t_f, "bwd": t_b, "saved": meter.forward_bytes,
                                "rows": rows, "fwd2": t_f2, "bwd2": t_b2, "rows2": 2 * rows}
        log(f"profile [{n_done}/{len(todo)}] {kind:<4} degree {t}: rows {rows}, "
            f"fwd {1e3 * t_f:.2f} ms, bwd {1e3 * t_b:.2f} ms (rows {2 * rows}: "
            f"{1e3 * t_f2:.2f}, {1e3 * t_b2:.2f} ms), saved {meter.forward_bytes / 2**20:.1f} "
            f"MiB ({time.perf_counter() - t_start:.0f}s)")
    # Constant parts at degree T: embedding + final norm + head + loss, one micro-batch.
    consts = progress(total=2, desc="profile constants", unit="part", lines=False)
    head_cfg = dataclasses.replace(m, n_layer=1)
    vocab_local = cfg.padded_vocab_size // run.tp
    model = build_model(dataclasses.replace(head_cfg, vocab_size=min(m.vocab_size, vocab_local)),
                        vocab_local, None, seed=0, device=device)
    model.layers = torch.nn.ModuleList()  # embedding -> norm -> head only
    model.to(wdt)
    ids = torch.randint(0, min(m.vocab_size, vocab_local), (run.micro_batch_size, m.seq_len),
                        device=device)

    def head_fwd_then_bwd():
        with amp:
            loss = model(ids, ids)
        return (loss.backward,)

    c_f, c_b = _time_phases(head_fwd_then_bwd, device, reps, warmup, barrier=barrier)
    consts.update(1)
    n_params = sum((shape.rank_params(k, run.tp) for k in shape.kinds()), 0) + \
        shape.other_params() / run.tp
    p = torch.zeros(int(n_params), device=device, requires_grad=True)
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], fused=device.type == "cuda")
    c_step = _timeit(opt.step, device, 3, 1, barrier=barrier)
    consts.update(1)
    consts.close()
    log(f"profile constants: embedding+head fwd {1e3 * c_f:.2f} ms, bwd {1e3 * c_b:.2f} ms, "
        f"optimizer {1e3 * c_step:.2f} ms")
    peak = 3 * run.micro_batch_size * m.seq_len * vocab_local * 4
    const = {"fwd": c_f, "bwd": c_b, "step": c_step, "peak": peak,
             "head_fwd": c_f / run.sub_batches, "embed_bwd": 0.0}
    return Profile(blocks, const)


def get_profile(cfg: Config, run: RunShape, device: torch.device, db_path: Optional[Path],
                log: Callable[[str], None] = print, force: bool = False,
                barrier: Optional[Callable[[], None]] = None) -> Profile:
    """Compute profile from the DB, or measured now (and stored)."""
    shape = ModelShape.from_config(cfg.model)
    key = profile_key(device, shape, run, run_precision(cfg, device))
    db = load_db(db_path) if db_path else {}
    if not force and key in db:
        e = db[key]
        log(f"profile: reusing {db_path}")
        return Profile(e["blocks"], e["constant"], {})
    log(f"profile: measuring {cfg.model.name} blocks at degrees "
        f"{shape.valid_degrees(run.tp)} on {hardware_key(device)}")
    prof = profile_compute(cfg, run, device, log=log, barrier=barrier)
    if db_path:
        save_profile(cfg, run, device, db_path, prof, log=log)
    return prof


def save_profile(cfg: Config, run: RunShape, device: torch.device, db_path: Path,
                 prof: Profile, log: Callable[[str], None] = print) -> None:
    """Store ``prof``'s compute figures in the DB under this hardware and shape."""
    key = profile_key(device, ModelShape.from_config(cfg.model), run,
                      run_precision(cfg, device))
    db = load_db(db_path)
    db[key] = {"blocks": prof.blocks, "constant": prof.constant}
    save_db(db_path, db)
    log(f"profile: saved to {db_path}")

