"""The profiler: measured block compute per degree, constants, and collectives.

Compute is measured in one process on the device it runs on: a block at degree
t is a block with 1/t of the heads and of the MLP width, fed the rows a rank
processes at that degree (``micro_batch / sub_batches * t / T``). Forward and
backward are timed (median of a few repeats after warm-up); the saved-tensor
bytes of its forward come from :class:`SavedTensorMeter`. Collectives are
measured only inside a distributed run (``parallel.plan=auto``): all-reduce
over each degree's subgroups, all-gather over each resharding group and the
gradient all-reduce over each degree's replicas, at a few message sizes, the
slowest rank's time, fitted to alpha + beta * bytes.

Results go to a profile DB (JSON), keyed by hardware and model/run shape, and
are reused when present.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from oases.config import Config, ModelConfig
from oases.heads import local_kv_heads
from oases.planner.cost import ModelShape, Profile, RunShape
from oases.progress import bar_safe, progress
from oases.schedule.memory import SavedTensorMeter

DEFAULT_DB = Path.home() / ".cache" / "oases" / "profile_db.json"


def hardware_key(device: torch.device) -> str:
    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    else:
        dev = f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
    return f"{platform.node()} | {dev} | torch {torch.__version__}"


def profile_key(device: torch.device, shape: ModelShape, run: RunShape, precision: str) -> str:
    s = dataclasses.asdict(shape)
    key = {"hw": hardware_key(device), "shape": s, "tp": run.tp, "mbs": run.micro_batch_size,
           "sub_batches": run.sub_batches, "precision": precision}
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


def _sync(device: torch.device) -> None:
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
        _sync(device)
        t0 = time.perf_counter()
        rest = [p for p in step() if callable(p)]
        _sync(device)
        times = [time.perf_counter() - t0]
        for phase in rest:
            t0 = time.perf_counter()
            phase()
            _sync(device)
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


def _block(kind: str, cfg: ModelConfig, t: int):
    from models import ARCHS
    from models.common import ParallelAttention, Rotary

    sc = _ShardShape(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)},
                     fixed_head_dim=cfg.head_dim)
    # one rank's share; above n_kv_heads ranks it holds one (replicated) kv head
    sc.n_head, sc.ffn_hidden = cfg.n_head // t, cfg.ffn_hidden // t
    sc.n_kv_heads = local_kv_heads(cfg.n_kv_heads, t)
    proto = ARCHS[cfg.arch]
    lm = proto.__new__(proto)  # only for make_norm / make_mlp / make_rotary
    if kind == "attn":
        rot = proto.make_rotary(lm, cfg)
        return ParallelAttention(sc, proto.make_norm(lm, cfg), None, None,
                                 Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta) if rot else None)
    return proto.make_mlp(lm, sc, proto.make_norm(lm, cfg), None)


def profile_compute(cfg: Config, run: RunShape, device: torch.device, reps: int = 5,
                    warmup: int = 2, log: Callable[[str], None] = print,
                    barrier: Optional[Callable[[], None]] = None) -> Profile:
    """Measure every (block kind, degree) and the constant parts on this device
    (``barrier``: every rank of a job runs this at once; see :func:`_time_phases`)."""
    from models import build_model
    from oases.parallel.sharding import init_parameters

    m = cfg.model
    shape = ModelShape.from_config(m)
    degrees = shape.valid_degrees(run.tp)
    amp = (torch.autocast(device.type, dtype=torch.bfloat16) if cfg.train.precision == "bf16"
           else torch.autocast(device.type, enabled=False))
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
        blk = _block(kind, m, t).to(device)
        if kind == "attn":  # its backward then recomputes the core, and it saves less
            blk.selective = run.recompute == "selective"
        init_parameters(blk, 0, 0, 1)
        x = torch.randn(rows, m.seq_len, m.d_model, device=device, requires_grad=True)
        g = torch.randn_like(x)

        def fwd():
            with amp:
                return blk(x)

        def fwd_then_bwd():
            out = fwd()
            return (lambda: out.backward(g),)

        t_f, t_b = _time_phases(fwd_then_bwd, device, reps, warmup, barrier=barrier)
        with SavedTensorMeter() as meter:
            out = fwd()
            SavedTensorMeter.end_of_forward()
        del out
        blocks[kind][str(t)] = {"fwd": t_f, "bwd": t_b, "saved": meter.forward_bytes,
                                "rows": rows}
        log(f"profile [{n_done}/{len(todo)}] {kind:<4} degree {t}: rows {rows}, "
            f"fwd {1e3 * t_f:.2f} ms, bwd {1e3 * t_b:.2f} ms, "
            f"saved {meter.forward_bytes / 2**20:.1f} MiB ({time.perf_counter() - t_start:.0f}s)")
    # Constant parts at degree T: embedding + final norm + head + loss, one micro-batch.
    consts = progress(total=2, desc="profile constants", unit="part", lines=False)
    head_cfg = dataclasses.replace(m, n_layer=1)
    vocab_local = cfg.padded_vocab_size // run.tp
    model = build_model(dataclasses.replace(head_cfg, vocab_size=min(m.vocab_size, vocab_local)),
                        vocab_local, None, seed=0, device=device)
    model.layers = torch.nn.ModuleList()  # embedding -> norm -> head only
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


def _fit(points: list[tuple[float, float]]) -> list[float]:
    """Least-squares alpha + beta * bytes (alpha, beta >= 0)."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    beta = max(sum((p[0] - mx) * (p[1] - my) for p in points) / var, 0.0) if var else 0.0
    return [max(my - beta * mx, 0.0), beta]


