"""GQA with more TP ranks than kv heads: each kv head replicated on the ranks that use it.

llama-tiny has 4 query heads and 2 kv heads; at tp=4 ranks {0,1} hold kv head 0 and
{2,3} kv head 1 (oases.config.heads), and the kv rows' gradients are summed over those
replica groups (oases.dp.replicas). ``model.n_kv_heads=1`` (MQA) replicates at
every degree above 1, so per-block degrees 2 and 4 both have replica groups.

Each parity case runs one real ``train_step`` (the trainer's model, schedule,
reducer with the replica sum, clipping, AdamW; ``oases.runtime.build``) and
compares with one unsharded process on the same batch: the loss and the gradient
norm, and every rank's gradient against ``shard(reference gradient)`` -- which for
a replicated kv head is the whole head's gradient, so a missing replica sum (each
replica holds only its own query heads' share) or a doubled one fails;
then a second step's loss, which follows the Adam update. Replicas must hold
bit-identical kv rows (weights and gradients), or they drift apart in training.

Tolerance: fp32, dropout 0; the sharded runs add the same terms in another order
(row-parallel partial sums, the vocab-parallel loss, the replica sum of two
shares), ~1e-7 relative per op, as tests/test_models.py: losses and norms
rtol 1e-5, gradients rtol 1e-5 / atol 1e-6 (measured at tp=4: losses within
1.7e-7 relative, norm 8e-8, gradients within 1.1e-8 absolute for entries up to
0.024). With the replica sum left out (measured, clipping off) the kv gradients are
80% off (norm of the difference over the norm), the gradient norm 2%, and the
second step's loss 2.6e-4 relative.

Checkpoints: saved at tp=4 (replicated kv chunks are one chunk at one offset, which
DCP writes once) and loaded at tp=1 and tp=2, and saved at tp=2 and loaded at tp=4:
every full parameter and Adam moment comes back bit-identical and the loss of a
batch agrees to rtol 1e-5. HF: a tiny ``LlamaForCausalLM`` (built in code) loads at
tp=4 with HF's logits (atol 1e-4, as tests/test_hf.py), and its tp=4 checkpoint
exports back to exactly HF's tensors, each kv head once. Pipeline stages build
their own replica groups (pp 2 x tp 2, MQA); a context built without the model's kv
heads is refused rather than training the replicas apart; and the planner counts a
whole kv head per replica and the replica sum.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.support.distributed import run_distributed

RTOL, ATOL = 1e-5, 1e-6
SEQ = 32


def _cfg(tp: int, world: int, schedule: str = "megatron", extra=()):
    from oases.config import load_config

    return load_config(None, [
        "model.name=llama-tiny", "model.dropout=0", f"model.seq_len={SEQ}", f"parallel.tp={tp}",
        f"parallel.schedule={schedule}",
        "parallel.recompute=" + ("fine" if schedule == "oases" else "none"),
        "train.micro_batch_size=4", "train.lr=1e-3", "train.warmup_steps=0",
        "data.kind=synthetic", *extra]).validate(world)


def _train(cfg, ctx, degrees=None, steps: int = 2):
    """``steps`` train_steps of the trainer's own pieces; returns (model, opt, losses,
    norm and gradients of step 1)."""
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches
    from oases.runtime.step import train_step

    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, degrees, cfg.seed)
    ts = build_train_state(cfg, ctx, model, tracker)
    opt = ts.opt
    batches = TrainBatches(cfg.data, SEQ, cfg.model.vocab_size, cfg.train.micro_batch_size,
                           0, 1, cfg.seed)
    losses, norm, grads = [], None, None
    for s in range(steps):
        loss, n = train_step(ts, batches, cfg.train.lr)
        losses.append(loss)
        if s == 0:
            norm, grads = n, {k: p.grad.clone() for k, p in model.named_parameters()}
    return model, opt, losses, norm, grads


def _replicas_equal(model, ctx, tensors: dict, what: str) -> None:
    """Every replicated part is bit-identical on the ranks that hold the same chunk of
    it (in one degree-t subgroup, and across subgroups, which replicate whole blocks)."""
    from oases.parallel.sharding import chunk_of, part_views

    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None)
        if spec is None or not spec.units:
            continue
        size = getattr(p, "tp_coords", (0, ctx.tp))[1]
        for i, (v, r) in enumerate(part_views(tensors[name], spec, size)):
            if r == 1:
                continue
            out = [torch.empty_like(v) for _ in range(ctx.tp)]
            dist.all_gather(out, v.contiguous(), group=ctx.tp_group)
            first: dict[int, int] = {}
            for j in range(ctx.tp):
                c = chunk_of(spec, i, j % size, size)[0]
                assert torch.equal(out[first.setdefault(c, j)], out[j]), \
                    f"{what}: {name} part {i} differs on tp ranks {first[c]} and {j}"


def _reference(schedule: str, extra=()) -> tuple:
    """(losses, norm, gradients) of the unsharded model, in the test process (the
    workers inherit it)."""
    from oases.parallel.groups import ParallelContext

    return _train(_cfg(1, 1, schedule, extra), ParallelContext.single())[2:]


def _parity(ctx, schedule: str, degrees, extra, ref: tuple, what: str) -> None:
    from oases.parallel.sharding import shard

    cfg = _cfg(ctx.tp, ctx.world_size, schedule, extra)
    model, _, losses, norm, grads = _train(cfg, ctx, degrees)
    ref_losses, ref_norm, ref_grads = ref
    assert abs(losses[0] - ref_losses[0]) <= RTOL * ref_losses[0], (what, losses, ref_losses)
    n_repl = 0
    for name, p in model.named_parameters():
        spec = getattr(p, "tp_spec", None)
        rank, size = getattr(p, "tp_coords", (ctx.tp_rank, ctx.tp))
        assert_close(grads[name], shard(ref_grads[name], spec, rank, size), rtol=RTOL, atol=ATOL,
                     msg=lambda m: f"{what}: {name}: {m}")
        n_repl += bool(spec is not None and spec.units and size > cfg.model.n_kv_heads)
    assert n_repl > 0, f"{what}: nothing was replicated"
    assert abs(norm - ref_norm) <= RTOL * ref_norm, f"{what}: norm {norm} vs {ref_norm}"
    # the second step follows the Adam update of the first
    assert abs(losses[1] - ref_losses[1]) <= RTOL * ref_losses[1], (what, losses, ref_losses)
    _replicas_equal(model, ctx, grads, f"{what} grads")
    _replicas_equal(model, ctx, {k: p.detach() for k, p in model.named_parameters()},
                    f"{what} weights")


def _uniform_body(rank: int, refs: dict) -> None:
    from oases.parallel.groups import build_context
    from oases.planner.cost import ModelShape
    from oases.planner.profile import make_block

    ctx = build_context(4, torch.device("cpu"), kv_heads=2)
    for schedule, ref in refs.items():
        _parity(ctx, schedule, None, (), ref, f"tp4 {schedule}")
    # the planner's view of a rank's attention block: one whole kv head (k and v rows)
    cfg = _cfg(4, 4)
    attn = _train(cfg, ctx, steps=0)[0].layers[0].attn
    assert attn.qkv.weight.shape == ((4 // 4 + 2 * 1) * 32, 128)
    assert make_block("attn", cfg.model, 4).qkv.weight.shape == attn.qkv.weight.shape  # profile
    n = sum(p.numel() for name, p in attn.named_parameters() if not name.startswith("norm"))
    assert ModelShape.from_config(cfg.model).rank_params("attn", 4) == n + 128 / 4  # norm / t


def test_tp4_matches_tp1():
    """llama-tiny (2 kv heads) at tp=4, kv heads replicated on rank pairs, under the
    megatron and the oases engine (2 sub-batches, fine recompute)."""
    refs = {s: _reference(s) for s in ("megatron", "oases")}
    run_distributed(_uniform_body, world=4, tp=None, args=(refs,))


# attn, mlp of 4 layers at T = 4: attention at degrees 4, 2, 1 and 4
MIXED = [4, 2, 2, 4, 1, 2, 4, 1]


def _mixed_body(rank: int, refs: dict) -> None:
    from oases.parallel.groups import build_context

    for kv, ref in refs.items():  # kv 2: replicated at degree 4 only; kv 1: at 4 and 2
        ctx = build_context(4, torch.device("cpu"), kv_heads=kv)
        dg = ctx.degree_groups()
        assert (dist.get_world_size(dg.kv[4]), dg.kv.get(2) is None) == (4 // kv, kv == 2)
        _parity(ctx, "megatron", MIXED, [f"model.n_kv_heads={kv}"], ref, f"mixed plan, {kv} kv")


def test_mixed_plan_replicates_per_block_degree():
    refs = {kv: _reference("megatron", [f"model.n_kv_heads={kv}"]) for kv in (2, 1)}
    run_distributed(_mixed_body, world=4, tp=None, args=(refs,))


PIPELINE = ["model.n_kv_heads=1", "parallel.pp=2", "train.grad_accum=2"]


def _pipeline_body(rank: int, ref: tuple) -> None:
    """pp 2, each stage tp 2, MQA: each stage replicates its kv head over its own pair."""
    from oases.parallel.groups import build_pipeline_context
    from oases.parallel.layout import uniform_layout
    from oases.parallel.sharding import shard

    cfg = _cfg(2, 4, extra=PIPELINE)
    ctx = build_pipeline_context(uniform_layout(4, 2, 2, cfg.model.n_layer), torch.device("cpu"),
                                 False, kv_heads=1)
    assert dist.get_world_size(ctx.kv_group) == 2
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state
    from oases.runtime.data import TrainBatches
    from oases.runtime.step import train_step

    tracker = seed_tracker(cfg, ctx)
    model = build_rank_model(cfg, ctx, tracker, None, cfg.seed)
    ts = build_train_state(cfg, ctx, model, tracker)
    batches = TrainBatches(cfg.data, SEQ, cfg.model.vocab_size, cfg.pipeline_batch, 0, 1,
                           cfg.seed)
    ref_losses, ref_norm, ref_grads = ref
    loss, norm = train_step(ts, batches, cfg.train.lr)
    assert abs(loss - ref_losses[0]) <= RTOL * ref_losses[0], (loss, ref_losses)
    assert abs(norm - ref_norm) <= RTOL * ref_norm, (norm, ref_norm)
    for name, p in model.named_parameters():
        want = shard(ref_grads[name], getattr(p, "tp_spec", None), ctx.tp_rank, ctx.tp)
        assert_close(p.grad, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_pipeline_stages_replicate_with_their_own_groups():
    from tests.support.parity import unsharded_reference

    ref = unsharded_reference(_cfg(2, 4, extra=PIPELINE), 1)  # one process, the same batches
    run_distributed(_pipeline_body, world=4, tp=None, args=(ref,))


# ---------------------------------------------------------------------------
# Checkpoints across tp, consolidation

def _full_state(model, opt, ctx) -> dict:
    """name -> full tensor, for the weights and both Adam moments (gathered over TP)."""
    from oases.parallel.sharding import unshard

    out = {}
    for name, p in model.named_parameters():
        st = opt.state[p]
        for key, t in (("w", p.detach()), ("m", st["exp_avg"]), ("v", st["exp_avg_sq"])):
            shards = [t.clone()]  # tp 1: one shard, and no TP group (None: the world)
            if ctx.tp > 1:
                shards = [torch.empty_like(t) for _ in range(ctx.tp)]
                dist.all_gather(shards, t.contiguous(), group=ctx.tp_group)
            out[f"{key}/{name}"] = unshard(shards, getattr(p, "tp_spec", None))
    return out


def _batch_loss(model, cfg) -> float:
    from oases.runtime.data import TrainBatches

    x, y = TrainBatches(cfg.data, SEQ, cfg.model.vocab_size, 4, 0, 1, cfg.seed + 1).next_batch()
    with torch.no_grad():
        return float(model(x, y))


def _checkpoint_body(rank: int, root: str) -> None:
    from pathlib import Path

    from oases.parallel.groups import build_context
    from oases.runtime import checkpoint as ckpt
    from oases.runtime.build import build_rank_model, seed_tracker
    from oases.runtime.optim import build_optimizer
    from oases.runtime.resume import model_shape

    def save(tp: int, out: str):
        ctx = build_context(tp, torch.device("cpu"), kv_heads=2)
        cfg = _cfg(tp, 4)
        model, opt, _, _, _ = _train(cfg, ctx, steps=1)  # Adam moments are not zero
        meta = {"step": 1, "model_shape": model_shape(cfg)}
        path = ckpt.save(out, 1, model, opt, ctx, meta, {})
        return path, _full_state(model, opt, ctx), _batch_loss(model, cfg)

    def load(tp: int, path):
        ctx = build_context(tp, torch.device("cpu"), kv_heads=2)
        cfg = _cfg(tp, 4)
        model = build_rank_model(cfg, ctx, seed_tracker(cfg, ctx), None, None)
        opt = build_optimizer(model, cfg.train, ctx.device)
        ckpt.load(path, model, opt, ctx, model_shape(cfg))
        return _full_state(model, opt, ctx), _batch_loss(model, cfg)

    for saved_tp, loaded_tps in ((4, (1, 2)), (2, (4,))):
        path, state, loss = save(saved_tp, str(Path(root) / f"tp{saved_tp}"))
        for tp in loaded_tps:
            got, got_loss = load(tp, path)
            what = f"saved at tp={saved_tp}, loaded at tp={tp}"
            for k, v in state.items():
                n = min(v.shape[0], got[k].shape[0])  # the vocabulary padding follows tp
                assert torch.equal(got[k][:n], v[:n]), f"{what}: {k}"
            assert abs(got_loss - loss) <= RTOL * loss, (what, got_loss, loss)
        if saved_tp == 4:  # collective here (DCP), one process in consolidate and export
            full = ckpt.full_model_state(path)
            for name, t in full.items():
                want = state[f"w/{name}"]
                assert torch.equal(t, want[: t.shape[0]]), name
            hd = 128 // 4
            saved = ckpt.read_metadata(path)
            assert tuple(saved["model/layers.0.attn.qkv.weight.part1"].size) == (2 * hd, 128)


@pytest.mark.slow  # two layouts' runs and a checkpoint (test_reshard covers layouts fast)
def test_checkpoint_across_tp(tmp_path):
    run_distributed(_checkpoint_body, world=4, tp=None, args=(str(tmp_path),))


# ---------------------------------------------------------------------------
# Hugging Face import and export at tp=4

def _hf_body(rank: int, hf_dir: str, ids, ref_logits, out: str) -> None:
    from pathlib import Path

    from oases.models import build_model
    from oases.models.hf import hf_state_dict, load_hf_weights
    from oases.config import load_config
    from oases.parallel.groups import build_context
    from oases.parallel.sharding import shard
    from oases.runtime import checkpoint as ckpt
    from oases.runtime.build import build_rank_model, seed_tracker
    from oases.runtime.optim import build_optimizer
    from oases.runtime.resume import model_shape

    ctx = build_context(4, torch.device("cpu"), kv_heads=2)
    cfg = load_config(None, [f"model.init_from=hf:{hf_dir}", "parallel.tp=4",
                             "model.dropout=0"]).validate(4)
    assert (cfg.model.n_head, cfg.model.n_kv_heads) == (4, 2)
    model = build_rank_model(cfg, ctx, seed_tracker(cfg, ctx), None, None)
    load_hf_weights(model, hf_dir, ctx.tp_rank, ctx.tp)
    model.eval()
    assert_close(model.full_logits(ids), ref_logits, rtol=0, atol=1e-4)
    full = build_model(cfg.model, cfg.padded_vocab_size, None, seed=None)
    load_hf_weights(full, hf_dir, 0, 1)
    fp = dict(full.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), shard(fp[name].detach(), p.tp_spec, ctx.tp_rank, 4)), name
    _replicas_equal(model, ctx, {k: p.detach() for k, p in model.named_parameters()}, "hf")

    opt = build_optimizer(model, cfg.train, ctx.device)
    path = ckpt.save(out, 0, model, opt, ctx, {"step": 0, "model_shape": model_shape(cfg)}, {})
    full_state = ckpt.full_model_state(path)  # collective under a process group
    if rank == 0:
        from safetensors.torch import load_file

        theirs = load_file(Path(hf_dir) / "model.safetensors")
        ours = hf_state_dict(full_state, cfg.model)
        assert ours.keys() == theirs.keys()
        for k, v in theirs.items():  # k_proj, v_proj: (2 kv heads x 16, 64), each head once
            assert torch.equal(ours[k], v), k


def test_hf_roundtrip_at_tp4(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from tests.support.hf_models import make_hf_model, save_hf

    hf = make_hf_model("llama-untied")
    d = save_hf(hf, tmp_path / "hf")
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = hf(ids).logits.float()
    run_distributed(_hf_body, world=4, tp=None, args=(str(d), ids, logits, str(tmp_path / "ck")))


def _no_kv_groups_body(ctx) -> None:
    from oases.runtime.build import build_rank_model, seed_tracker, build_train_state

    cfg = _cfg(2, 2, extra=["model.n_kv_heads=1"])
    model = build_rank_model(cfg, ctx, seed_tracker(cfg, ctx), None, cfg.seed)
    with pytest.raises(ValueError, match="replicated on 2 ranks but the kv replica group has 1"):
        build_train_state(cfg, ctx, model, seed_tracker(cfg, ctx))


def test_context_without_kv_replica_groups_is_refused():
    """A context built without the model's kv heads has no replica groups: training
    would let the replicas drift apart, so the reducer refuses to be built."""
    run_distributed(_no_kv_groups_body, world=2, tp=2)


def test_planner_counts_replicated_kv_heads():
    """The planner's degrees and costs: a degree above the kv heads is a candidate
    (replicating), one that fits them neither way is not; each replica holds a whole
    kv head, and only replicated attention blocks pay the per-step replica sum."""
    from oases.planner.cluster import Cluster
    from oases.planner.cost import CostModel, ModelShape, RunShape
    from oases.planner.fit import analytic_profile

    shape = ModelShape("llama", 2, 128, 4, 2, 384, 256, 32, False, False)  # llama-tiny-like
    assert shape.valid_degrees(4) == [1, 2, 4]
    assert ModelShape("llama", 2, 96, 12, 3, 384, 256, 32).valid_degrees(4) == [1]
    hd = 128 // 4
    one_head = 2 * hd * 128                       # k and v rows of one kv head
    assert shape.rank_params("attn", 4) - shape.block_params("attn") / 4 == \
        one_head - 2 * one_head / 4               # a whole head, not half of one
    assert shape.rank_params("attn", 2) == shape.block_params("attn") / 2
    run = RunShape(4, 1, 4, 1, 2, "oases", "fine")
    cm = CostModel(shape, run, Cluster("c", 1, 4, 80, 100, 10), analytic_profile(shape, run,
                                                                                 [1, 2, 4]))
    assert cm.kv_sync["attn", 4] > 0
    assert cm.kv_sync["attn", 2] == cm.kv_sync["mlp", 4] == 0.0
