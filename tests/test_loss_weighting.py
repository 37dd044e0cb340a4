"""Token-weighted loss: ignored targets (``IGNORE_INDEX``) spread unevenly over the
sub-batches, micro-batches and DP ranks of a step, and the short last batch of a
validation file.

A step's loss is one cross-entropy mean over the counted targets of its whole global
batch, whatever the engine cuts it into. Each case runs one real ``train_step`` (the
``oases`` engine's sub-batches, ``grad_accum`` micro-batches, DP ranks, and a pp=2
pipeline whose stages change dp across the boundary) on a global batch where some
pieces count every target, some few and some none (a whole sub-batch of padding), and
checks the reported loss and every gradient against plain autograd of
``F.cross_entropy(..., ignore_index=-100)`` over the whole batch in one unsharded
process. The same model averaging the pieces' means instead is checked to be far off
(``_naive``), so the comparison can fail.

Validation: a val file shorter than one global batch, and one of 2.5 global batches,
at dp=2 (and through a pp=2 pipeline) evaluate the token mean over all their windows
(the last batch's missing rows are padding that counts nothing).

Tolerances: fp32, dropout 0. The runs differ from the reference in summation order
(the DP all-reduce, the TP all-reduce of partial matmuls, sums over pieces of the
batch) and in the per-piece weights n_k / N applied to each piece's mean (two more
roundings): ~1e-7 relative per op, a few ops deep. Losses: rtol 1e-5; gradients:
rtol 1e-4 / atol 1e-6, as the pipeline parity tests. The unweighted mean is off by
~1e-2 in the loss and by tens of percent in the gradients.
"""

from __future__ import annotations

import numpy as np
import torch
# AdamW imports torch._dynamo at its first use (seconds of CPU in every worker):
# imported once here, the forked workers inherit it
import torch._dynamo  # noqa: F401
import torch.nn.functional as F

from tests.support.distributed import run_distributed

SEQ = 16
SEED = 5
# Fraction of each global row's targets that are ignored: micro-batch 0 of DP rank 0
# starts with a sub-batch that counts nothing, micro-batch 1 of rank 0 counts little.
IGNORED = [1, 1, 0, 0, 0, 0, .1, 0, .9, .5, .9, .8, 0, .2, 1, 0]
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


def _cfg(world: int, engine: str, tp: int = 1, pp: int = 1, mbs: int = 4, grad_accum: int = 2,
         kind: str = "1f1b"):
    from oases.config import load_config

    return load_config(None, [
        "model.name=gpt-tiny", "model.n_layer=2", f"model.seq_len={SEQ}", "model.dropout=0",
        "model.init_std=0.1",  # logits far from uniform: per-token losses differ (see above)
        f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.schedule={engine}",
        f"parallel.pp_schedule={kind}",
        "parallel.recompute=fine" if engine == "oases" else "parallel.recompute=none",
        f"train.micro_batch_size={mbs}", f"train.grad_accum={grad_accum}",
        "train.grad_clip=0",  # gradients compared as the backward left them
        "train.warmup_steps=0", "train.lr=1e-3", "data.kind=synthetic", "wandb.mode=disabled",
    ]).validate(world)


def _global_batch(rows: int, vocab: int):
    """(x, y) of ``rows`` rows; row k ignores about ``IGNORED[k]`` of its targets."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randint(0, vocab, (rows, SEQ), generator=g)
    y = torch.randint(0, vocab, (rows, SEQ), generator=g)
    p = torch.tensor(IGNORED[:rows]).unsqueeze(1)
    y[torch.rand(rows, SEQ, generator=g) < p] = -100
    return x, y


class _Rows:
    """The step's micro-batches from one global batch, in ``TrainBatches``' order: call
    ``i`` gives DP rank ``r`` the rows ``i * mbs * dp + r * mbs + j`` (``j < mbs``)."""

    def __init__(self, x, y, mbs: int, dp_rank: int, dp: int) -> None:
        self.x, self.y, self.mbs, self.dp, self.r, self.i = x, y, mbs, dp, dp_rank, 0

    def next_batch(self):
        a = (self.i * self.dp + self.r) * self.mbs
        self.i += 1
        return self.x[a: a + self.mbs], self.y[a: a + self.mbs]


def _reference(cfg, x, y):
    """Loss and gradients of one cross-entropy mean over the counted targets of the
    whole batch, unsharded, plain autograd."""
    from oases.models import build_model

    model = build_model(cfg.model, cfg.padded_vocab(1), None, seed=SEED)
    logits = model(x)[..., : cfg.model.vocab_size]  # targets None: the logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                           ignore_index=-100)
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


def _naive(cfg, x, y, pieces: int) -> float:
    """The mean of the pieces' token means (rows cut into ``pieces`` equal pieces)."""
    from oases.models import build_model

    model = build_model(cfg.model, cfg.padded_vocab(1), None, seed=SEED)
    with torch.no_grad():
        return float(torch.stack([model(a, b) for a, b in zip(x.chunk(pieces),
                                                               y.chunk(pieces))]).mean())


