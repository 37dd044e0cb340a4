"""bf16 autocast under the ``oases`` engine: weight casts and the activation memory model.

1. Casts. Autocast caches the bf16 copy of each weight until its outermost region
   exits; the engine holds one region for a run, so each weight matrix is cast once
   per run (not once per segment and sub-batch, forward and recompute), and no
   activation's copy is cached (the graph cuts hand views to the layers). A region
   around several runs (a step's micro-batches) extends the cache to all of them.
   Casts are counted as ``aten._to_copy`` to bf16 of a parameter, with a dispatch mode.
2. Memory. The planner's saved bytes per block (``CostModel.saved_bytes``: the
   residual stream in fp32, bf16 under bf16 weights; the reduced partial sum in the
   compute dtype; the profiled figure for ``none``) equal what ``SavedTensorMeter``
   measures for one layer (a 2-layer model minus a 1-layer one), under bf16-autocast,
   bf16 weights (the profiler then measures blocks with bf16 weights) and fp32. The
   tolerance is zero: both count the same tensors' bytes, and the ``none`` figure is measured
   the profiler's way (one block, one sub-batch) with the weights it holds removed
   (under ``none`` the meter sees the weights once, shared by the sub-batches).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oases.models import build_model
from oases.config import load_config
from oases.overlap.engines import OasesEngine
from oases.overlap.memory import SavedTensorMeter
from oases.parallel.random import TPRNGTracker
from oases.parallel.sharding import init_parameters
from oases.planner.api import run_shape
from oases.planner.cluster import load_cluster
from oases.planner.cost import CostModel, ModelShape, Profile
from oases.parallel.wire import compute_dtype, to_wire, wire_dtype
from oases.planner.profile import make_block
from tests.support.distributed import run_distributed

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
BF16 = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
OVERRIDES = ["model.name=gpt-tiny", "parallel.tp=2", "model.dropout=0.1", "model.seq_len=32",
             "train.micro_batch_size=4", "parallel.schedule=oases"]


class _Casts(TorchDispatchMode):
    """Counts bf16 casts per parameter name, and casts of activation leaves."""

    def __init__(self, model):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n for n, p in model.named_parameters()}
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            t = args[0]
            name = self.names.get(t.untyped_storage().data_ptr())
            if name is not None:
                self.counts[name] += 1
            elif t.is_leaf and t.requires_grad:
                self.counts["<activation leaf>"] += 1
        return func(*args, **kwargs)


def _model(ctx, cfg, seed=1):
    tracker = TPRNGTracker(CPU)
    tracker.seed(seed, ctx.tp_rank)
    return build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, tracker, "none",
                       seed=1), tracker


def _casts_body(ctx):
    cfg = load_config(None, OVERRIDES + ["model.n_layer=1"]).validate(2)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    grads = {}

    def cast_once(casts, model, what):
        matrices = {n for n, p in model.named_parameters() if p.dim() == 2 and "wpe" not in n}
        weights = {n: k for n, k in casts.counts.items() if n in matrices}
        # every weight matrix (4 per layer and the tied head), cast once
        assert weights == {n: 1 for n in matrices}, (what, dict(casts.counts))
        assert casts.counts["<activation leaf>"] == 0, (what, dict(casts.counts))

    for rc in ("none", "fine"):
        model, tracker = _model(ctx, cfg)
        sched = OasesEngine(ctx.tp_group, 2, rc, tracker)
        torch.manual_seed(5)  # the sub-batches' RNG streams derive from it
        with _Casts(model) as casts:
            sched.forward_backward(model, ids, ids, amp=BF16)
        cast_once(casts, model, rc)
        grads[rc] = {n: p.grad.clone() for n, p in model.named_parameters()}
    with BF16(), _Casts(model) as casts:  # two micro-batches in one enclosing region
        for _ in range(2):
            sched.forward_backward(model, ids, ids, amp=BF16)
    cast_once(casts, model, "two fine runs in one region")
    # the shared copy carries the weights' gradients: fine's recompute and none compute
    # the same bf16 products; only fp32 sums of gradients differ in order (the residual
    # stream's, the shared copy's two sub-batches), ~1e-7
    for n, g in grads["none"].items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(grads["fine"][n], g, rtol=1e-5, atol=1e-6, msg=n)


def test_each_weight_is_cast_once_per_run():
    run_distributed(_casts_body, world=2, tp=2)


def _measured(ctx, precision, rc, n_layer):
    cfg = load_config(None, OVERRIDES + [f"model.n_layer={n_layer}", f"parallel.recompute={rc}",
                                         f"train.precision={precision}"]).validate(2)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    model, tracker = _model(ctx, cfg)
    if precision == "bf16":  # bf16 weights (the reducer casts them in a run)
        model.to(torch.bfloat16)
    amp = BF16 if precision != "fp32" else contextlib.nullcontext
    with SavedTensorMeter() as meter:
        OasesEngine(ctx.tp_group, 2, rc, tracker).forward_backward(model, ids, ids, amp=amp)
    return cfg, meter.forward_bytes


def _profiled_saved(cfg, run, t: int) -> dict:
    """Saved bytes of one block at degree t on one sub-batch, measured as the planner's
    profiler does (oases.planner.profile.profile_compute)."""
    rows = run.micro_batch_size // run.sub_batches * t // run.tp
    out = {}
    for kind in ("attn", "mlp"):
        blk = make_block(kind, cfg.model, t)
        init_parameters(blk, 0, 0, 1)
        wdt = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
        blk.to(wdt)  # as oases.planner.profile measures
        x = torch.randn(rows, cfg.model.seq_len, cfg.model.d_model, dtype=wdt,
                        requires_grad=True)
        with SavedTensorMeter() as meter, \
                (BF16() if cfg.train.precision != "fp32" else contextlib.nullcontext()):
            y = blk(x)
            SavedTensorMeter.end_of_forward()
        del y
        out[kind] = {"fwd": 1e-3, "bwd": 2e-3, "saved": meter.forward_bytes}
    return out


def _memory_body(ctx):
    cluster = load_cluster(str(ROOT / "configs/cluster/two-nodes-1g.yaml"))
    for precision in ("bf16-autocast", "bf16", "fp32"):
        for rc in ("none", "fine", "full"):
            cfg, one = _measured(ctx, precision, rc, 1)
            _, two = _measured(ctx, precision, rc, 2)
            run = run_shape(cfg)
            blocks = {k: {"2": v} for k, v in _profiled_saved(cfg, run, 2).items()}
            cm = CostModel(ModelShape.from_config(cfg.model), run, cluster,
                           Profile(blocks, {"fwd": 0.0, "bwd": 0.0}), [2])
            predicted = sum(run.sub_batches * cm.saved_bytes(k, 2) for k in ("attn", "mlp"))
            if rc == "none":  # the meter sees the layer's weights too, once
                predicted += sum(cm.weight_bytes(k, 2) for k in ("attn", "mlp"))
            assert predicted == two - one, (precision, rc, predicted, two - one)
            if rc == "fine":  # per element: fp32 block input + reduced in the compute dtype
                elems = 2 * run.sub_batches * 2 * cfg.model.seq_len * cfg.model.d_model
                stream = 2 if precision == "bf16" else 4  # bf16 weights: a bf16 stream
                assert two - one == elems * (stream + (2 if precision != "fp32" else 4))


def test_planner_saved_bytes_match_the_meter():
    run_distributed(_memory_body, world=2, tp=2)


def test_wire_dtype_is_the_compute_dtype_under_autocast():
    f32, b16, f16 = torch.float32, torch.bfloat16, torch.float16
    null = contextlib.nullcontext
    assert wire_dtype(BF16, CPU, f32) == b16
    assert wire_dtype(null, CPU, f32) == f32
    assert wire_dtype(BF16, CPU, b16) == b16
    assert wire_dtype(BF16, CPU, torch.float64) == b16
    assert wire_dtype(lambda: torch.autocast("cpu", dtype=f16), CPU, b16) == b16  # not wider
    assert compute_dtype(CPU) is None  # amp's region is left: nothing leaks out of it
    x = torch.randn(3, 4, requires_grad=True)
    assert to_wire(x) is x  # no autocast: the tensor itself
    ids = torch.arange(4)
    with BF16():
        y = to_wire(x)
        assert to_wire(ids) is ids  # only floating tensors are cast
    assert y.dtype == b16 and torch.equal(y, x.detach().to(b16))
    y.float().sum().backward()
    assert x.grad.dtype == f32 and torch.equal(x.grad, torch.ones_like(x))
