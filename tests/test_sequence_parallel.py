"""Sequence parallelism (``parallel.sequence_parallel``): parity and collectives.

* Against one unsharded process (tests.test_pipeline_parity's harness: two real
  optimizer steps through the runtime, the losses, the first step's gradient norm and
  every gradient shard): tp 4 under both engines and every recompute mode, a plan of
  per-block degrees 4, 2 and 1 inside tp 4, tp 2 x pp 2,
  tp 2 x dp 2 with ``overlap_fb``; ZeRO-3 with SP against ZeRO-0 without
  (tests/test_zero.py's run and tolerances). Dropout 0 there: at tp > 1 the
  attention dropout of each rank's heads comes from its own stream, which no unsharded
  run draws. Tolerances: that harness's (fp32 rounding of sharded sums).
* With dropout on, against the same model without SP at the same tp (whose equality to
  plain autograd tests/test_tp_engine_parity.py checks): the residual and embedding masks of a
  sequence chunk must be that chunk of the whole sequence's, or the gradients differ
  by far more than the tolerance (tests/test_tp_engine_parity.py's, atol 1e-6 / rtol 1e-5).
* A block of a user's own, built from the parallel layers with its norm inside its
  ``partial``, gets SP with no code of its own.
* Collectives: under SP no block all-reduces; ``fine`` re-issues no forward collective.
* bf16 autocast: the gathered region inputs cross in bf16 (oases.parallel.wire), and
  the forward is the same bit for bit as with them gathered in fp32; every all-gather
  and reduce-scatter but the embedding's moves half of fp32's bytes.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from oases.models import build_model
from oases.config import load_config
from oases.dp.replicas import SequenceGradSum
from oases.errors import ConfigError
from oases.overlap.engines import build_engine
from oases.parallel import ColumnParallelLinear, RowParallelLinear, init_parameters
from oases.parallel.block import TPBlock
from oases.parallel.comm import CommCounter
from oases.parallel.random import TPRNGTracker
from oases.parallel.sharding import set_spec
from tests.support.distributed import run_distributed
from tests.support.parity import (MBS, PAIRS, SEQ, WORLD, full_grads, run_case,
                                  sub_batch_reference)
from tests.support.zero_levels import PARAM_ATOL, run_levels


def _cfg(arch: str, schedule: str, recompute: str, pp: int, tp: int, *extra: str):
    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    return load_config(None, [
        f"model.name={name}", "model.n_layer=2", f"model.seq_len={SEQ}", "model.dropout=0.0",
        f"parallel.pp={pp}",
        f"parallel.tp={tp}", f"parallel.schedule={schedule}", f"parallel.recompute={recompute}",
        "parallel.sequence_parallel=true", "train.grad_accum=3",
        f"train.micro_batch_size={MBS}", "train.warmup_steps=0", "train.lr=1e-3",
        "data.kind=synthetic", "wandb.mode=disabled", *extra]).validate(WORLD)


def _unsharded_body(rank: int, cases: list, steps: int = 2) -> None:
    from oases.parallel.layout import stages_layout, uniform_layout

    for arch, schedule, recompute, pp, tp, extra, *stages in cases:
        cfg = _cfg(arch, schedule, recompute, pp, tp, *extra)
        layout = (stages_layout(stages[0], WORLD, cfg.model.n_layer, "test", cfg.pipeline_batch)
                  if stages else uniform_layout(WORLD, pp, tp, cfg.model.n_layer))
        run_case(rank, cfg, layout, steps,
                  f"SP {arch} {schedule}/{recompute} pp{pp} tp{tp} {extra}")


MODES = [("megatron", "none"), ("megatron", "selective"), ("megatron", "full"),
         ("oases", "none"), ("oases", "selective"), ("oases", "full"), ("oases", "fine")]


def test_tp4_every_mode_matches_unsharded():
    # one step each (loss, norm, every gradient): the second step is the pipeline cases'
    run_distributed(_unsharded_body, world=WORLD, tp=None,
                    args=([("gpt", s, r, 1, 4, ()) for s, r in MODES], 1))


# stages of different TP: the chunks of tp 2 cross to two replicas of tp 1
UNEVEN = [[{"layers": [0, 1], "dp": 1, "tp": 2}, {"layers": [1, 2], "dp": 2, "tp": 1}]]


@pytest.mark.slow  # a larger layout: make test runs it, make test-fast does not
def test_pipeline_and_overlap_fb_match_unsharded():
    run_distributed(_unsharded_body, world=WORLD, tp=None, args=([
        ("llama", "oases", "fine", 2, 2, ()), ("gpt", "megatron", "full", 2, 2, ()),
        ("gpt", "oases", "fine", 2, 2, ("train.micro_batch_size=8",), *UNEVEN),
        ("gpt", "megatron", "none", 2, 2, (), *UNEVEN),
        ("llama", "oases", "none", 1, 2, ("parallel.overlap_fb=true", "parallel.sub_batches=1")),
        ("llama", "megatron", "selective", 1, 2, ()),
    ],))


def _zero_body(ctx, schedule: str, recompute: str) -> None:
    """ZeRO-3 with SP against ZeRO-0 without, 3 steps (tests/test_zero.py's run and
    tolerances: the per-step loss and gradient norm, and the final full parameters)."""
    (ref_l, ref_n, ref_p, _), = run_levels(ctx, (0,), schedule, recompute).values()
    (losses, norms, params, _), = run_levels(ctx, (3,), schedule, recompute,
                                             ("parallel.sequence_parallel=true",)).values()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_l), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_n), rtol=1e-5, atol=0)
    for name, p in params.items():
        torch.testing.assert_close(p, ref_p[name], rtol=0, atol=PARAM_ATOL, msg=name)


# per-block degrees 4, 2 and 1 inside tp 4 (resharding between degrees on chunks); the
# oases cases at 4 sub-batches (staggered), whose rows the degree-1 blocks split in 4
MIXED = [{"layers": [0, 2], "dp": 1, "tp": 4, "degrees": [2, 1, 4, 2]}]


@pytest.mark.slow  # ~6 s; the tp4 case above is sequence parallelism's fast-tier check
def test_mixed_degree_plan_matches_unsharded():
    run_distributed(_unsharded_body, world=WORLD, tp=None, args=([
        (arch, s, r, 1, 4, (f"train.micro_batch_size={mbs}",), MIXED)
        for arch, s, r, mbs in [("gpt", "megatron", "full", 8), ("gpt", "oases", "fine", 16),
                                ("gpt", "oases", "full", 16)]], 1))


def test_zero3_matches_replicated():
    # the oases engine's ZeRO-3 hook across the SP segments (megatron's: pipeline cases)
    run_distributed(_zero_body, world=4, tp=2, args=("oases", "fine"))


def _run(ctx, cfg, mode, ids, y, sp: bool, swap=None):
    sched, rc = mode[:2]
    tr = TPRNGTracker(ctx.device)
    tr.seed(11, ctx.tp_rank)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tr,
                        rc if sched == "megatron" or rc == "selective" else "none", seed=3)
    if swap is not None:
        swap(model, ctx)
    model.set_sequence_parallel(sp)
    n = mode[2] if len(mode) > 2 else 2  # sub-batches (their RNG streams); 4: staggered
    with CommCounter() as counter:
        if sched == "megatron":
            loss = sub_batch_reference(model, tr, ids, y, n)
        else:
            loss = build_engine("oases", ctx.tp_group, n, rc, tr).forward_backward(model, ids, y)
    summed = SequenceGradSum.for_model(model, ctx.tp_group)
    if summed is not None:
        summed()
    return loss, full_grads(model, ctx), counter.counts


def _dropout_body(ctx, name: str, modes: list, swap=None) -> None:
    cfg = load_config(None, [f"model.name={name}", f"parallel.tp={ctx.tp}", "model.dropout=0.1",
                             "model.n_layer=2"]).validate(ctx.world_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g)
    refs = {n: _run(ctx, cfg, ("megatron", "none", n), ids, y, False, swap)[:2]
            for n in {2} | {m[2] for m in modes if len(m) > 2}}
    for mode in modes:
        ref_loss, ref = refs[mode[2] if len(mode) > 2 else 2]
        loss, grads, counts = _run(ctx, cfg, mode, ids, y, True, swap)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6, msg=str(mode))
        for k in ref:
            torch.testing.assert_close(grads[k], ref[k], rtol=1e-5, atol=1e-6,
                                       msg=f"SP {mode} {k}")
        L, n = cfg.model.n_layer, mode[2] if len(mode) > 2 else 2
        # per sub-batch: the loss's all-reduce only; forward: an all-gather per layer
        # block and the head, a reduce-scatter per block; backward: their conjugates
        assert counts["all_reduce"] == n, (mode, counts)
        fwd_ag, fwd_rs = n * (2 * L + 1), n * (2 * L + 1)
        again = n * 2 * L if mode[1] == "full" else 0  # re-issued by full recompute only
        assert counts["all_gather"] == fwd_ag + fwd_rs + again, (mode, counts)
        assert counts["reduce_scatter"] == fwd_rs + fwd_ag + again, (mode, counts)
    if swap is not None:
        return
    ref = refs[2][1]
    # the check can fail: a chunk drawing its own mask (not the whole's) trains otherwise
    tr = TPRNGTracker(ctx.device)
    tr.seed(11, ctx.tp_rank)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tr, seed=3)
    model.set_sequence_parallel(True)
    for layer in model.layers:
        layer.mlp.batch_part = (ctx.tp_rank, 1)  # a wrong part: other rows' masks
        layer.mlp.combine = _own_mask(layer.mlp)
    sub_batch_reference(model, tr, ids, y, 2)
    SequenceGradSum.for_model(model, ctx.tp_group)()
    other = full_grads(model, ctx)
    assert max((other[k] - ref[k]).abs().max() for k in ref) > 1e-4


def _own_mask(blk):
    def combine(x, reduced):  # the chunk's own draw: not the unsharded run's mask
        return x + blk.dropout(blk.proj.add_bias(reduced))
    return combine


@pytest.mark.parametrize("name,world", [  # the fast tier keeps gpt-tiny at 2 ranks
    ("gpt-tiny", 2), pytest.param("llama-tiny", 2, marks=pytest.mark.slow),
    pytest.param("gpt-tiny", 4, marks=pytest.mark.slow)])
def test_dropout_masks_of_a_chunk_are_the_whole_sequence_s(name, world):
    modes = ([("megatron", "none")] + PAIRS + [("oases", "fine", 4), ("oases", "full", 4)]
             if world == 2 else [("oases", "fine", 4)])
    run_distributed(_dropout_body, world=world, tp=world, args=(name, modes))


class _UserMLP(TPBlock):
    """A user's block: its norm inside ``partial`` (no prologue), its bias in ``combine``."""

    def __init__(self, d: int, tp_group) -> None:
        super().__init__(tp_group)
        self.ln = nn.LayerNorm(d)
        set_spec(self.ln.weight, None, ("ones",))
        set_spec(self.ln.bias, None, ("zeros",))
        self.up = ColumnParallelLinear(d, 4 * d, tp_group)
        self.down = RowParallelLinear(4 * d, d, tp_group, reduce_output=False)

    def partial(self, x):
        return self.down.partial(F.relu(self.up(self.ln(x))))

    def combine(self, x, reduced):
        return x + self.down.add_bias(reduced)