def _check(model, ctx, loss: float, ref_loss: float, ref_grads: dict, what: str) -> None:
    from oases.parallel.sharding import shard

    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), f"{what}: loss {loss} vs {ref_loss}"
    for name, p in model.named_parameters():
        rank, size = getattr(p, "tp_coords", (ctx.tp_rank, ctx.tp))
        want = shard(ref_grads[name], getattr(p, "tp_spec", None), rank, size)
        torch.testing.assert_close(p.grad, want, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                   msg=lambda m: f"{what}: {name}: {m}")


def _step_body(ctx, ref: tuple) -> None:
    """One train_step per engine at dp=2 x tp=2, 2 micro-batches of 4 rows (the oases
    engine cuts each into 2 sub-batches)."""
    from oases.models import build_model
    from oases.dp.reducer import GradReducer
    from oases.overlap.engines import build_engine
    from oases.runtime.optim import build_optimizer
    from oases.runtime.step import TrainState, train_step

    for engine in ("oases", "megatron"):
        cfg = _cfg(ctx.world_size, engine, ctx.tp)
        x, y = _global_batch(cfg.global_batch_size, cfg.model.vocab_size)
        model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=SEED)
        model.train()
        opt = build_optimizer(model, cfg.train, ctx.device)
        reducer = GradReducer(model, ctx.dp_group, cfg.parallel.dp_bucket_mb)
        schedule = build_engine(engine, ctx.tp_group, cfg.sub_batches,
                                  cfg.parallel.recompute)
        batches = _Rows(x, y, cfg.train.micro_batch_size, ctx.dp_rank, ctx.dp)
        loss, _ = train_step(TrainState(cfg, ctx, model, opt, reducer, schedule), batches, 0.0)
        _check(model, ctx, loss, *ref, f"{engine} dp{ctx.dp}xtp{ctx.tp}")


