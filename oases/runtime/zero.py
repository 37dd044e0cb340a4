"""Sharded data parallelism (ZeRO-1/2/3) over the gradient reducer's buckets.

A bucket (``runtime/dp.py``) is a flat run of one block's parameters whose
gradients are summed over one group of G ranks (the DP group, or the gradient
group of a block below the full TP degree). At ZeRO level >= 1 the bucket's
flat length is padded to a multiple of G and rank r of the group *owns* the
range ``[r s, (r + 1) s)``, ``s = n / G``:

    level 0  params full   grads full              Adam state full    (today)
    level 1  params full   grads full, all-reduce  Adam state of the owned range
    level 2  params full   grads: reduce-scatter into the owned range; the full
                           gradient buffer exists only during the backward
    level 3  + params: the owned range is the only persistent copy; the full
               parameters are all-gathered before the block runs and freed after

The optimizer never sees a whole parameter of a sharded bucket. It sees one
*segment* per parameter that overlaps the owned range: a view into the owned
parameter range, with ``.grad`` a view into the owned gradient range and Adam's
``exp_avg``/``exp_avg_sq`` views into two flat buffers of the owned length. So
one ``torch.optim.AdamW`` steps level-0 parameters and segments alike, weight
decay stays per parameter, and the Adam state of a bucket is two flat tensors
that one all-gather makes whole again (checkpoints, :meth:`ShardedFlat.full_state`).

Freeing is ``untyped_storage().resize_(0)`` on a flat buffer: every parameter
(or ``.grad``) stays the same tensor object, a view whose storage comes and
goes. Autograd's saved references to a parameter see the data again once the
buffer is re-gathered, which :class:`ParamStore` guarantees before any use.
"""

from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.parallel.comm import CommCounter, active_observers, group_rank, group_size

LEVELS = (0, 1, 2, 3)


