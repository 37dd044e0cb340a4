"""Data parallelism (with and without TP) and gradient accumulation against one process.

Every configuration runs 3 optimizer steps of ``train_step`` (the real trainer step:
micro-batches, bucketed overlapped DP all-reduce, TP-aware clipping, AdamW) on
synthetic data, from the same seed, and must agree with the reference on the
per-step loss, the gradient norm and the final full (TP-gathered) parameters.

Same samples: ``TrainBatches`` walks one global sample counter, DP ranks interleaved
per micro-batch: with dp=2 and mbs=2, micro-step k gives rank r the samples
``k*4 + r*2 + j`` (j < 2), so the two ranks together hold samples ``k*4 .. k*4+3``;
one process with mbs=4 takes ``k*4 + j`` (j < 4): the same four samples at every
micro-step. With equal per-rank sample counts, the mean over dp of per-rank mean
losses is the mean over the global micro-batch, so the gradients agree exactly in
exact arithmetic. Likewise grad_accum=2 x mbs=2 sees samples 0..3 of each step in
two halves and averages them, as grad_accum=1 x mbs=4 does at once.

Tolerance: fp32 with the shipped AdamW eps (1e-8). The runs differ only in summation
order (DP all-reduce of two partial gradients, TP all-reduce of partial matmuls, a
batch of 4 vs two of 2), so:

* losses and gradient norms agree to ~1e-7 relative (measured <= 1.2e-6 over seeds
  1, 2, 7 and the four layouts): ``rtol=1e-5``;
* the DP-averaged gradient of step 1, before Adam sees it, agrees to a few ulp of the
  largest entries (|g| <= 0.06; measured max difference 3.7e-8, same seeds):
  ``atol=2e-7``. This is the sharpest DP check and does not depend on eps;
* the parameters after three AdamW steps are where eps matters. An entry moves by
  lr * m / (sqrt(v) + eps); where its gradient is near zero (terms that cancel, a
  GELU near its flat point, a k-projection bias whose gradient is zero in exact
  arithmetic) the sum's own rounding error delta is of the order of the gradient,
  and the update's sensitivity d(update)/dg = lr * eps / (|g| + eps)^2 peaks at
  lr / eps = 1e5 as g -> 0. With eps=1e-8, delta ~1e-10..1e-9 on such an entry
  moves it by up to ~lr * delta / eps ~ 1e-5..1e-4 per step: noise, not a bug
  (measured: at most 5 of 834k entries above 1e-5, max 5.5e-5). ``atol=2e-4``, one
  fifth of one lr=1e-3 step, leaves ~4x headroom.

A real DP bug stays far outside these (each injected and seen failing): a missing
all-reduce (even of a single entry per bucket) leaves the DP replicas different
(checked bit-exactly) and that entry's gradient at its half-batch value (~1e-3 off);
a doubled all-reduce or a wrong average (sum instead of mean, or divided twice)
scales the pre-clip gradient norm by 2 or 1/2 -- Adam and clipping hide a scale
from the weights, the norm check does not, and without clipping the step-1
gradients are off by the same factor; reading the wrong samples changes the step-1
loss at the 1e-3 level. Three steps at lr=1e-3 (cosine to 1e-4): the losses of
steps 2 and 3 follow updated weights, and training moves the median weight by
1.6e-3, 8x the parameter tolerance (99% of them beyond it: checked, so the weight
comparison is not vacuous), while the near-zero entries' noise has few steps to
compound.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from oases.models import build_model
from oases.config import load_config
from oases.dp.reducer import GradReducer
from oases.overlap.engines import build_engine
from oases.parallel.sharding import unshard
from oases.runtime.data import TrainBatches
from oases.runtime.optim import build_optimizer, lr_at
from oases.runtime.step import TrainState, train_step
from tests.support.distributed import run_distributed

SEED = 7
STEPS = 3
LOSS_RTOL = 1e-5
GRAD_ATOL, GRAD_RTOL = 2e-7, 1e-5
PARAM_ATOL, PARAM_RTOL = 2e-4, 0.0


def _cfg(tp: int, world: int, mbs: int, grad_accum: int, schedule: str = "megatron",
         recompute: str = "none"):
    return load_config(None, [
        f"parallel.schedule={schedule}", f"parallel.recompute={recompute}",
        "model.name=gpt-tiny", "model.dropout=0", "model.seq_len=64", f"parallel.tp={tp}",
        "data.kind=synthetic", f"train.micro_batch_size={mbs}", f"train.grad_accum={grad_accum}",
        f"train.steps={STEPS}", "train.warmup_steps=0", "train.lr=1e-3", "train.min_lr=1e-4",
        "parallel.dp_bucket_mb=0.25",  # several buckets: exercises the overlapped launches
    ]).validate(world)


def _gather(t: torch.Tensor, group, n: int) -> list[torch.Tensor]:
    if n == 1:  # one rank has no group (None would be the world)
        return [t.detach().clone()]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.detach().contiguous(), group=group)
    return out


def _train_body(ctx, runs: list[tuple], schedule: tuple = ("megatron", "none")):
    """For each (micro_batch_size, grad_accum, result file): train STEPS steps from
    SEED under ``schedule`` = (name, recompute), then save the losses, norms and full
    parameters (rank 0)."""
    for mbs, grad_accum, path in runs:
        cfg = _cfg(ctx.tp, ctx.world_size, mbs, grad_accum, *schedule)
        engine = build_engine(schedule[0], ctx.tp_group, cfg.sub_batches, schedule[1])
        assert (cfg.dp, cfg.parallel.tp) == (ctx.dp, ctx.tp)
        model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=SEED,
                            recompute=schedule[1] if schedule[0] == "megatron" else "none")
        model.train()
        opt = build_optimizer(model, cfg.train, ctx.device)
        reducer = GradReducer(model, ctx.dp_group, cfg.parallel.dp_bucket_mb)
        assert reducer.dp == ctx.dp
        batches = TrainBatches(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, mbs,
                               ctx.dp_rank, ctx.dp, cfg.seed)
        losses, norms, grads = [], [], {}
        for step in range(STEPS):
            loss, norm = train_step(TrainState(cfg, ctx, model, opt, reducer, engine), batches,
                                    lr_at(step, cfg.train))
            losses.append(loss)
            norms.append(norm)
            if step == 0:  # the DP-averaged (and clipped) gradient, before Adam sees it
                grads = {name: unshard(_gather(p.grad, ctx.tp_group, ctx.tp),
                                       getattr(p, "tp_spec", None)).clone()
                         for name, p in model.named_parameters()}
        assert batches.consumed == STEPS * cfg.global_batch_size
        # loss and norm are global quantities: every rank reports the same value
        for v in (losses, norms):
            t = torch.tensor(v, dtype=torch.float64)
            assert all(torch.equal(t, o) for o in _gather(t, None, ctx.world_size)), v
        params = {}
        for name, p in model.named_parameters():
            full = unshard(_gather(p, ctx.tp_group, ctx.tp), getattr(p, "tp_spec", None))
            # DP replicas apply the same averaged gradient: bit-identical weights
            reps = _gather(full, ctx.dp_group, ctx.dp)
            assert all(torch.equal(reps[0], r) for r in reps[1:]), f"{name} differs over dp"
            params[name] = full.clone()
        if ctx.rank == 0:
            torch.save({"losses": losses, "norms": norms, "params": params, "grads": grads,
                        "global_batch": cfg.global_batch_size}, path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """World 1: mbs=4 x grad_accum=2 (the DP reference), and mbs=2 x grad_accum=2 vs
    mbs=4 x grad_accum=1 (the accumulation pair)."""
    d = tmp_path_factory.mktemp("dp_ref")
    runs = {"ref": (4, 2), "accum": (2, 2), "noaccum": (4, 1)}
    run_distributed(_train_body, world=1, tp=1,
                    args=([(m, g, str(d / f"{k}.pt")) for k, (m, g) in runs.items()],))
    return {k: torch.load(d / f"{k}.pt") for k in runs}


def _compare(got: dict, ref: dict) -> None:
    assert got["global_batch"] == ref["global_batch"]
    assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                 rtol=LOSS_RTOL, atol=0.0)
    assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]),
                 rtol=LOSS_RTOL, atol=0.0)
    assert got["params"].keys() == ref["params"].keys()
    for name, g in got["grads"].items():
        assert_close(g, ref["grads"][name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                     msg=lambda m: f"step-1 gradient of {name}: {m}")
    for name, p in got["params"].items():
        r = ref["params"][name]
        assert p.shape == r.shape, name
        assert_close(p, r, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=lambda m: f"{name}: {m}")


def _moved_beyond_tolerance(ref: dict) -> float:
    """The fraction of weights training moved by more than PARAM_ATOL: a comparison that
    passes must not be trivially true because (almost) nothing changed."""
    cfg = _cfg(1, 1, 4, 2)
    init = dict(build_model(cfg.model, cfg.padded_vocab_size, None, seed=SEED).named_parameters())
    moved = torch.cat([(ref["params"][n] - p.detach()).abs().flatten() for n, p in init.items()])
    return float((moved > PARAM_ATOL).float().mean())


@pytest.mark.parametrize("world,tp,schedule", [
    (4, 2, ("megatron", "none")), (2, 1, ("megatron", "none")), (4, 2, ("oases", "fine")),
    (4, 2, ("oases", "full"))], ids=["dp2xtp2", "dp2xtp1", "dp2xtp2-oases-fine",
                                     "dp2xtp2-oases-full"])
def test_dp_matches_single_process(world, tp, schedule, reference, tmp_path):
    path = tmp_path / "dp.pt"
    run_distributed(_train_body, world=world, tp=tp, args=([(2, 2, str(path))], schedule))
    got = torch.load(path)
    assert got["global_batch"] == 8
    _compare(got, reference["ref"])
    # the loss is a real training signal, and most weights moved by more than the tolerance
    assert all(4.0 < v < 7.0 for v in got["losses"]), got["losses"]
    assert _moved_beyond_tolerance(reference["ref"]) > 0.9


def test_grad_accum_matches_one_big_micro_batch(reference):
    accum, noaccum = reference["accum"], reference["noaccum"]
    assert accum["global_batch"] == noaccum["global_batch"] == 4
    _compare(accum, noaccum)
    # and it is a different batch from the reference's (8 samples): not a vacuous match
    assert accum["losses"][1:] != reference["ref"]["losses"][1:]


def test_buckets_never_span_two_blocks():
    """Each block's gradients form their own bucket(s), so its sync can start as soon as
    its backward is done (the planner's cost model assumes it); parameters outside the
    blocks (final norm, head) share what is left; the size limit still splits a block."""
    cfg = _cfg(1, 1, 2, 1)
    model = build_model(cfg.model, cfg.padded_vocab_size, None, None, seed=0)
    block_of = {id(p): i for i, blk in enumerate(model.blocks()) for p in blk.parameters()}
    reducer = GradReducer(model, None, bucket_mb=1e6)  # no size limit in effect
    owners = [{block_of.get(id(p), -1) for p in b.params} for b in reducer.buckets]
    assert all(len(o) == 1 for o in owners)
    assert sorted(o.pop() for o in owners) == [-1] + list(range(len(model.blocks())))
    block_mb = max(sum(p.numel() * 4 for p in blk.parameters()) for blk in model.blocks()) / 2**20
    small = GradReducer(model, None, bucket_mb=block_mb / 3)
    assert len(small.buckets) > len(reducer.buckets)
    n = sum(p.numel() for p in model.parameters())
    assert sum(b.buffer.numel() for b in small.buckets) == n