def test_step_is_one_token_mean_over_the_global_batch():
    """dp=2 x tp=2, oases and megatron engines: sub-batches, micro-batches and DP ranks
    count their targets unevenly."""
    cfg = _cfg(4, "oases", 2)
    x, y = _global_batch(cfg.global_batch_size, cfg.model.vocab_size)
    ref = _reference(cfg, x, y)
    # the check can fail: weighting the pieces alike (the oases engine's sub-batches of 2
    # rows, or the micro-batches of 4 rows of each rank) is far outside the tolerance
    for rows in (2, 4):
        assert abs(_naive(cfg, x, y, len(x) // rows) - ref[0]) > 100 * LOSS_RTOL * ref[0]
    run_distributed(_step_body, world=4, tp=2, args=(ref,))


# ---- pp = 2: the loss's stage weighs its micro-batches and replicas by their tokens ----

PIPE_WORLD = 4
# (name, engine, pp_schedule, tp of the config, stages): dp 2 on both stages, and a layout
# whose dp changes across the boundary (the returning gradient is rescaled there)
PIPE_CASES = [
    ("pp2xdp2", "oases", "1f1b", 1, None),
    ("tp2|dp2", "megatron", "eager-1f1b", 1,
     [{"layers": [0, 1], "dp": 1, "tp": 2}, {"layers": [1, 2], "dp": 2, "tp": 1}]),
]


def _pipe_body(rank: int, cases: list, val: str, refs: dict) -> None:
    from oases.parallel.groups import build_pipeline_context
    from oases.parallel.layout import stages_layout, uniform_layout
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import ValBatches
    from oases.runtime.step import evaluate, train_step

    for name, engine, kind, tp, stages in cases:
        cfg = _cfg(PIPE_WORLD, engine, tp, pp=2, mbs=2, kind=kind)
        n = cfg.model.n_layer
        layout = (uniform_layout(PIPE_WORLD, 2, tp, n) if stages is None
                  else stages_layout(stages, PIPE_WORLD, n, "test", cfg.pipeline_batch))
        ctx = build_pipeline_context(layout, torch.device("cpu"), True)
        tracker = seed_tracker(cfg, ctx)
        model = build_rank_model(cfg, ctx, tracker, None, SEED)
        ts = build_train_state(cfg, ctx, model, tracker)
        pipe = ts.pipe
        rows = cfg.pipeline_batch // ctx.dp  # this replica's share of a micro-batch
        # evaluation first (the weights are still the reference's)
        got = evaluate(model, ValBatches(val, "uint16", SEQ, 256, rows, ctx.dp_rank, ctx.dp, 8),
                       cfg, ctx, pipe)
        want = refs["val"]
        assert abs(got - want) <= LOSS_RTOL * want, f"{name}: val loss {got} vs {want}"
        x, y = _global_batch(cfg.global_batch_size, cfg.model.vocab_size)
        loss, _ = train_step(ts, _Rows(x, y, rows, ctx.dp_rank, ctx.dp), 0.0)
        _check(model, ctx, loss, *refs["step"], f"{name} {engine} {kind}")


def test_pipeline_step_and_eval_are_token_means(tmp_path):
    """Also evaluation through the pipeline (``forward_only``) on a val file of 2.5
    global batches (pipeline batch 4 windows)."""
    val = _val_file(tmp_path, 10)
    cfg = _cfg(PIPE_WORLD, "megatron", pp=2, mbs=2)
    refs = {"val": _val_reference(cfg, val),
            "step": _reference(cfg, *_global_batch(cfg.global_batch_size, cfg.model.vocab_size))}
    run_distributed(_pipe_body, PIPE_WORLD, tp=None, args=(PIPE_CASES, str(val), refs))


# ---- validation files that do not fill their last global batch ----

def _val_file(tmp_path, windows: int):
    """A val file of exactly ``windows`` windows (and a few tokens that make none)."""
    path = tmp_path / f"val{windows}.bin"
    tokens = np.random.default_rng(windows).integers(0, 256, windows * SEQ + 1 + SEQ // 2)
    tokens.astype(np.uint16).tofile(path)
    return path


def _val_reference(cfg, path) -> float:
    """Unsharded: the mean cross-entropy over every target of every window of the file."""
    from oases.models import build_model

    model = build_model(cfg.model, cfg.padded_vocab(1), None, seed=SEED)
    tokens = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    n = (len(tokens) - 1) // SEQ
    win = torch.stack([tokens[w * SEQ: w * SEQ + SEQ + 1] for w in range(n)])  # (n, T+1)
    with torch.no_grad():
        logits = model(win[:, :-1])[..., : cfg.model.vocab_size]
        return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                     win[:, 1:].reshape(-1)))


def _eval_body(ctx, files: dict) -> None:
    from oases.models import build_model
    from oases.runtime.data import ValBatches
    from oases.runtime.step import evaluate

    cfg = _cfg(ctx.world_size, "megatron", mbs=2)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=SEED)
    for w, (path, want) in files.items():
        val = ValBatches(path, "uint16", SEQ, 256, 2, ctx.dp_rank, ctx.dp, max_batches=8)
        assert len(val) == -(-w // 4), (w, len(val))  # global batch: 2 rows x dp 2
        got = evaluate(model, val, cfg, ctx)
        assert abs(got - want) <= LOSS_RTOL * want, f"{w} windows: {got} vs {want}"
        assert model.training  # evaluate puts it back


def test_short_val_files_evaluate_every_window(tmp_path):
    """dp=2, global batch 4 windows: 3 windows (less than one batch; rank 1 gets one
    window and one padding row), and 10 windows (2.5 batches; in the last one rank 1
    gets only padding)."""
    cfg = _cfg(2, "megatron", mbs=2)
    files = {w: (str(p), _val_reference(cfg, p)) for w in (3, 10)
             for p in [_val_file(tmp_path, w)]}
    run_distributed(_eval_body, world=2, tp=1, args=(files,))
