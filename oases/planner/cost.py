"""The overlap-aware cost model (after Oases section 4). Pure Python, no torch.

A plan gives every transformer block i (attn, mlp of each layer) a TP degree
t_i dividing tp. Per block and degree the model knows, per sub-batch:
forward compute ``cf``, backward compute ``cb`` (recompute included), and the
all-reduce ``m`` that ends the block (forward) and the one of its input
gradient (backward), both of rows x seq x d activations.

``oases`` runs sub-batches a, b in turn on one compute stream; a's next segment
waits for a's last collective, which ran while b computed. The compute stream
therefore sees, per block, one segment whose length is the pairwise max of the
block's compute and its own collective, and one paired with the previous
block's collective:

    forward   sum_i max(cf_i, m_i)  +  sum_i max(cf_i, m_{i-1})
    backward  sum_i max(cb_i, m_i)  +  sum_i max(cb_{i-1}, m_i)

The first sum are *node* costs (one block's choice), the second *edge* costs
(two adjacent choices). With n sub-batches (cf, cb then one sub-batch's share of
the micro-batch) every block runs n segments per pass, one in the node cost and the
n - 1 others in the edge cost, each paired with a collective of its neighbour; with
one sub-batch nothing pairs: cf + cb + 2 m, each collective waited for whole. Where adjacent degrees differ, the edge also pays the
resharding all-gather, in forward when the degree grows, in backward when it
drops, for both sub-batches and without much compute to hide behind (the
overlap it breaks). ``recompute=full`` adds, per block, the re-issued forward
all-reduce paired with the recompute. Gradients of a block of degree t < tp are
summed over its tp/t replicas (and DP); the reducer launches each block's sync
as soon as its gradients are ready, so the syncs queue on the link behind one
another and hide behind the backward of the blocks before them: only what
outlasts the backward counts (:meth:`CostModel.sync_exposed`, a max of sums,
one auxiliary variable in the ILP).

On a host whose cores also move the bytes (CPU ranks), an overlapped
collective still takes compute cycles: the profiler measures that loss per byte
(``cpu_per_byte``) and every overlapped collective's bytes add it;
:func:`oases.planner.fit.calibrate_host_cost` scales it to a real step.

Compute times are the profiled device's over the speed of the run's slowest node
(``node_speed``, :func:`at_speed`): a TP/DP group waits for it at every collective.

``overlap_fb`` (G >= 2 micro-batches): the step runs F0 | B0+F1 | ... | B(G-1), one
micro-batch at the cost above and G-1 pairs, in which a block's forward and backward
share the link and the cores (:meth:`CostModel.paired_cost`). ``selective``: the
profile measures attention with its core recomputed (saved bytes and backward time).

Beyond its bytes, every collective call costs a step ``call_s`` (measured as a step
meets it, :mod:`oases.planner.comm_profile`): a step of many small micro-batches
pays it many times. Measured collective fits price a group on its own links
(:meth:`oases.planner.cluster.CommModel.fitted`).

``megatron`` (no overlap) is modelled too: compute + blocking collectives.

Context parallelism (``RunShape.cp``): a rank holds seq / cp tokens of its rows, and an
attention block's compute carries the ring's exposed waits (:mod:`oases.planner.cp_cost`).

Memory per device: parameters, gradients and Adam state (16 B/param) of each
block at its degree, saved activations of the recompute mode, and a runtime
peak term (the largest graph rebuilt during backward, the logits). Activations
come in two dtypes: the compute dtype (``act_bytes``: what the matmuls produce,
so the partial sums and their all-reduce) and the residual stream's
(``residual_bytes``: block inputs and outputs; under bf16 autocast the stream
stays fp32, since its adds are not autocast ops and the weights are fp32).
Under bf16 the engine keeps one bf16 copy of each weight matrix for a run
(autocast's cast cache, shared by the sub-batches and by recompute).
Above
``n_kv_heads`` ranks a kv head is replicated, not split: each replica counts a whole
head (:meth:`ModelShape.rank_params`), and the per-step sum of its gradients over
the replicas adds to the block's node cost (:meth:`CostModel._kv_sync`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from oases.planner.cluster import CommModel, grad_groups, reshard_groups, tp_groups
from oases.planner import zero_cost as zc
from oases.planner.cp_cost import ring_exposed
from oases.planner.measured import Profile, at_speed
from oases.planner.shape import ModelShape

ADAM_BYTES_PER_PARAM = 16  # fp32 param + grad + 2 moments (also mixed precision's 16 B)
PARAM_BYTES = 4            # parameters are fp32 (bf16 runs keep fp32 master weights)

__all__ = ["ADAM_BYTES_PER_PARAM", "PARAM_BYTES", "CostModel", "ModelShape", "Profile",
           "RunShape"]


@dataclass
class RunShape:
    tp: int
    dp: int
    micro_batch_size: int        # per DP rank
    grad_accum: int
    sub_batches: int
    schedule: str                # "oases" | "megatron"
    recompute: str               # "none" | "selective" | "full" | "fine"
    act_bytes: int = 4           # bytes per element in the compute dtype (fp32 4, bf16 2)
    residual_bytes: int = 4      # bytes per element of the residual stream (2: bf16 weights)
    overlap_fb: bool = False     # oases: each backward paired with the next forward
    sequence_parallel: bool = False  # activations outside the matmuls split over TP
    grad_reduce_bytes: int = 4   # bytes per gradient element summed over dp (parallel.grad_reduce_dtype)
    # context parallelism: each rank holds seq_len / cp tokens of its rows (dp counts the
    # cp ranks: gradients sum over all of them); the ring's cost is oases.planner.cp_cost's
    cp: int = 1
    # ZeRO level, bytes per parameter element on the device (2: bf16 weights over fp32
    # masters) and L of a level-3 node-local secondary shard (0: none): zero_cost's rows
    zero: int = 0
    weight_bytes: int = 4
    secondary: int = 0


class CostModel:
    def __init__(self, shape: ModelShape, run: RunShape, cluster, profile: Profile,
                 degrees: Optional[list[int]] = None, ranks: Optional[list[int]] = None) -> None:
        """``ranks``: the run's global ranks (default the first tp x dp), whose slowest
        node sets the compute speed (``cluster.speed_of``)."""
        self.speed = cluster.speed_of(range(run.tp * run.dp) if ranks is None else ranks)
        self.shape, self.run, self.cluster = shape, run, cluster
        self.profile = at_speed(profile, self.speed)
        self.comm = CommModel(cluster, profile.comm)
        self.call_s = profile.comm.get("call_s", 0.0)  # a step's cost per collective call
        self.tp = run.tp
        self.tokens = shape.seq_len / run.cp  # of each row, on this rank
        self.degrees = degrees or shape.valid_degrees(self.tp)
        self.kinds = shape.kinds()
        self.n = len(self.kinds)
        self._precompute()

    # ------------------------------------------------------------ ingredients
    def rows(self, t: int) -> float:
        """Batch rows a rank processes per sub-batch at degree t."""
        return self.run.micro_batch_size / self.run.sub_batches * t / self.tp

    def _act_bytes(self, t: int) -> float:
        """One sub-batch's (rows, seq / cp, d) activation in the compute dtype."""
        return self.rows(t) * self.tokens * self.shape.d_model * self.run.act_bytes

    def _stream_bytes(self, t: int) -> float:
        """One sub-batch's (rows, seq / cp, d) slice of the residual stream."""
        return self.rows(t) * self.tokens * self.shape.d_model * self.run.residual_bytes

    def weight_bytes(self, kind: str, t: int) -> float:
        """A block's weights as its forward saves them for backward: the matrices in the
        compute dtype (under bf16-autocast the copy, one per run, see the module
        docstring; in fp32 and bf16 weights the parameters themselves) and the norm's
        parameters. The profiled ``saved`` figure includes them once."""
        return self.run.act_bytes * self.shape.matrix_params(kind) / t + \
            self.run.weight_bytes * self.shape.norm_params(kind)

    def cast_bytes(self, kind: str, t: int) -> float:
        """Memory a block's weights take beyond the parameters: the bf16 copy of the
        matrices, or 0."""
        if self.run.act_bytes >= self.run.weight_bytes:  # fp32, or bf16 weights: no copy
            return 0.0
        return self.run.act_bytes * self.shape.matrix_params(kind) / t

    def saved_bytes(self, kind: str, t: int) -> float:
        """Activation bytes one sub-batch keeps for a block from its forward to its
        backward, weights excluded (:class:`SavedTensorMeter` measures this plus, under
        ``none``, the weights once). ``none``: the profiled figure (one sub-batch's
        forward, which holds the weights once); ``fine``: the block input (residual
        stream) and the all-reduce output (compute dtype); ``full``: the layer input,
        kept by its first block.

        Sequence parallelism (the profile is measured without it): what lies outside the
        TP region holds 1/t of the sequence. ``none``: the norm's input (residual stream)
        and the dropout mask shrink; ``fine``: the input and the reduce-scattered output
        are chunks, the all-gathered region input is whole; ``full``: the input chunk
        (benchmarks/results/sp_memory.md measures these)."""
        r, sp = self.run.recompute, self.run.sequence_parallel
        if r in ("none", "selective"):  # selective: profiled with the core recomputed
            saved = self.profile.blocks[kind][str(t)]["saved"] - self.weight_bytes(kind, t)
            if sp:
                saved -= (1 - 1 / t) * (self._stream_bytes(t) + self._act_bytes(t))
            return max(0.0, saved)
        if r == "fine":
            if sp:
                return (self._stream_bytes(t) + self._act_bytes(t)) / t + self._act_bytes(t)
            return self._stream_bytes(t) + self._act_bytes(t)
        return self._stream_bytes(t) / (t if sp else 1) if kind == "attn" else 0.0

    def wgrad_share(self, kind: str) -> float:
        """The W part of a block's backward under a zero-bubble schedule: the linear
        layers' dW matmuls over all the backward's matmul FLOPs. Per token the linears
        take 2M FLOPs forward (M = :meth:`ModelShape.matrix_params`), 4M backward (dX,
        dW), half of it W; causal attention's score and value matmuls take about
        2 seq d forward and twice that backward, all of it B. So W = M / (2 (M + seq d))
        of an attention block's backward, 1/2 of an MLP's; the backward's other kernels
        (norms, softmax, activation) are charged in proportion (measured as one time)."""
        if kind != "attn":
            return 0.5
        m = self.shape.matrix_params(kind)
        return m / (2 * (m + self.shape.seq_len * self.shape.d_model))

    def wgrad_time(self, kind: str, t: int) -> float:
        """One micro-batch's W of a block at degree t: :meth:`wgrad_share` of its
        profiled backward (without the recompute forward, which B runs), and no more
        than its forward (the dW matmuls are as many FLOPs as the forward's linears;
        the pipeline's closed form needs W <= F)."""
        prof = self.profile.blocks[kind][str(t)]
        return self.run.sub_batches * min(self.wgrad_share(kind) * prof["bwd"], prof["fwd"])

    def wgrad_bytes(self, kind: str, t: int) -> float:
        """What one micro-batch's pending W keeps of a block at degree t: every linear's
        input X and output gradient dY (:mod:`oases.parallel.wgrad`), in the compute
        dtype. Column-parallel layers take the whole d-wide input and give 1/t of their
        width, row-parallel ones the reverse (their d-wide dY a sequence chunk under
        sequence parallelism)."""
        s = self.shape
        split = s.matrix_params(kind) / (s.d_model * t)  # the t-split widths, summed
        whole = s.d_model * (1 + (1 / t if self.run.sequence_parallel else 1))
        rows = self.run.sub_batches * self.rows(t)
        return rows * self.tokens * (whole + split) * self.run.act_bytes

    def ar_time(self, t: int, nbytes: float) -> float:
        """All-reduce over degree-t subgroups; the slowest subgroup sets the pace."""
        if t == 1:
            return 0.0
        groups = tp_groups(t, self.tp, self.run.dp)
        fit = self.comm.fitted("all_reduce", str(t), nbytes, groups)
        return fit if fit is not None else max(self.comm.all_reduce(nbytes, g) for g in groups)

    def ag_time(self, a: int, b: int, nbytes_total: float) -> float:
        """All-gather of the reshard groups between degrees a < b."""
        groups = reshard_groups(a, b, self.tp, self.run.dp)
        fit = self.comm.fitted("all_gather", f"{a}-{b}", nbytes_total, groups)
        return fit if fit is not None else \
            max(self.comm.all_gather(nbytes_total, g) for g in groups)

    def _grad_sync(self, kind: str, t: int) -> float:
        """Summing a degree-t block's gradients over its tp/t replicas x dp (one call)."""
        if self.run.dp * self.tp // t < 2:
            return 0.0
        nbytes = self.shape.rank_params(kind, t) * self.run.grad_reduce_bytes
        groups = grad_groups(t, self.tp, self.run.dp)
        fit = self.comm.fitted("grad_all_reduce", str(t), nbytes, groups)
        wire = fit if fit is not None else max(self.comm.all_reduce(nbytes, g) for g in groups)
        return wire + self.call_s

    def _kv_sync(self, kind: str, t: int) -> float:
        """Summing the kv gradients of an attention block whose kv heads are replicated
        (t > n_kv_heads) over each head's replicas: once per step, after the DP reduction
        (oases.dp.replicas), so not hidden behind the backward."""
        r = t // self.shape.n_kv_heads
        if kind != "attn" or r < 2:
            return 0.0
        nbytes = self.shape.kv_params() / self.shape.n_kv_heads * 4
        return self.comm.all_reduce(nbytes, list(range(r)))

    def cpu_per_byte(self, t: int) -> float:
        """Compute time the host loses per byte all-reduced at degree t while it computes
        (measured; 0 without a measurement)."""
        m = self.profile.comm.get("cpu_per_byte", {})
        if str(t) in m:
            return m[str(t)]
        return max(m.values(), default=0.0) if t > 1 else 0.0

    def sync_cpu_per_byte(self) -> float:
        """The same for gradient syncs: as profiled (a calibration step at degree tp has
        no replica syncs to say otherwise)."""
        m = self.profile.comm.get("cpu_per_byte_sync")
        if m is None:
            return self.cpu_per_byte(self.tp)
        return m.get(str(self.tp), max(m.values(), default=0.0))

    def _precompute(self) -> None:
        r, nsub = self.run, self.run.sub_batches
        self.cf, self.cb, self.m, self.mem, self.trans, self.sync = {}, {}, {}, {}, {}, {}
        self.free, self.kv_sync, self.ring, self.zstep, self.zmb = {}, {}, {}, {}, {}
        for kind in ("attn", "mlp"):
            for t in self.degrees:
                prof = self.profile.blocks[kind][str(t)]
                # under cp the ring's exposed waits lengthen the attention's compute
                rf, rb = self.ring[kind, t] = ring_exposed(self, kind, t)
                fwd, bwd = prof["fwd"] + rf, prof["bwd"] + rb
                if r.recompute in ("fine", "full"):
                    bwd = bwd + fwd  # recompute the block before its backward
                self.cf[kind, t], self.cb[kind, t] = fwd, bwd
                self.m[kind, t] = self.ar_time(t, self._act_bytes(t))
                n, groups = self.shape.rank_params(kind, t), grad_groups(t, self.tp, r.dp)
                self.sync[kind, t] = (zc.reduce_s(self, n, groups) if r.zero >= 2 and
                                      r.dp * self.tp // t > 1 else self._grad_sync(kind, t))
                self.zstep[kind, t] = zc.step_s(self, n, groups, fwd)  # per step
                self.zmb[kind, t] = zc.micro_batch_s(self, n, groups, fwd, bwd)
                static = zc.held_per_param(r, r.dp * self.tp // t) * n
                static += self.cast_bytes(kind, t)
                self.kv_sync[kind, t] = self._kv_sync(kind, t)
                self.mem[kind, t] = static + nsub * self.saved_bytes(kind, t)
                # rebuilt during backward: one block's graph per sub-batch (the weights'
                # copy is the one already counted)
                rebuilt = max(0.0, prof["saved"] - self.weight_bytes(kind, t))
                self.trans[kind, t] = nsub * rebuilt if r.recompute in ("fine", "full") else 0.0
                # What block i's backward leaves for the gradient syncs of the blocks
                # after it to hide behind (their syncs start once the last sub-batch has
                # done their backward). Under oases the sub-batches take turns at every
                # collective: below such a block both still have this block to do. A
                # degree-1 block has no collective, so one sub-batch runs through it
                # (and its degree-1 neighbours) before the other: only the second
                # sub-batch's share is left. The syncs' link is not always the TP
                # all-reduces' one (replicas sit in other subgroups), so those are not
                # subtracted.
                interleaved = t > 1 or r.schedule == "megatron"
                self.free[kind, t] = (nsub if interleaved else 1) * bwd
        mb = self._act_bytes(self.tp)
        self.m_edge = self.ar_time(self.tp, mb)     # embedding's forward / head's backward all-reduce

    # ------------------------------------------------------------- the model
    def node_cost(self, i: int, t: int) -> float:
        k, r = self.kinds[i], self.run
        cf, cb, m = self.cf[k, t], self.cb[k, t], self.m[k, t]
        host = 0.0
        if r.schedule == "megatron":
            n, (rf, rb) = r.sub_batches, self.ring[k, t]
            m_full = self.ar_time(t, self._act_bytes(t) * n)
            fwd = n * (self.profile.blocks[k][str(t)]["fwd"] + rf) + m_full
            bwd = n * (self.profile.blocks[k][str(t)]["bwd"] + rb) + \
                max(0.0, m_full - 0.5 * n * cb)
            if r.recompute == "full":
                bwd += n * (self.profile.blocks[k][str(t)]["fwd"] + rf) + m_full
            cost = fwd + bwd + (3 if r.recompute == "full" else 2) * self.calls(t)
        else:
            # one sub-batch alone waits for each of its collectives
            cost = cf + cb + 2 * m if r.sub_batches == 1 else max(cf, m) + max(cb, m)
            if r.sequence_parallel and r.sub_batches == 2 and t > 1:
                # two sub-batches in step: one of the all-gather and reduce-scatter (half
                # of m each) meets only a short segment, each way (oases.overlap.sequence)
                cost += m
            n_ar = 2
            if r.recompute == "full":
                cost += max(self.profile.blocks[k][str(t)]["fwd"], m)  # re-issued all-reduce
                n_ar = 3
            # the host cycles the overlapped all-reduces take from compute
            host = n_ar * r.sub_batches * (self._act_bytes(t) * self.cpu_per_byte(t) +
                                           self.calls(t))
            cost += host
        cost += self.zmb[k, t]  # ZeRO-3's gathers, per micro-batch
        if i == 0:
            cost += self.edge_in(t)
        if i == self.n - 1:
            cost += self.edge_out(t)
        once = self.step_once(k, t)  # per step, not per micro-batch
        if self._paired_run():  # one micro-batch unpaired, G-1 in pairs (module docstring)
            pair = host + self.paired_cost(k, t)
            c = self.profile.constant
            if i == 0:  # the embedding's backward takes its turn in the pair as well
                pair += max(c.get("embed_bwd", 0.0), self.m[k, t])
            if i == self.n - 1:  # and the head's forward
                pair += max(c.get("head_fwd", 0.0), self.m[k, t])
            return cost + (r.grad_accum - 1) * pair + once
        return cost * r.grad_accum + once

    def step_once(self, k: str, t: int) -> float:
        """What a block costs once per step outside its micro-batches: the replicated kv
        heads' sum, the host cycles of its gradient sync and ZeRO's post-step gathers."""
        return self.kv_sync[k, t] + self.sync_host(k, t) + self.zstep[k, t]

    def sync_host(self, k: str, t: int) -> float:
        """The cycles a block's replica gradient sync (once per step) steals from
        compute under oases, where it overlaps the backward."""
        if not self.sync[k, t] or self.run.schedule != "oases":
            return 0.0
        return self.shape.rank_params(k, t) * self.run.grad_reduce_bytes * \
            self.sync_cpu_per_byte()

    def calls(self, t: int) -> float:
        """The per-call cost of one activation collective at degree t (none at 1). Under
        sequence parallelism each is an all-gather and a reduce-scatter: two calls, whose
        bytes add up to the all-reduce's (measured alike: benchmarks/results/
        collectives.md), so ``ar_time`` prices the pair."""
        if t == 1:
            return 0.0
        return self.call_s * (2 if self.run.sequence_parallel else 1)

    def _paired_run(self) -> bool:
        return self.run.overlap_fb and self.run.schedule == "oases" and self.run.grad_accum > 1

    def paired_cost(self, k: str, t: int) -> float:
        """Block kind k at degree t in one B(m)+F(m+1) pair (``overlap_fb``). The pair's
        programs take turns on one compute stream and one link, the backward going down
        the blocks while the forward goes up, so each block contributes n (cf + cb) of
        compute and 2 n m of link time (n sub-batches, m one sub-batch's all-reduce)
        and hides the smaller behind the larger:

            pair_k = n * max(cf + cb, 2 m)

        A per-block max (linear in the one-hot degrees, as the node costs): it assumes
        a link-bound forward block meets a compute-bound backward block of its kind,
        as when the layers are alike."""
        n = self.run.sub_batches
        return n * max(self.cf[k, t] + self.cb[k, t], 2 * self.m[k, t])

    def sync_exposed(self, degrees: list[int]) -> float:
        """The replica gradient syncs that outlast the backward. Backward runs blocks
        n-1 .. 0 and the reducer launches block i's sync as soon as its gradients are
        ready; the syncs queue on the link in launch order. Those launched from block i
        on (blocks i, i-1, .., 0) hide behind what is left of the backward, blocks
        i-1 .. 0 (:meth:`hide`), so the last ends max_i(sum_{j<=i} sync_j - hide_i)
        after the backward, if that is positive. (A max of sums, each linear in the
        one-hot degrees: linear in the ILP.)"""
        tail = [self.sync_prefix(degrees, i) - self.hide(degrees, i) for i in range(self.n)]
        return max(0.0, *tail)

    def sync_prefix(self, degrees: list[int], i: int) -> float:
        return sum(self.sync[self.kinds[j], degrees[j]] for j in range(i + 1))

    def hide(self, degrees: list[int], i: int) -> float:
        """Backward compute left after block i's gradients are complete."""
        return sum(self.free[self.kinds[j], degrees[j]] for j in range(i))

    def reshard_cost(self, i: int, ta: int, tb: int) -> float:
        """All-gathers between block i-1 (degree ta) and block i (degree tb), per micro-batch."""
        if ta == tb:
            return 0.0
        small, big = min(ta, tb), max(ta, tb)
        nbytes = self._act_bytes(big)  # the gathered activation, at the larger degree
        n = self.run.sub_batches if self.run.schedule == "oases" else 1
        size = nbytes * (1 if self.run.schedule == "oases" else self.run.sub_batches)
        cpu = n * size * self.cpu_per_byte(big) if self.run.schedule == "oases" else 0.0
        cost = n * (self.ag_time(small, big, size) + self.call_s) + cpu
        if self.run.sequence_parallel and ta > 1:  # the chunks gathered over ta first:
            # half an all-reduce's bytes, each way (forward, and the gradient's backward)
            part = size * self.rows(ta) / self.rows(big)
            cost += n * 2 * (0.5 * self.ar_time(ta, part) + self.call_s)
        return cost

    def edge_cost(self, i: int, ta: int, tb: int) -> float:
        """Edge between block i-1 at degree ta and block i at degree tb."""
        k0, k1, r = self.kinds[i - 1], self.kinds[i], self.run
        reshard = self.reshard_cost(i, ta, tb) * r.grad_accum  # every micro-batch, paired or not
        if r.schedule != "oases" or r.sub_batches == 1:
            return reshard
        # every sub-batch after the first takes its turn on the compute stream here, each
        # segment paired with a collective of the neighbouring block (module docstring)
        turns = max(self.cf[k1, tb], self.m[k0, ta]) + max(self.cb[k0, ta], self.m[k1, tb])
        turns *= r.sub_batches - 1
        return reshard + turns * (1 if self._paired_run() else r.grad_accum)

    def edge_in(self, t: int) -> float:
        """Embedding (degree tp) -> first block: each sub-batch after the first pairs the
        block's forward with the embedding's all-reduce, and the embedding's backward
        with the block's input-gradient all-reduce; one sub-batch waits for the
        embedding's all-reduce whole."""
        k = self.kinds[0]
        c = self.reshard_cost(0, self.tp, t)
        if self.run.schedule == "oases":
            if self.run.sub_batches == 1:
                return c + self.m_edge
            c += (self.run.sub_batches - 1) * (
                max(self.cf[k, t], self.m_edge) +
                max(self.profile.constant.get("embed_bwd", 0.0), self.m[k, t]))
        return c

    def edge_out(self, t: int) -> float:
        """Last block -> head (degree tp), as :meth:`edge_in`: the head's forward with the
        block's all-reduce, the block's backward with the head's input-gradient one."""
        k = self.kinds[-1]
        c = self.reshard_cost(self.n, t, self.tp)
        if self.run.schedule == "oases":
            if self.run.sub_batches == 1:
                return c + self.m_edge
            c += (self.run.sub_batches - 1) * (
                max(self.profile.constant.get("head_fwd", 0.0), self.m[k, t]) +
                max(self.cb[k, t], self.m_edge))
        return c

    def constant_time(self) -> float:
        c = self.profile.constant
        per_mb = c.get("fwd", 0.0) + c.get("bwd", 0.0)
        n = self.run.sub_batches if self.run.schedule == "oases" else 1
        per_mb += 2 * n * self.calls(self.tp)  # the embedding's and the head's all-reduces
        if self.run.schedule == "oases":  # overlapped: their bytes take host cycles
            per_mb += 2 * n * self._act_bytes(self.tp) * self.cpu_per_byte(self.tp)
        return per_mb * self.run.grad_accum + c.get("step", 0.0)

    def plan_time(self, degrees: list[int]) -> float:
        """Predicted step time (s) of a plan."""
        t = self.constant_time() + self.sync_exposed(degrees)
        t += sum(self.node_cost(i, d) for i, d in enumerate(degrees))
        t += sum(self.edge_cost(i, degrees[i - 1], degrees[i]) for i in range(1, self.n))
        return t

    def static_memory(self) -> float:
        head_cast = self.run.act_bytes * self.shape.vocab_size * self.shape.d_model / self.tp \
            if self.run.act_bytes < self.run.weight_bytes else 0.0  # the head's bf16 copy
        held = zc.held_per_param(self.run, self.run.dp)
        return held * self.shape.other_params() / self.tp + head_cast + \
            self.profile.constant.get("peak", 0.0)

    def plan_memory(self, degrees: list[int]) -> float:
        """Predicted peak memory (bytes) per device of a plan."""
        mem = self.static_memory() + sum(self.mem[self.kinds[i], d] for i, d in enumerate(degrees))
        return mem + max((self.trans[self.kinds[i], d] for i, d in enumerate(degrees)), default=0.0)

    def block_table(self, degrees: list[int]) -> list[dict]:
        return [{"block": i, "kind": self.kinds[i], "degree": d,
                 "time_s": self.node_cost(i, d) + (self.edge_cost(i, degrees[i - 1], d) if i else 0.0),
                 "memory_bytes": self.mem[self.kinds[i], d]} for i, d in enumerate(degrees)]
