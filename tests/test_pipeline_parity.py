"""Pipeline parity: every layout trains like pp=1 x tp=1 on the same global batch.

Each case runs two real optimizer steps of ``train_step`` through the pipeline
runtime (``PipelineRunner``: action lists, cross-mesh transfers, per-stage
engine, DP and tied-embedding reduction, global clipping) and compares, against
one unsharded process trained on the same samples:

* the loss of both steps and the gradient norm of the first;
* every gradient of the first step, each rank's shard against the same slice of
  the reference gradient (the tied embedding on both the first and last stage).

Tolerances: fp32, dropout 0. A sharded matmul sums over d in tp parts and the DP
reduction averages in another order, so results differ from the reference by
float32 rounding (~1e-7 relative per op, a few ops deep): losses rtol 1e-5,
gradients rtol 1e-4 / atol 1e-6, as the TP parity tests. A wrong stage, a
dropped micro-batch, a mis-scaled gradient or an unsynced tied copy are off by
far more (tens of percent).

Under ``train.precision=bf16`` activations and gradients cross the boundaries in bf16
(oases.parallel.wire): every message and fan-out moves exactly half of fp32's bytes,
and the run stays within bf16's tolerance of the unsharded bf16 run.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_distributed
from tests.support.parity import MBS, SEQ, WORLD, run_case, shared_reference, stage


def _cfg(arch: str, engine: tuple, kind: str, pp: int, tp: int, grad_accum: int, *extra: str):
    from oases.config import load_config

    name = "gpt-tiny" if arch == "gpt" else "llama-tiny"
    cfg = load_config(None, [f"model.name={name}", f"model.seq_len={SEQ}", "model.dropout=0.0",
                             f"parallel.pp={pp}", f"parallel.tp={tp}",
                             f"parallel.schedule={engine[0]}", f"parallel.recompute={engine[1]}",
                             f"parallel.pp_schedule={kind}", f"train.grad_accum={grad_accum}",
                             f"train.micro_batch_size={MBS}", "train.warmup_steps=0",
                             "train.lr=1e-3", "data.kind=synthetic", "wandb.mode=disabled",
                             *extra])
    return cfg.validate(WORLD)


# (name, pp, tp of the config, plan stages or None). world 4.
LAYOUTS = {
    "pp2xtp2": (2, 2, None),
    "pp2xdp2": (2, 1, None),
    "pp4": (4, 1, None),
    "tp2|dp2": (2, 1, [{"layers": [0, 2], "dp": 1, "tp": 2}, {"layers": [2, 4], "dp": 2, "tp": 1}]),
    "dp2|tp2": (2, 1, [{"layers": [0, 1], "dp": 2, "tp": 1}, {"layers": [1, 4], "dp": 1, "tp": 2}]),
    # per-block TP degrees inside each stage (blocks at degree 1 split the batch in two)
    "pp2xtp2-degrees": (2, 2, [{"layers": [0, 2], "dp": 1, "tp": 2, "degrees": [2, 1, 1, 2]},
                               {"layers": [2, 4], "dp": 1, "tp": 2, "degrees": [1, 2, 2, 2]}]),
}


def _body(rank: int, layout_name: str, cases: list) -> None:
    from oases.parallel.layout import stages_layout, uniform_layout

    pp, tp, stages = LAYOUTS[layout_name]
    for arch, engine, kind in cases:
        cfg = _cfg(arch, engine, kind, pp, tp, grad_accum=max(pp, 2) + 1)
        if stages is None:
            layout = uniform_layout(WORLD, pp, tp, cfg.model.n_layer)
        else:
            layout = stages_layout(stages, WORLD, cfg.model.n_layer, "test", cfg.pipeline_batch)
        run_case(rank, cfg, layout, 2, f"{layout_name} {arch} {engine} {kind}")


ENGINES = [("megatron", "none"), ("oases", "fine")]


# make test-fast keeps one layout (pipeline x TP); make test runs them all
@pytest.mark.parametrize("layout_name", [
    pytest.param(name, marks=() if name == "pp2xtp2" else pytest.mark.slow) for name in LAYOUTS])
def test_pipeline_matches_unsharded(layout_name):
    """Every layout x {megatron/none, oases/fine} x {1f1b, eager-1f1b} x {GPT (tied
    embeddings), LLaMA (GQA, untied)}: 8 cases in one 4-process world."""
    cases = [(arch, eng, kind) for arch in ("gpt", "llama") for eng in ENGINES
             for kind in ("1f1b", "eager-1f1b")]
    run_distributed(_body, WORLD, tp=None, args=(layout_name, cases))


def test_gpipe_and_full_recompute():
    """The reference schedule (gpipe) and the recompute modes not above."""
    run_distributed(_body, WORLD, tp=None, args=("pp2xtp2", [
        ("gpt", ("megatron", "full"), "gpipe"), ("llama", ("oases", "full"), "1f1b"),
        ("gpt", ("oases", "none"), "eager-1f1b")]))


def _nonfinite_body(rank: int) -> None:
    """A NaN in one rank's gradient on the first stage: every rank of every stage sees a
    non-finite norm and leaves the step out (no weight moves anywhere)."""
    import math

    from oases.parallel.groups import build_pipeline_context
    from oases.parallel.layout import uniform_layout
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches
    from oases.runtime.step import train_step

    cfg = _cfg("gpt", ("oases", "fine"), "1f1b", 2, 2, grad_accum=2)
    ctx = build_pipeline_context(uniform_layout(WORLD, 2, 2, cfg.model.n_layer),
                                 torch.device("cpu"), True)
    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
    ts = build_train_state(cfg, ctx, model, tracker)
    batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size,
                           cfg.pipeline_batch // ctx.dp, ctx.dp_rank, ctx.dp, cfg.seed)
    if rank == 0:
        model.layers[0].mlp.fc.weight.register_hook(lambda g: g * float("nan"))
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss, norm = train_step(ts, batches, 1e-2)
    assert math.isfinite(loss) and math.isnan(norm), (rank, loss, norm)
    for k, p in model.named_parameters():
        assert torch.equal(p, before[k]), f"rank {rank}: {k} moved in a skipped step"


def test_nonfinite_gradient_skips_the_step_on_every_stage():
    run_distributed(_nonfinite_body, WORLD, tp=None)


# bf16 against the unsharded bf16 run. bf16 is ~1% of a gradient's largest entry from
# fp32 on these models (tests/test_sequence_parallel.py measures it); the stage
# boundaries round the residual stream and its gradient to bf16 once each, well inside
# that; losses and norms (sums over many elements) move by ~1e-5 and ~2e-4. A dropped
# micro-batch or a wrongly scaled gradient is off by tens of percent.
BF16_GRAD_TOL, BF16_LOSS_RTOL, BF16_NORM_RTOL = 2e-2, 1e-4, 2e-3
LINK = ("send", "recv", "fan_out")


def _bf16_body(rank: int, cases: list) -> None:
    import torch.distributed as dist

    from oases.dp.master import grad_of
    from oases.parallel.comm import CommCounter
    from oases.parallel.layout import stages_layout, uniform_layout
    from oases.parallel.sharding import shard
    from oases.runtime.step import train_step

    for arch, engine, layout_name, extra in cases:
        pp, tp, stages = LAYOUTS[layout_name]
        moved = {}
        for precision in ("fp32", "bf16"):
            cfg = _cfg(arch, engine, "1f1b", pp, tp, 3, f"train.precision={precision}", *extra)
            layout = (uniform_layout(WORLD, pp, tp, cfg.model.n_layer) if stages is None else
                      stages_layout(stages, WORLD, cfg.model.n_layer, "test", cfg.pipeline_batch))
            ctx, model, ts, batches = stage(cfg, layout)
            with CommCounter() as counter:
                loss, norm = train_step(ts, batches, cfg.train.lr)
            moved[precision] = {k: counter.bytes[k] for k in LINK}
        what = f"{layout_name} {arch} {engine} {extra}"
        # every byte crosses the boundary once each way, counted at both ends (fp32: 4 B)
        total = torch.tensor([moved["fp32"][k] for k in LINK])
        dist.all_reduce(total)
        crossing = 2 * cfg.train.grad_accum * cfg.pipeline_batch * SEQ * cfg.model.d_model * 4
        assert total[:2].tolist() == [crossing, crossing], (what, total, crossing)
        assert (total[2] > 0) == (stages is not None), (what, total)  # tp2 replica: fan-out
        assert {k: 2 * v for k, v in moved["bf16"].items()} == moved["fp32"], (what, moved)
        ref_losses, ref_norm, ref_grads = shared_reference(cfg, 1)
        if ctx.is_last_stage:
            assert abs(loss - ref_losses[0]) <= BF16_LOSS_RTOL * ref_losses[0], (what, loss)
        assert abs(norm - ref_norm) <= BF16_NORM_RTOL * ref_norm, (what, norm, ref_norm)
        for name, p in model.named_parameters():
            rank_, size = getattr(p, "tp_coords", (ctx.tp_rank, ctx.tp))
            want = shard(ref_grads[name], getattr(p, "tp_spec", None), rank_, size)
            err = (grad_of(p) - want).abs().max() / want.abs().max()  # bf16: the main-grad
            assert err <= BF16_GRAD_TOL, (what, name, float(err))


def test_bf16_crosses_boundaries_in_bf16():
    """Broadcast transfers with a fan-out (tp2 | dp2) under the oases engine, and
    sequence-sharded transfers (pp2 x tp2, SP) under megatron."""
    run_distributed(_bf16_body, WORLD, tp=None, args=([
        ("gpt", ("oases", "fine"), "tp2|dp2", ()),
        ("llama", ("megatron", "none"), "pp2xtp2", ("parallel.sequence_parallel=true",))],))
