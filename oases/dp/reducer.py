"""Data-parallel gradient averaging: bucketed, overlapped with backward.

Gradients live in flat per-bucket buffers (``param.grad`` is a view into them),
so one all-reduce covers a whole bucket. Buckets are filled in reverse
parameter order, roughly the order backward produces gradients, and never span
two blocks of the model's block protocol (``model.blocks()``): a block's
gradients leave as soon as its backward is done, rather than waiting for the
blocks below it to fill the bucket (the planner's cost model counts on that). During the
backward of the *last* micro-batch of a step (``arm()``), a post-accumulate
hook counts how often each parameter's gradient was accumulated; once every
parameter of a bucket has had all its accumulations, the bucket's all-reduce
starts asynchronously and runs while backward continues with earlier layers.
How many accumulations a parameter gets per backward depends on the schedule
(one under plain autograd; one per sub-batch, and more for tied weights, under
``oases``), so the first armed backward only counts (calibration) and its
buckets are all reduced in ``finish()``.
``finish()`` launches any bucket that never completed (unused parameters),
then waits on every handle exactly once and divides by dp.

ZeRO (``level_of``, :mod:`oases.dp.zero`): a bucket at level 2 or 3 is
reduce-scattered instead of all-reduced, into the range of the flat bucket this
rank owns, and its full gradient buffer exists only from the first gradient of
the armed backward (a pre-accumulation hook gives it storage) to the end of the
reduction. Levels 1-3 give the optimizer segments of the owned range
(:meth:`ZeroOwnership.optimizer_params`); ``after_step`` all-gathers the
updated parameters (levels 1, 2), and at level 3 a
:class:`~oases.dp.store.ParamStore` gathers each block's parameters before use. The
tied embedding of a pipeline's first and last stage stays at level 0 (its group spans
two stages). The reducer owns the buckets and their reduction only: what this rank
owns of them, and what the optimizer and checkpoints see, is its
:class:`~oases.dp.ownership.ZeroOwnership` (``reducer.ownership``).

bf16 compute weights (``train.precision=bf16``, ``master``, :mod:`oases.dp.master`):
the buckets are fp32 *main-grads* (``param.main_grad`` the view) and ``param.grad`` is
only the bf16 gradient of one accumulation, which the same post-accumulate hook (then
registered at any dp) adds into the main-grad and drops; the optimizer steps fp32
masters whose ``.grad`` are the main-grad views (level 0: :class:`MasterCopy` per
bucket; levels 1-3: the owned ranges). Readers of gradients use ``grad_of``.

Averaging over dp is the gradient of the global batch's loss only if each replica's
backward was seeded with dp times its share of that loss: ``train_step`` does so
(:func:`oases.runtime.step.step_shares`), so replicas whose rows count different
numbers of targets (padding, masked prompts) still add up to the gradient of one
mean over every counted target; when every target counts, the share is 1/dp and the
seed the plain mean's.

Ordering: all DP ranks run the same graph, so the hooks fire, and buckets
launch, in the same order on every rank (gloo and NCCL need that).
On CUDA, the hooks run on autograd's device thread: a bucket launched there goes out in
the comm scope ``arm()`` captured (:class:`~oases.parallel.comm.CommScope`), so the
step's counters and observers see it. Its all-reduce waits for the default stream (which
produced the gradients) on NCCL's stream; ``work.wait()`` in ``finish()`` makes the
current stream, which the optimizer then runs on, wait for it. Both hold only while
the whole step runs on the default stream, which ``arm()`` checks.

The hooks live in the parameters' C++ autograd metadata, out of the cycle collector's
sight: they reach the reducer through a weak reference, so a reducer dropped without
:meth:`GradReducer.close` does not keep itself, nor its model, alive.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.dp.accounting import held_memory
from oases.dp.master import MasterCopy, accumulate_main_grad, grad_of
from oases.dp.ownership import ZeroOwnership
from oases.dp.zero import NodeShard, ShardedFlat, weak_hook
from oases.parallel.comm import (all_reduce, comm_scope, current_scope, group_size,
                                 require_default_stream)


# parallel.grad_reduce_dtype: the dtype buckets are summed in (None: the gradients' own)
REDUCE_DTYPES: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16}


class _Bucket:
    def __init__(self, params: list[nn.Parameter], group, device, dtype,
                 prescale: Optional[float] = None, level: int = 0,
                 wire: Optional[torch.dtype] = None,
                 gather_dtype: Optional[torch.dtype] = None,
                 node: Optional[NodeShard] = None, master: bool = False) -> None:
        self.params = params
        self.group = group
        # the dtype the gradients cross the links in (None: the buffer's): the buffer keeps
        # accumulating in its own dtype, a copy in ``wire`` is summed and copied back
        self.wire = wire if wire is not None and wire != dtype else None
        self.sent: Optional[torch.Tensor] = None  # that copy, while its sum is in flight
        self.prescale = prescale  # multiply before the sum instead of dividing by dp after
        G = group_size(group)
        self.level = level if G > 1 and prescale is None else 0
        n = sum(p.numel() for p in params)
        n += (-n) % G if self.level else 0  # ZeRO: a whole owned range per rank
        self.buffer = torch.zeros(n, device=device, dtype=dtype)
        self.ready = 0      # params whose accumulations are complete
        self.need = 0       # params that get gradients at all (known after calibration)
        self.work = None
        # bf16 compute weights over fp32 masters (oases.dp.master): the buffer is the
        # parameters' main-grad, p.grad only the bf16 gradient of one accumulation
        self.master = master and gather_dtype is not None
        self.views = []     # param.grad must stay these views (see GradReducer.finish)
        off = 0
        for p in params:
            self.views.append(self.buffer[off: off + p.numel()].view_as(p))
            if self.master:
                p.main_grad = self.views[-1]
            else:
                p.grad = self.views[-1]
            off += p.numel()
        self.zero = (ShardedFlat(params, self.buffer, group, self.level, self.wire,
                                 gather_dtype, node, self.master) if self.level else None)
        self.copy = (MasterCopy(params, self.buffer, gather_dtype)
                     if self.master and not self.level else None)

    def attach(self) -> None:
        if self.copy is not None:
            self.copy.attach()
        if self.master:  # no bf16 gradient outlives its accumulation into the main-grad
            for p in self.params:
                p.grad = None
            return
        for p, v in zip(self.params, self.views):
            p.grad = v

    def detached(self) -> Optional[nn.Parameter]:
        """A parameter whose ``.grad`` (under bf16 compute weights: its master's) is no
        longer its view into the buffer, if any."""
        if self.master:
            return self.copy.detached() if self.copy is not None else None
        for p, v in zip(self.params, self.views):
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                return p
        return None


class GradReducer:
    """``group_of(param)`` gives the group a parameter's gradient is summed over
    (default: the DP group); the sum is divided by dp. With per-block TP degrees
    that group also spans the replicas of the block (oases.parallel.reshard)."""

    def __init__(self, model: nn.Module, dp_group, bucket_mb: float = 25.0,
                 group_of: Optional[Callable[[nn.Parameter], object]] = None,
                 prescale_of: Optional[Callable[[nn.Parameter], Optional[float]]] = None,
                 then: Optional[Callable[[], None]] = None,
                 level_of: Optional[Callable[[nn.Parameter], int]] = None,
                 tied_head: bool = False, prefetch: bool = True,
                 zero: bool = False, reduce_dtype: Optional[torch.dtype] = None,
                 gather_dtype: Optional[torch.dtype] = None,
                 node: Optional[NodeShard] = None, master: bool = False) -> None:
        """``prescale_of(param)``: for a parameter whose gradient group is not a plain DP
        group (the tied embedding of a pipeline's first and last stage, summed over both
        stages' replicas), the factor its local gradient is multiplied by before the sum;
        such a bucket is not divided by dp afterwards. ``then``: a collective to run at the
        end of every :meth:`finish` (:class:`TiedTableSync`). ``level_of(param)``: the
        ZeRO level of the parameter's block (default 0); ``tied_head``: the head uses
        the embedding block's table (level 3 gathers it for the head too). ``zero``: the
        run asks for ZeRO anywhere (the same on every rank, every stage): clipping then
        measures the owned pieces, with the same collectives everywhere. ``reduce_dtype``
        (``parallel.grad_reduce_dtype``): the dtype DP buckets are summed in (default:
        the gradients'); gradients still accumulate in theirs, and the sum lands there.
        ``gather_dtype``: the compute dtype, which level 3 gathers parameters in.
        ``node``: the DP group's ranks on this node; level-3 buckets over the DP group keep
        a secondary shard over them (``parallel.zero_secondary=node``). ``master``: the
        parameters become ``gather_dtype`` (the compute dtype) over fp32 master weights
        and main-grads (``train.precision=bf16``, :mod:`oases.dp.master`)."""
        self._then = then
        self._master = master and gather_dtype is not None
        self._reduce_dtype = reduce_dtype
        self._gather_dtype = gather_dtype
        self._node = node
        self.norm_by_terms = zero  # clip_grads: measure through grad_terms
        self.dp_group = dp_group
        self.dp = 1 if dp_group is None else dist.get_world_size(dp_group)
        self.armed = False
        self._scope = None  # the comm scope of the armed backward (arm to finish)
        self._hits: dict[int, int] = {}
        self._expected: dict[int, int] | None = None
        params = [p for p in model.parameters() if p.requires_grad]
        self._names = [(n, p) for n, p in model.named_parameters()]
        group_of = group_of or (lambda p: dp_group)
        self._prescale_of = prescale_of or (lambda p: None)
        self._level_of = level_of or (lambda p: 0)
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        limit = int(bucket_mb * 2**20)
        block_of: dict[int, int] = {}  # parameter -> its block (others: -1)
        for i, blk in enumerate(model.blocks()):
            for p in blk.parameters():
                block_of.setdefault(id(p), i)
        # per group: (group, params, bytes, block of those params)
        open_: dict[int, tuple[object, list, int, int]] = {}
        for p in reversed(params):
            g = group_of(p)
            key = id(g)
            blk = block_of.get(id(p), -1)
            grp, cur, size, cur_blk = open_.get(key, (g, [], 0, blk))
            if cur and blk != cur_blk:  # a bucket never spans two blocks
                self._add(cur, grp)
                cur, size = [], 0
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self._add(cur, grp)
                cur, size = [], 0
            open_[key] = (grp, cur, size, blk)
        for grp, cur, _, _ in open_.values():
            if cur:
                self._add(cur, grp)
        self.active = any(b.group is not None and dist.get_world_size(b.group) > 1
                          for b in self.buckets)
        hook = weak_hook(self._on_grad_ready)
        self._handles = ([p.register_post_accumulate_grad_hook(hook)
                          for p in params] if self.active or self._master else [])
        self.ownership = ZeroOwnership(model, [b.zero for b in self.buckets if b.zero is not None],
                                       block_of, tied_head, prefetch,
                                       [b.copy for b in self.buckets if b.copy is not None])

    def close(self) -> None:
        """Remove every hook the reducer and its ZeRO ownership put on the parameters and
        the model, so that a model thrown away is freed without a cycle collection."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.ownership.close()

    def _add(self, params, group) -> None:
        prescale = self._prescale_of(params[0])
        # the tied table's bucket (prescaled, summed over two stages) stays in its dtype
        b = _Bucket(params, group, params[0].device, params[0].dtype, prescale,
                    self._level_of(params[0]), None if prescale is not None else self._reduce_dtype,
                    self._gather_dtype, self._node if group is self.dp_group else None,
                    self._master)
        self.buckets.append(b)
        for p in params:
            self._bucket_of[id(p)] = b

    @staticmethod
    def _trivial(b: _Bucket) -> bool:
        return b.group is None or dist.get_world_size(b.group) == 1

    def zero_grad(self) -> None:
        """Zero the flat buffers; ``param.grad`` becomes (again) a view into them, also if
        something set it to None since (``optimizer.zero_grad()``)."""
        for b in self.buckets:
            b.attach()
            if b.level >= 2:
                b.zero.grad_shard.zero_()
            else:
                b.buffer.zero_()
            if b.zero is not None:
                b.zero.attach_grads()
            b.ready = 0
            b.work = None
        self._hits = {}

    def arm(self) -> None:
        """The next backward is the last of this step: reduce while it runs, in the comm
        scope of the caller (the hooks may run on another thread)."""
        if self.buckets:
            require_default_stream(self.buckets[0].buffer.device, "the DP gradient reducer")
        self.armed = True
        self._scope = current_scope()

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if getattr(p, "main_grad", None) is not None:
            accumulate_main_grad(p)
        if not self.armed:
            return
        k = id(p)
        self._hits[k] = self._hits.get(k, 0) + 1
        if self._expected is None or self._hits[k] != self._expected.get(k):
            return
        b = self._bucket_of[k]
        b.ready += 1
        if b.ready == b.need and b.work is None and not self._trivial(b):
            with comm_scope(self._scope):
                self._launch(b)

    @staticmethod
    def _launch(b: _Bucket) -> None:
        if b.level >= 2:
            b.zero.ensure_grads()  # a bucket that got no gradient this step
            b.work = b.zero.launch_reduce()
            return
        if b.prescale is not None:
            b.buffer.mul_(b.prescale)
        if b.wire is not None:
            b.sent = b.buffer.to(b.wire)
        b.work = all_reduce(b.buffer if b.sent is None else b.sent, b.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket's all-reduce and average over dp (then run ``then``)."""
        self.armed = False
        self._scope = None
        if self.active:
            self._reduce()
        self.ownership.release()
        if self._then is not None:
            self._then()

    def _reduce(self) -> None:
        for b in self.buckets:  # the same on every rank: every rank runs the same code
            p = b.detached()
            if p is not None:
                name = next((n for n, q in self._names if q is p), "?")
                raise RuntimeError(
                    f"the gradient of parameter {name} is no longer the DP reducer's bucket "
                    f"view (optimizer.zero_grad() or `param.grad = None` between "
                    f"reducer.zero_grad() and the backward?): it would not be averaged over "
                    f"data-parallel ranks. Zero gradients with GradReducer.zero_grad() only.")
        if self._expected is None:  # calibration: all ranks count the same hooks
            self._expected = dict(self._hits)
            for b in self.buckets:
                b.need = sum(1 for p in b.params if self._expected.get(id(p), 0) > 0)
        for b in self.buckets:  # same order on every rank
            if b.work is None and not self._trivial(b):
                self._launch(b)
        for b in self.buckets:
            if b.level >= 2:
                b.zero.finish_reduce(self.dp)
                b.work = None
                # the whole gradient buffer is freed: a .grad still viewing it would read
                # freed memory; the optimizer reads the owned range (its segments' .grad),
                # and zero_grad() gives every parameter its view back before the backward
                for p in b.params:
                    p.grad = None
                continue
            if b.work is not None:
                b.work.wait()  # the current (default) stream: the optimizer's
                b.work = None
            if b.sent is not None:
                b.buffer.copy_(b.sent)
                b.sent = None
            if b.prescale is None and self.dp > 1:
                b.buffer.div_(self.dp)

    def memory(self, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes held for parameters, gradients and optimizer state
        (:func:`~oases.dp.accounting.held_memory`)."""
        return held_memory(model, opt, [b.buffer for b in self.buckets], self.ownership)


class TiedTableSync:
    """Sums the gradients of a tied embedding's two copies (first and last pipeline
    stage) when the stages shard the vocabulary differently (different tp), after each
    stage's DP reduction.

    Every rank of both stages writes its (DP-averaged) shard rows into a zero table of
    the logical vocabulary, scaled by 1/dp of its stage (the dp replicas hold the same
    values), and one all-reduce over both stages adds them up: each row then holds
    first-stage + last-stage gradient, and each rank copies its rows back. (With equal
    tp the reducer sums the shards directly over a smaller group; this moves tp times
    the bytes, once per step.)
    """

    def __init__(self, param: nn.Parameter, group, dp: int, tp_rank: int, vocab: int) -> None:
        self.param, self.group, self.scale, self.vocab = param, group, 1.0 / dp, vocab
        rows = param.shape[0]
        self.start = tp_rank * rows
        self.n = max(0, min(rows, vocab - self.start))  # real (not padding) rows held here

    @torch.no_grad()
    def __call__(self) -> None:
        g = grad_of(self.param)
        table = torch.zeros(self.vocab, g.shape[1], device=g.device, dtype=g.dtype)
        table[self.start: self.start + self.n] = g[: self.n] * self.scale
        all_reduce(table, self.group)
        g[: self.n] = table[self.start: self.start + self.n]