def _swap_user_block(model, ctx) -> None:
    for layer in model.layers:
        layer.mlp = _UserMLP(model.cfg.d_model, ctx.tp_group)
        for p in layer.mlp.parameters():
            p.tp_degree = ctx.tp
    init_parameters(model, 7, ctx.tp_rank, ctx.tp)


def test_a_user_block_gets_sequence_parallelism():
    run_distributed(_dropout_body, world=2, tp=2,
                    args=("gpt-tiny", [("megatron", "none"), ("oases", "fine"),
                                       ("oases", "full")], _swap_user_block))


def test_bad_layouts_are_refused():
    with pytest.raises(ConfigError, match="seq_len=30 does not divide by parallel.tp=4"):
        load_config(None, ["model.seq_len=30", "parallel.tp=4", "model.name=gpt-tiny",
                           "parallel.sequence_parallel=true"]).validate(4)
    model = build_model(load_config(None, ["model.name=gpt-tiny"]).validate(1).model, 256)
    model.set_sequence_parallel(True)
    with pytest.raises(ValueError, match="set_sequence_parallel"):
        model.new_kv_cache(1, 8)


def test_a_plan_file_turns_sequence_parallelism_on(tmp_path):
    from oases.errors import UserError
    from oases.planner.online import resolve_plan
    from oases.planner.plan_file import Plan

    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.tp=2", "parallel.schedule=oases",
                             "parallel.recompute=fine", f"parallel.plan={tmp_path}/p.yaml"]
                      ).validate(2)
    Plan(degrees=[2, 1] * cfg.model.n_layer, tp=2, model={},
         sequence_parallel=True).save(tmp_path / "p.yaml")
    run, degrees = resolve_plan(cfg, None)
    assert run.parallel.sequence_parallel and degrees == [2, 1] * cfg.model.n_layer
    assert not cfg.parallel.sequence_parallel  # the config itself is left as it is
    (tmp_path / "p.yaml").write_text("degrees: [2, 2]\nsequence_parallel: 1\n")
    with pytest.raises(UserError, match="sequence_parallel must be true or false"):
        resolve_plan(cfg, None)


BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
# Against the unsharded bf16 run, as a share of each gradient's largest entry: bf16 is
# itself ~0.8% from fp32 on these runs (the unsharded bf16 run against the fp32 one),
# and the sharded run's bf16 partial sums and reduce-scatters round as much again
# (~1% measured, old and new wire alike); a wrong gradient is off by far more (a norm
# weight's partial gradient, not summed over TP, by ~100%).
BF16_GRAD_TOL = 2e-2


def _same(x):
    return x


def _bf16_run(ctx, cfg, mode, ids, y, amp, tp_group, fp32_wire=False, swap=None):
    """(loss, full gradients, bytes per collective kind) of one SP forward_backward;
    ``tp_group`` None: the unsharded reference (megatron, no SP). ``fp32_wire``: the
    region inputs gathered in their own dtype, as before the wire dtype."""
    sched, rc = mode
    tr = TPRNGTracker(ctx.device)
    tr.seed(11, ctx.tp_rank if tp_group is not None else 0)
    model = build_model(cfg.model, cfg.padded_vocab_size, tp_group, tr,
                        rc if sched == "megatron" else "none", seed=3)
    if swap is not None:
        swap(model, ctx)
    model.set_sequence_parallel(tp_group is not None)
    with contextlib.ExitStack() as stack, CommCounter() as counter:
        if fp32_wire:
            for where in ("oases.parallel.sequence", "oases.overlap.sequence"):
                stack.enter_context(mock.patch(f"{where}.to_wire", _same))
        loss = build_engine(sched, tp_group, 2, rc, tr).forward_backward(model, ids, y, amp=amp)
    if tp_group is None:
        return loss, {n: p.grad for n, p in model.named_parameters()}, {}
    SequenceGradSum.for_model(model, tp_group)()
    return loss, full_grads(model, ctx), dict(counter.bytes)


