"""Sharded data parallelism (ZeRO-1/2/3) over the gradient reducer's buckets.

A bucket (:mod:`oases.dp.reducer`) is a flat run of one block's parameters whose
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

With a node-local secondary shard (``parallel.zero_secondary=node``, ZeRO++'s hpZ), a
level-3 bucket also keeps 1/L of its parameters in the compute dtype, L being the ranks
of its group on this node. The first gather of a bucket after its owned range changed
(an optimizer step, a checkpoint load: the range's version counter tells) runs over the
whole group, the update crossing nodes once, and keeps this rank's 1/L of it; every
other gather (forward, recompute, backward, the step's other micro-batches) runs over
the node's ranks only.

The optimizer never sees a whole parameter of a sharded bucket. It sees one
*segment* per parameter that overlaps the owned range: a view into the owned
parameter range, with ``.grad`` a view into the owned gradient range and Adam's
``exp_avg``/``exp_avg_sq`` views into two flat buffers of the owned length. So
one ``torch.optim.AdamW`` steps level-0 parameters and segments alike, weight
decay stays per parameter, and the Adam state of a bucket is two flat tensors
that a checkpoint writes as they are, each rank its own range
(:mod:`oases.runtime.ckpt_format`).

Freeing is ``untyped_storage().resize_(0)`` on a flat buffer: every parameter
(or ``.grad``) stays the same tensor object, a view whose storage comes and
goes. Autograd's saved references to a parameter see the data again once the
buffer is re-gathered, which :class:`~oases.dp.store.ParamStore` guarantees before any use.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.parallel.comm import CommCounter, group_rank, group_size, launch_observed

LEVELS = (0, 1, 2, 3)


def weak_hook(method: Callable[..., None], with_arg: bool = True) -> Callable[[object], None]:
    """An autograd hook that calls the bound ``method`` (with the hook's argument, or
    none) while its object lives. The hook lives in the parameters' C++ autograd
    metadata and the object holds the parameters, so it holds the object weakly: a
    strong reference would make a cycle through C++ the garbage collector never frees.
    Returns None (a tensor hook that returned a value would replace the gradient)."""
    ref = weakref.WeakMethod(method)

    def hook(arg) -> None:
        m = ref()
        if m is not None:
            m(arg) if with_arg else m()

    return hook


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
    work = launch_observed("zero-gather", group, full.device, lambda: dist.all_gather_into_tensor(
        full, shard, group=group, async_op=True))
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
    if dist.get_backend(group) == "gloo":
        return launch_observed("reduce-scatter", group, full.device,
                               lambda: dist.all_reduce(full, group=group, async_op=True))
    return launch_observed("reduce-scatter", group, full.device,
                           lambda: dist.reduce_scatter_tensor(out, full, group=group,
                                                              async_op=True))


class Widen:
    """A gather into ``full``: ``wait()`` waits for it (the current stream), copies the
    gathered values into the parameters' flat buffer (unless ``full`` is that buffer) and
    hands them to ``keep`` (the secondary shard's refresh), on that stream."""

    def __init__(self, work, full: torch.Tensor, sent: torch.Tensor, flat: torch.Tensor,
                 keep: Optional[Callable[[torch.Tensor], None]] = None):
        self.work, self.full, self.sent, self.flat, self.keep = work, full, sent, flat, keep

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            if self.full is not self.flat:
                self.flat.copy_(self.full)
            if self.keep is not None:
                self.keep(self.full)
            self.work = self.full = self.sent = self.keep = None  # sent lived until here
        return True


class NodeShard:
    """A level-3 bucket's node-local secondary shard: ``group`` the ranks of its group
    on this node (None: this rank alone), ``size`` L of them, ``rank`` this one's index."""

    def __init__(self, group, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank


class ShardedFlat:
    """The ZeRO state of one bucket: its flat parameters (parameters become views into
    them), the owned parameter range, the owned gradient range (level >= 2) and the
    optimizer segments with their flat Adam state."""

    def __init__(self, params: list[nn.Parameter], grads: torch.Tensor, group,
                 level: int, wire: Optional[torch.dtype] = None,
                 gather_dtype: Optional[torch.dtype] = None,
                 node: Optional[NodeShard] = None, master: bool = False) -> None:
        """``wire``: the dtype the gradients are reduce-scattered in (None: theirs);
        ``gather_dtype``: the dtype level 3 gathers the parameters in for compute (None:
        theirs; the owned range stays the exact master either way); ``node``: level 3
        keeps a node-local secondary shard (see the module's docstring). ``master``:
        bf16 compute weights (:mod:`oases.dp.master`): the parameters are views of a flat
        in ``gather_dtype``, the owned range is an fp32 copy at every level (the
        optimizer's master), and every gather (level 3's, levels 1-2's after the step)
        moves ``gather_dtype``."""
        self.params, self.group, self.level = params, group, level
        self.wire = wire
        self.master = master and gather_dtype is not None
        self.gather_dtype = (gather_dtype if level >= 3 and gather_dtype != grads.dtype
                             and not self.master else None)
        self._sent: Optional[torch.Tensor] = None      # the full gradients in ``wire``
        self._summed: Optional[torch.Tensor] = None    # the owned range's sum in ``wire``
        self.G, self.r = group_size(group), group_rank(group)
        n = grads.numel()
        assert n % self.G == 0, "the bucket's flat length is padded to the group size"
        self.s = n // self.G
        self.lo, self.hi = self.r * self.s, (self.r + 1) * self.s
        p0 = params[0]
        flat = torch.zeros(n, device=p0.device, dtype=p0.dtype)
        self.offsets = []
        off = 0
        with torch.no_grad():
            for p in params:
                flat[off: off + p.numel()].copy_(p.data.reshape(-1))
                self.offsets.append(off)
                off += p.numel()
            own = flat[self.lo: self.hi]
            # the persistent parameters (the optimizer's master under bf16 compute weights)
            self.shard = own.clone() if level >= 3 or self.master else own
            self.flat = flat.to(gather_dtype) if self.master else flat
            for p, o in zip(params, self.offsets):
                p.data = self.flat[o: o + p.numel()].view_as(p)
        self.node = node if level >= 3 else None
        if self.node is not None:
            L = self.node.size
            assert n % L == 0, "the bucket's flat length is padded to the group size"
            self.sec_lo = self.node.rank * (n // L)
            # this rank's 1/L of the parameters in the compute dtype, and the version of the
            # owned range it was taken from (another: the next gather refreshes it)
            self.sec = self.flat[self.sec_lo: self.sec_lo + n // L].to(
                self.gather_dtype or self.flat.dtype, copy=True)
            self.sec_version = self.shard._version
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
        self.exp_avg = torch.zeros(self.s, device=p0.device, dtype=self.shard.dtype)
        self.exp_avg_sq = torch.zeros(self.s, device=p0.device, dtype=self.shard.dtype)
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
        if self.wire is None:
            self.rs_work = reduce_scatter_flat(self.grad_shard, self.grads, self.group)
            return self.rs_work
        self._sent = self.grads.to(self.wire)
        free_(self.grads)  # stream-ordered: the cast above reads it first
        self._summed = torch.empty(self.s, device=self._sent.device, dtype=self.wire)
        self.rs_work = reduce_scatter_flat(self._summed, self._sent, self.group)
        return self.rs_work

    def finish_reduce(self, dp: int) -> None:
        if self.rs_work is not None:
            # orders the current stream only: the step's kernels, which read grad_shard
            # and reuse the freed buffer, all run on the default stream
            self.rs_work.wait()
            self.rs_work = None
            gloo = dist.get_backend(self.group) == "gloo"  # an all-reduce: keep the owned range
            if self._sent is not None:
                self.grad_shard.copy_(self._sent[self.lo: self.hi] if gloo else self._summed)
                self._sent = self._summed = None
            elif gloo:
                self.grad_shard.copy_(self.grads[self.lo: self.hi])
        free_(self.grads)
        if dp > 1:
            self.grad_shard.div_(dp)

    # -- parameters ----------------------------------------------------------
    def gather(self, async_op: bool, exact: bool = False):
        """All-gather the parameters into ``flat``; at level 3 with a ``gather_dtype``, in
        that dtype (half the bytes for bf16), widened into ``flat`` when the returned
        work is waited for. ``exact``: in the parameters' own dtype (inspection; under
        bf16 compute weights the parameters are the masters' rounding either way)."""
        alloc_(self.flat)
        if self.node is not None and not exact:
            return self._gather_node(async_op)
        wire = self.flat.dtype if self.master else None if exact else self.gather_dtype
        if wire is None:
            return gather_flat(self.flat, self.shard, self.group, async_op)
        full = self.flat if wire == self.flat.dtype else torch.empty(
            self.flat.numel(), device=self.flat.device, dtype=wire)
        sent = self.shard.to(wire)
        work = Widen(gather_flat(full, sent, self.group, async_op=True), full, sent, self.flat)
        if async_op:
            return work
        work.wait()
        return None

    def _gather_node(self, async_op: bool):
        """Level 3 with a secondary shard: over the node's ranks from it; over the whole
        group (the update crossing nodes) when the owned range changed since it was
        taken, keeping this rank's share of the result."""
        dtype = self.sec.dtype
        full = self.flat if dtype == self.flat.dtype else torch.empty(
            self.flat.numel(), device=self.flat.device, dtype=dtype)
        if self.shard._version != self.sec_version:  # stepped or loaded: refresh
            sent = self.shard.to(dtype)
            version = self.shard._version

            def keep(got: torch.Tensor) -> None:
                self.sec.copy_(got[self.sec_lo: self.sec_lo + self.sec.numel()])
                self.sec_version = version

            work = Widen(gather_flat(full, sent, self.group, async_op=True), full, sent,
                         self.flat, keep)
        elif self.node.group is None:  # the only rank of its group on this node
            self.flat.copy_(self.sec)
            work = Widen(None, self.flat, self.sec, self.flat)  # done
        else:
            work = Widen(gather_flat(full, self.sec, self.node.group, async_op=True), full,
                         self.sec, self.flat)
        if async_op:
            return work
        work.wait()
        return None

    def sync_params(self) -> None:
        """After the optimizer updated the owned range (level 1, 2): start the all-gather
        of every rank's range into the full parameters; the parameter store waits for it
        before the block is next used, so it overlaps the next step's earlier blocks."""
        # a copy: the output overlaps the owned range (bf16 weights: the masters' rounding)
        self._send = self.shard.to(self.flat.dtype, copy=True)
        self.work = gather_flat(self.flat, self._send, self.group, async_op=True)

    def settle(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None
            self._send = None

    # -- inspection ------------------------------------------------------------
    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every parameter's whole Adam state (collective over the bucket's group; tests
        compare levels with it, checkpoints write the owned ranges)."""
        out = {}
        fulls = {}
        for key, t in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
            full = torch.empty(self.G * self.s, device=t.device, dtype=t.dtype)
            gather_flat(full, t, self.group)
            fulls[key] = full
        for p, o in zip(self.params, self.offsets):
            out[p] = {k: v[o: o + p.numel()].view_as(p) for k, v in fulls.items()}
        return out