def free_(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def alloc_(t: torch.Tensor) -> bool:
    """Give a freed flat buffer its storage back; True if it had none."""
    nbytes = t.numel() * t.element_size()
    st = t.untyped_storage()
    if st.size() == nbytes:
        return False
    st.resize_(nbytes)
    return True


def is_freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() == 0


def gather_flat(full: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """All-gather the owned ranges into ``full`` (ranks' ranges in rank order)."""
    CommCounter.record("all_gather", shard)
    start = time.perf_counter()
    work = dist.all_gather_into_tensor(full, shard, group=group, async_op=True)
    for obs in active_observers():
        obs.collective("zero-gather", "comm", work, start)
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group):
    """Start the sum of ``full`` over ``group`` scattered by owned range into ``out``.

    On gloo this is an all-reduce of ``full`` (the caller copies its range out after the
    wait, :meth:`ShardedFlat.finish_reduce`): gloo's reduce-scatter runs 2.4x below the
    link rate where its all-reduce, which moves twice the bytes, runs at it (measured on
    the emulated 500 Mbit/s link: 0.48 s vs 0.43 s for 25.6 MB), so the all-reduce is
    the faster way to the same sum there. NCCL gets the real reduce-scatter."""
    CommCounter.record("reduce_scatter", full)
    start = time.perf_counter()
    if dist.get_backend(group) == "gloo":
        work = dist.all_reduce(full, group=group, async_op=True)
    else:
        work = dist.reduce_scatter_tensor(out, full, group=group, async_op=True)
    for obs in active_observers():
        obs.collective("reduce-scatter", "comm", work, start)
    return work


class ShardedFlat:
    """The ZeRO state of one bucket: its flat parameters (parameters become views into
    them), the owned parameter range, the owned gradient range (level >= 2) and the
    optimizer segments with their flat Adam state."""

    def __init__(self, params: list[nn.Parameter], grads: torch.Tensor, group,
                 level: int) -> None:
        self.params, self.group, self.level = params, group, level
        self.G, self.r = group_size(group), group_rank(group)
        n = grads.numel()
        assert n % self.G == 0, "the bucket's flat length is padded to the group size"
        self.s = n // self.G
        self.lo, self.hi = self.r * self.s, (self.r + 1) * self.s
        p0 = params[0]
        self.flat = torch.zeros(n, device=p0.device, dtype=p0.dtype)
        self.offsets = []
        off = 0
        with torch.no_grad():
            for p in params:
                self.flat[off: off + p.numel()].copy_(p.data.reshape(-1))
                p.data = self.flat[off: off + p.numel()].view_as(p)
                self.offsets.append(off)
                off += p.numel()
        own = self.flat[self.lo: self.hi]
        self.shard = own.clone() if level >= 3 else own   # the persistent parameters
        self.grads = grads                                 # the full gradient buffer
        self.grad_shard = (torch.zeros(self.s, device=grads.device, dtype=grads.dtype)
                           if level >= 2 else grads[self.lo: self.hi])
        if level >= 2:
            free_(grads)
        if level >= 3:
            free_(self.flat)
        self.work = None        # the all-gather of ``flat`` in flight (level 3)
        self.rs_work = None     # the reduce-scatter in flight (level >= 2)
        self.segments: list[tuple[torch.Tensor, nn.Parameter]] = []
        self.exp_avg = torch.zeros(self.s, device=p0.device, dtype=p0.dtype)
        self.exp_avg_sq = torch.zeros(self.s, device=p0.device, dtype=p0.dtype)
        self._seg_ranges = []
        for p, o in zip(params, self.offsets):
            a, b = max(o, self.lo), min(o + p.numel(), self.hi)
            if a < b:
                seg = self.shard[a - self.lo: b - self.lo]
                seg.grad = self.grad_shard[a - self.lo: b - self.lo]
                self.segments.append((seg, p))
                self._seg_ranges.append((a - self.lo, b - self.lo))

    # -- optimizer --------------------------------------------------------
    def seed_state(self, opt: torch.optim.Optimizer) -> None:
        """Adam state of the segments as views into the flat state buffers (AdamW
        updates it in place, so the flat buffers are the state)."""
        fused = any(g.get("fused") for g in opt.param_groups)
        for (seg, _), (a, b) in zip(self.segments, self._seg_ranges):
            opt.state[seg] = {
                "step": torch.zeros((), dtype=torch.float32,
                                    device=seg.device if fused else "cpu"),
                "exp_avg": self.exp_avg[a:b], "exp_avg_sq": self.exp_avg_sq[a:b]}

    def attach_grads(self) -> None:
        for (seg, _), (a, b) in zip(self.segments, self._seg_ranges):
            seg.grad = self.grad_shard[a:b]

    # -- gradients ---------------------------------------------------------
    def ensure_grads(self) -> None:
        """Before the first gradient of a backward lands (level >= 2): a zero full buffer."""
        if alloc_(self.grads):
            self.grads.zero_()

    def launch_reduce(self):
        self.rs_work = reduce_scatter_flat(self.grad_shard, self.grads, self.group)
        return self.rs_work

    def finish_reduce(self, dp: int) -> None:
        if self.rs_work is not None:
            self.rs_work.wait()
            self.rs_work = None
            if dist.get_backend(self.group) == "gloo":  # an all-reduce: keep the owned range
                self.grad_shard.copy_(self.grads[self.lo: self.hi])
        free_(self.grads)
        if dp > 1:
            self.grad_shard.div_(dp)

    # -- parameters ----------------------------------------------------------
    def gather(self, async_op: bool):
        alloc_(self.flat)
        return gather_flat(self.flat, self.shard, self.group, async_op)

    def sync_params(self) -> None:
        """After the optimizer updated the owned range (level 1, 2): start the all-gather
        of every rank's range into the full parameters; :class:`ParamStore` waits for it
        before the block is next used, so it overlaps the next step's earlier blocks."""
        self._send = self.shard.clone()  # the output overlaps the owned range
        self.work = gather_flat(self.flat, self._send, self.group, async_op=True)

    def settle(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self._send = None

    def write_back(self) -> None:
        """Full parameters were written (a checkpoint load): keep the owned range."""
        if self.level >= 3:
            self.shard.copy_(self.flat[self.lo: self.hi])

    # -- checkpoints -----------------------------------------------------------
    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every parameter's whole Adam state (collective over the bucket's group)."""
        out = {}
        fulls = {}
        for key, t in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            full = torch.empty(self.G * self.s, device=t.device, dtype=t.dtype)
            gather_flat(full, t, self.group)
            fulls[key] = full
        for p, o in zip(self.params, self.offsets):
            out[p] = {k: v[o: o + p.numel()].view_as(p) for k, v in fulls.items()}
        return out

    def load_state(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        for p, o in zip(self.params, self.offsets):
            st = state.get(p)
            if not st:
                continue
            a, b = max(o, self.lo), min(o + p.numel(), self.hi)
            if a >= b:
                continue
            for key, t in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                if key in st:
                    t[a - self.lo: b - self.lo].copy_(st[key].reshape(-1)[a - o: b - o])


class ParamStore:
    """Gathers a level-3 unit's parameters before use and frees them after; waits for a
    level-1/2 unit's post-step all-gather before its first use.

    A *unit* is one block of the model's block protocol (index as in
    ``model.blocks()``), or the parameters outside every block (norm and head: the
    last index). ``use(u, nxt)`` makes unit u's parameters whole (waiting for its
    prefetch, or gathering now) and starts the all-gather of unit ``nxt``, so the
    next block's gather runs during this block's compute, in forward (nxt = u + 1)
    and backward (nxt = u - 1); the gathers of ``depth`` units ahead are queued. At
    most ``keep + depth`` units stay gathered; the least recently used one is freed
    first (so the last blocks of the forward are still whole when backward starts).
    A unit is never used without ``use``: the engines call it before a block's
    forward, recompute and backward, and hooks on the model cover plain
    ``model(...)`` calls (the megatron engine, evaluation).
    Every rank of a unit's group makes the same calls in the same order (they run
    the same schedule), so the all-gathers match. ``release()`` (end of every
    backward pass of a step, before the optimizer changes the owned ranges) frees all.
    """

    def __init__(self, units: dict[int, list[ShardedFlat]], head: int, tied: bool,
                 keep: int = 4, prefetch: bool = True,
                 pending: Optional[dict[int, list[ShardedFlat]]] = None) -> None:
        self.units = {u: fl for u, fl in units.items() if fl}
        self.pending = {u: fl for u, fl in (pending or {}).items() if fl}  # levels 1, 2
        self.head, self.tied, self.keep, self.prefetch = head, tied, keep, prefetch
        self.depth = 2          # units gathered ahead (queued in order on the group)
        self.wait_s = 0.0       # time spent waiting for all-gathers (exposed), since take_wait
        self._gathered: dict[int, int] = {}   # unit -> last use (a counter)
        self._clock = 0
        self.gathers = 0        # all-gathers issued (tests, the benchmark)
        self.late = 0           # of which not prefetched: the caller waited for them

    def use(self, u: int, nxt: Optional[int] = None) -> None:
        if u in self.pending:
            t0 = time.perf_counter()
            for fl in self.pending[u]:
                fl.settle()
            self.wait_s += time.perf_counter() - t0
        if u not in self.units:
            self._prefetch(u, nxt)
            return
        self._clock += 1
        if u not in self._gathered:
            self.late += 1
            self._launch(u)
        self._gathered[u] = self._clock
        t0 = time.perf_counter()
        for fl in self.units[u]:
            if fl.work is not None:
                fl.work.wait()
                fl.work = None
        self.wait_s += time.perf_counter() - t0
        self._prefetch(u, nxt)
        self._evict(u, nxt)

    def _prefetch(self, u: int, nxt: Optional[int]) -> None:
        """Launch the gathers of the next ``depth`` units in the direction u -> nxt (the
        head counts as the unit after the last block)."""
        if not self.prefetch or nxt is None:
            return
        step = nxt - u
        for k in range(self.depth):
            v = nxt + k * step
            if v in self.units and v not in self._gathered:
                self._launch(v)

    def use_head(self) -> None:
        """The head's parameters, and with tied embeddings (pp = 1) the embedding's."""
        if self.tied:
            self.use(0)
        self.use(self.head)

    def _launch(self, u: int) -> None:
        if u in self._gathered:
            return
        for fl in self.units[u]:
            fl.work = fl.gather(async_op=True)
        self.gathers += 1
        self._gathered[u] = self._clock

    def _evict(self, u: int, nxt: Optional[int]) -> None:
        ahead = set()
        if nxt is not None:
            ahead = {nxt + k * (nxt - u) for k in range(self.depth)}
        while len(self._gathered) > self.keep + self.depth:
            cands = [k for k in self._gathered if k != u and k not in ahead]
            if not cands:
                return
            self._free(min(cands, key=lambda k: self._gathered[k]))

    def _free(self, u: int) -> None:
        for fl in self.units[u]:
            if fl.work is not None:
                fl.work.wait()
                fl.work = None
            free_(fl.flat)
        del self._gathered[u]

    @contextlib.contextmanager
    def two_passes(self):
        """A backward and a forward interleaved (``overlap_fb``) use blocks from both ends
        at once: keep the other pass's window (its block and the ``depth`` ahead) as well,
        so the two do not evict each other's prefetched blocks."""
        self.keep += 1 + self.depth
        try:
            yield
        finally:
            self.keep -= 1 + self.depth

    def take_wait(self) -> float:
        """Seconds spent waiting for all-gathers since the last call."""
        w, self.wait_s = self.wait_s, 0.0
        return w

    def release(self) -> None:
        for fls in self.pending.values():
            for fl in fls:
                fl.settle()
        for u in list(self._gathered):
            self._free(u)

    def sync_params(self) -> None:
        """Levels 1, 2 after the optimizer step: launch the all-gathers in forward order."""
        for u in sorted(self.pending):
            for fl in self.pending[u]:
                fl.sync_params()

    def gather_all(self) -> None:
        """Every unit whole, until :meth:`release` (checkpoints, loading weights)."""
        for fls in self.pending.values():
            for fl in fls:
                fl.settle()
        for u in sorted(self.units):
            for fl in self.units[u]:
                if fl.work is not None:
                    fl.work.wait()
                    fl.work = None
                elif is_freed(fl.flat):
                    fl.gather(async_op=False)
            self._gathered[u] = self._clock

    def install_hooks(self, model: nn.Module) -> list:
        """Hooks for plain ``model(...)`` calls: a block's forward uses it and prefetches
        the next; the gradient of a block's output (its backward is next) uses it and
        prefetches the block below; the final norm uses the head; the gradient of the
        model's output (backward starts) uses the head or, on a pipeline stage before
        the last, the last block."""
        handles = []
        blocks = model.blocks() if hasattr(model, "blocks") else []
        for i, blk in enumerate(blocks):
            handles.append(blk.register_forward_pre_hook(
                lambda m, args, i=i: self.use(i, i + 1)))
            handles.append(blk.register_forward_hook(
                lambda m, args, out, i=i: self._on_output(out, i, i - 1)))
        norm = getattr(model, "norm", None)
        if isinstance(norm, nn.Module) and getattr(model, "is_last", True):
            handles.append(norm.register_forward_pre_hook(lambda m, args: self.use_head()))
            last = self.head
        else:
            last = len(blocks) - 1
        handles.append(model.register_forward_hook(
            lambda m, args, out: self._on_output(out, last, len(blocks) - 1)))
        return handles

    def _on_output(self, out, u: int, nxt: int) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            def hook(g):
                if u == self.head and self.tied:
                    self.use(0)
                self.use(u, nxt)
            out.register_hook(hook)