def _bf16_body(ctx, name: str) -> None:
    cfg = load_config(None, [f"model.name={name}", f"parallel.tp={ctx.tp}", "model.dropout=0.0",
                             "model.n_layer=2"]).validate(ctx.world_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (4, 32), generator=g)
    ref_loss, ref, _ = _bf16_run(ctx, cfg, ("megatron", "none"), ids, y, BF16, None)
    B, T, d = ids.shape[0], ids.shape[1], cfg.model.d_model
    # the embedding's partial sums enter the residual stream, fp32 either way: its forward
    # reduce-scatter (the whole sequence) and its backward all-gather (a chunk)
    fp32_left = {"reduce_scatter": B * T * d * 4, "all_gather": B * T // ctx.tp * d * 4}
    for mode in [("megatron", "none"), ("megatron", "full"), ("oases", "fine"),
                 ("oases", "full")]:
        _, _, b32 = _bf16_run(ctx, cfg, mode, ids, y, contextlib.nullcontext, ctx.tp_group)
        old_loss, _, old = _bf16_run(ctx, cfg, mode, ids, y, BF16, ctx.tp_group, True)
        loss, grads, b16 = _bf16_run(ctx, cfg, mode, ids, y, BF16, ctx.tp_group)
        # the region's linears cast their input to bf16 anyway: the same forward values
        assert torch.equal(loss, old_loss), (mode, loss, old_loss)
        for kind, left in fp32_left.items():
            assert 2 * b16[kind] - b32[kind] == left, (mode, kind, b16, b32)
            assert old[kind] > b16[kind], (mode, kind, old, b16)  # the old wire was fp32
        assert b16["all_reduce"] == b32["all_reduce"], (mode, b16, b32)  # the loss's stats
        torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=0, msg=str(mode))
        for k, r in ref.items():
            err = (grads[k] - r).abs().max() / r.abs().max()
            assert err <= BF16_GRAD_TOL, (mode, k, float(err))
    # a block whose norm is inside its partial reads the gathered chunk itself: it
    # crosses in fp32, so the values are those of the fp32 wire bit for bit
    for mode in [("megatron", "none"), ("oases", "fine")]:
        runs = [_bf16_run(ctx, cfg, mode, ids, y, BF16, ctx.tp_group, old, _swap_user_block)
                for old in (False, True)]
        assert torch.equal(runs[0][0], runs[1][0]), (mode, runs[0][0], runs[1][0])
        new, old = runs[0][2], runs[1][2]
        assert new["all_gather"] < old["all_gather"], (mode, new, old)  # the attention's


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_bf16_gathers_cross_in_bf16(name):
    run_distributed(_bf16_body, world=2, tp=2, args=(name,))