def profile_comm(ctx, sizes=(2**16, 2**20, 2**22), reps: int = 3,
                 log: Callable[[str], None] = print) -> dict:
    """Collective fits on the live cluster; every rank must call it (collective)."""
    dg = ctx.degree_groups()
    T = ctx.tp
    out: dict = {"all_reduce": {}, "all_gather": {}, "grad_all_reduce": {}}

    def measure(kind: str, key: str, group, make) -> None:
        pts = []
        for nbytes in sizes:
            t = 0.0
            if group is not None and dist.get_world_size(group) > 1:
                buf = make(nbytes)
                op = (lambda: dist.all_reduce(buf, group=group)) if kind != "all_gather" else \
                    (lambda: dist.all_gather_into_tensor(
                        torch.empty(buf.numel() * dist.get_world_size(group), device=ctx.device),
                        buf, group=group))
                op()  # warm-up
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    op()
                    if ctx.device.type == "cuda":
                        torch.cuda.synchronize(ctx.device)
                    ts.append(time.perf_counter() - t0)
                t = statistics.median(ts)
            slow = torch.tensor([t], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)  # the slowest group sets the pace
            total = nbytes if kind != "all_gather" else nbytes * (
                dist.get_world_size(group) if group is not None else 1)
            pts.append((float(total), float(slow)))
        out[kind][key] = _fit(pts)
        if ctx.is_main:
            a, b = out[kind][key]
            log(f"profile {kind} {key}: alpha {1e3 * a:.3f} ms, {b and 1 / b / 1e6:.1f} MB/s")

    def f32(nbytes):
        return torch.ones(max(nbytes // 4, 1), device=ctx.device)

    for t in dg.degrees:
        if t > 1:
            measure("all_reduce", str(t), dg.sub[t], f32)
    for a in dg.degrees:
        for b in dg.degrees:
            if a < b:
                measure("all_gather", f"{a}-{b}", dg.reshard_group(a, b),
                        lambda nbytes, k=b // a: f32(nbytes // k))
    for t in dg.degrees:
        if t < T or ctx.dp > 1:
            measure("grad_all_reduce", str(t), dg.grad[t], f32)
    out["cpu_per_byte"] = {}
    for t in dg.degrees:
        if t > 1:
            out["cpu_per_byte"][str(t)] = _cpu_per_byte(ctx, dg.sub[t], out["all_reduce"][str(t)])
            if ctx.is_main:
                log(f"profile compute slowdown under degree-{t} all-reduces: "
                    f"{1e3 * 2**20 * out['cpu_per_byte'][str(t)]:.2f} ms per MiB all-reduced")
    return out


def _cpu_per_byte(ctx, group, fit: list[float]) -> float:
    """Compute time lost per byte all-reduced over ``group`` while compute runs: from the
    host's CPU accounting on CPU ranks (Linux), else from a compute loop's slowdown."""
    if ctx.device.type == "cpu" and _host_busy_s() is not None:
        return _host_cpu_per_byte(ctx, group, fit)
    return _slowdown_per_byte(ctx, group, fit)


def _host_busy_s() -> Optional[float]:
    """CPU-seconds this host's cores have spent working since boot (user, nice, system,
    irq, softirq: not idle, iowait or time a hypervisor stole), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        v = [int(x) for x in fields[1:8]]
    except (OSError, ValueError):
        return None
    if len(v) < 7:
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _host_cpu_per_byte(ctx, group, fit: list[float], nbytes: int = 2**20,
                       window_s: float = 0.4, reps: int = 3) -> float:
    """Host CPU time the collectives take, as compute time lost per byte all-reduced.

    On CPU ranks the communication runs on the cores that compute: gloo's threads and
    the kernel's network stack (on the emulated cluster also the veth, bridge and tc
    work of every link). All ranks all-reduce back to back over ``group`` for about
    ``window_s`` with nothing else to do, and the host's busy CPU-seconds in that
    window (less those of an idle window as long: other load on the machine) are the
    collectives' cost. In a step the host's cores are busy computing, so that cost
    comes out of compute, spread over the cores: every rank on the host loses
    busy / cores seconds, per byte it all-reduced. (Every rank on a host reads the same
    counters, the emulated cluster's namespaces included: nothing is summed over ranks.)
    A direct measurement: timing a compute loop with and without collectives is lost
    in scheduler noise as soon as a host runs more ranks than it has cores."""
    dev = ctx.device
    per_ar = max(fit[0] + fit[1] * nbytes, 1e-4)
    k = max(4, min(64, int(window_s / per_ar) + 1))
    bufs = [torch.ones(nbytes // 4, device=dev) for _ in range(k)]
    cores = os.cpu_count() or 1
    busy = idle = 0.0  # summed over the repeats: one noisy window does not zero the figure
    for _ in range(reps):
        dist.barrier()
        b0, t0 = _host_busy_s(), time.perf_counter()
        for w in [dist.all_reduce(x, group=group, async_op=True) for x in bufs]:
            w.wait()
        dist.barrier()
        b1, dt = _host_busy_s(), time.perf_counter() - t0
        time.sleep(dt)  # the same window with nothing running: the machine's own load
        dist.barrier()
        b2 = _host_busy_s()
        busy, idle = busy + (b1 - b0), idle + (b2 - b1)
    cost = max(0.0, busy - idle) / cores / (reps * k * nbytes)
    res = torch.tensor([cost], dtype=torch.float64, device=dev)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)  # the busiest host sets the pace
    return float(res)


def _slowdown_per_byte(ctx, group, fit: list[float], nbytes: int = 2**20, reps: int = 3) -> float:
    """Compute time lost per byte all-reduced over ``group`` while compute runs.

    On a host whose cores also drive the network (CPU ranks: gloo threads, the
    kernel's TCP stack) communication is not free even when overlapped: it takes
    cycles from the compute it hides behind. This times a fixed matmul loop alone
    and while back-to-back all-reduces run (all ranks at once, as in a step), and
    divides the extra time by the bytes all-reduced meanwhile. ~0 where a NIC or a
    GPU's copy engines move the data."""
    dev = ctx.device
    a = torch.randn(256, 512, device=dev)
    b = torch.randn(512, 512, device=dev)

    def work(n: int) -> float:
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(n):
            a @ b
        _sync(dev)
        return time.perf_counter() - t0

    work(3)
    one = max(work(10) / 10, 1e-7)
    per_ar = max(fit[0] + fit[1] * nbytes, 1e-4)
    # long enough to all-reduce >= 4 MiB meanwhile (slow links), within 0.15..1 s
    n = max(1, int(min(1.0, max(0.15, 4 * per_ar)) / one))
    lost, moved = [], []
    for _ in range(reps):
        dist.barrier()
        own = work(n)
        alone = torch.tensor([own], dtype=torch.float64, device=dev)
        dist.all_reduce(alone, op=dist.ReduceOp.MAX)  # same count of collectives on every rank
        k = min(64, int(1.5 * float(alone) / per_ar) + 2)  # enough to outlast the loop
        bufs = [torch.ones(nbytes // 4, device=dev) for _ in range(k)]
        dist.barrier()
        t0 = time.perf_counter()
        works = [dist.all_reduce(x, group=group, async_op=True) for x in bufs]
        loaded = work(n)
        for w in works:
            w.wait()
        _sync(dev)
        comm = time.perf_counter() - t0
        lost.append(max(loaded - own, 0.0))
        moved.append(k * nbytes * min(1.0, loaded / max(comm, 1e-9)))  # bytes during the loop
    res = torch.tensor([statistics.median(lost) / max(statistics.median(moved), 1.0)],
                       dtype=torch.float64, device=dev)
    dist.all_reduce(res, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(res)


def get_profile(cfg: Config, run: RunShape, device: torch.device, db_path: Optional[Path],
                log: Callable[[str], None] = print, force: bool = False,
                barrier: Optional[Callable[[], None]] = None) -> Profile:
    """Compute profile from the DB, or measured now (and stored)."""
    shape = ModelShape.from_config(cfg.model)
    key = profile_key(device, shape, run, cfg.train.precision)
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
    key = profile_key(device, ModelShape.from_config(cfg.model), run, cfg.train.precision)
    db = load_db(db_path)
    db[key] = {"blocks": prof.blocks, "constant": prof.constant}
    save_db(db_path, db)
    log(f"profile: saved to {db_path}")

