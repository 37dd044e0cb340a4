"""GPU defaults as pure logic on the CPU, and their CUDA behaviour where a GPU is present.

``train.precision=auto`` resolves to bf16 on CUDA and fp32 elsewhere, once, and the
resolved value is what the run, the planner and autocast use; CUDA sets fp32 matmuls
to TF32; MFU divides by the peak of the run's precision (a table by device name);
peak memory is the maximum over the ranks; clipping measures with foreach norms and
leaves the norm on the device; grouped-query attention reaches a fused kernel.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing import assert_close

import oases.models.attention as attention
from oases.models import build_model
from oases.config import ConfigError, load_config
from oases.config.schema import resolve_precision
from oases.planner.api import run_shape
from oases.planner.profile import run_precision
from oases.planner.stages import job_from_config
from oases.runtime import metrics
from oases.runtime.metrics import MetricsLogger, peak_flops, peak_for
from oases.runtime.optim import weighted_squares, clip_grads, clip_grads_norm
from oases.runtime.step import autocast
from oases.runtime.trainer import with_device_precision, use_tf32

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _cfg(*overrides, world=1):
    return load_config(None, ["model.name=llama-tiny", *overrides]).validate(world)


# ---------------------------------------------------------------------------
# precision

@pytest.mark.parametrize("asked, device, used", [
    ("auto", "cuda", "bf16"), ("auto", "cpu", "fp32"),
    ("fp32", "cuda", "fp32"), ("bf16", "cpu", "bf16"), ("bf16", "cuda", "bf16"),
])
def test_precision_resolves_by_device_type(asked, device, used):
    assert resolve_precision(asked, device) == used


def test_auto_is_the_default_and_fp16_is_refused():
    assert _cfg().train.precision == "auto"
    with pytest.raises(ConfigError, match="train.precision=.fp16. is not one of auto, fp32, bf16, bf16-autocast"):
        _cfg("train.precision=fp16")


def test_the_run_config_carries_the_resolved_precision():
    cfg = _cfg().freeze()
    on_gpu, on_cpu = with_device_precision(cfg, CUDA), with_device_precision(cfg, CPU)
    assert (on_gpu.train.precision, on_cpu.train.precision) == ("bf16", "fp32")
    assert on_gpu.frozen and cfg.train.precision == "auto"  # the original is left alone
    assert on_gpu.to_dict()["train"]["precision"] == "bf16"  # what config.yaml and W&B get
    explicit = _cfg("train.precision=fp32").freeze()
    assert with_device_precision(explicit, CUDA) is explicit


def test_planner_and_autocast_read_the_resolved_precision():
    cpu_cfg = _cfg("parallel.device=cpu")
    assert run_precision(cpu_cfg) == "fp32" and run_precision(cpu_cfg, CUDA) == "bf16"
    assert run_shape(cpu_cfg).act_bytes == 4 and job_from_config(cpu_cfg).act_bytes == 4
    gpu_cfg = with_device_precision(cpu_cfg, CUDA)  # what a CUDA run plans with
    assert run_shape(gpu_cfg).act_bytes == 2 and job_from_config(gpu_cfg).act_bytes == 2
    ctx = SimpleNamespace(device=CPU)
    assert isinstance(autocast(cpu_cfg, ctx), contextlib.nullcontext)
    with autocast(_cfg("train.precision=bf16"), ctx):
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


@pytest.fixture
def strict_fp32():
    """fp32 matmuls in full fp32 for the test, the process's flags restored after (the
    TF32 switch is process-wide and would leak into later tests' tolerances)."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


def test_tf32_is_set_on_cuda_only(strict_fp32):
    use_tf32(CPU)
    assert torch.get_float32_matmul_precision() == "highest"
    use_tf32(CUDA)  # sets process-wide flags only: no device needed
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32


# ---------------------------------------------------------------------------
# MFU and peak memory

@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12), ("NVIDIA H100 80GB HBM3", "fp32", 494.5e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12), ("NVIDIA H200", "fp32", 494.5e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12), ("NVIDIA A100-PCIE-40GB", "fp32", 156e12),
    ("NVIDIA L40S", "bf16", 362e12), ("NVIDIA L4", "bf16", 121e12),  # L40S is not an L4
    ("Tesla V100-SXM2-16GB", "fp32", 15.7e12), ("Tesla V100-SXM2-16GB", "bf16", None),
    ("Some Future GPU", "bf16", None),
])
def test_peak_by_device_name_and_precision(name, precision, peak):
    assert peak_for(name, precision) == peak


def test_mfu_divides_by_the_peak_of_the_run_precision(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics.torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 PCIe")
    monkeypatch.setattr(metrics, "memory_gib",
                        lambda device: {"peak_mem_gib": 1.25, "reserved_mem_gib": 2.0})
    recs = {}
    for precision in ("bf16", "fp32"):
        log = MetricsLogger(str(tmp_path), True, 10, flops_per_token=1e9, world_size=2,
                            device=CUDA, precision=precision)
        recs[precision] = log.log(1, 2.0, 1e-3, 0.5, step_time=0.5, tokens=1000)
    # 1e9 FLOP/token x 2000 tokens/s over 2 devices = 1 TFLOP/s per device
    assert recs["bf16"]["tflops_per_device"] == pytest.approx(1.0)
    assert recs["bf16"]["mfu"] == pytest.approx(1e12 / 756e12)
    assert recs["fp32"]["mfu"] == pytest.approx(1e12 / 378e12)
    assert recs["fp32"]["peak_mem_gib"] == 1.25 and recs["fp32"]["reserved_mem_gib"] == 2.0
    assert peak_flops(CPU, "bf16") is None


def test_cpu_records_have_no_mfu_or_memory(tmp_path):
    rec = MetricsLogger(str(tmp_path), True, 10, 1e9, 1, CPU).log(1, 2.0, 1e-3, 0.5, 1.0, 100)
    assert "mfu" not in rec and "peak_mem_gib" not in rec and rec["tokens_per_s"] == 100



@pytest.mark.cuda
def test_peak_memory_counts_from_the_reset():
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.reset_peak_memory_stats()
    y = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    got = metrics.memory_gib(torch.device("cuda"))["peak_mem_gib"]
    assert 64 / 1024 <= got < 256 / 1024, got
    # The read resets the peak to what is allocated then (y), so the next read counts
    # from there: y's 64 MiB, not x's 256, however little is allocated after.
    del y
    again = metrics.memory_gib(torch.device("cuda"))["peak_mem_gib"]
    assert 64 / 1024 <= again < 256 / 1024, again
    z = torch.empty(16 * 2**20, dtype=torch.uint8, device="cuda")  # y freed at that reset
    assert 16 / 1024 <= metrics.memory_gib(torch.device("cuda"))["peak_mem_gib"] < 64 / 1024
    del z


# ---------------------------------------------------------------------------
# clipping: foreach norms, the norm left on the device

def test_weighted_squares_match_the_plain_sum():
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(n, generator=g) for n in (7, 5, 3))
    parts = [(a, 0.5), (b, 1.0), (c.view(1, 3).t(), 0.5)]  # strided views are measured too
    want = 0.5 * a.pow(2).sum() + b.pow(2).sum() + 0.5 * c.pow(2).sum()
    assert_close(weighted_squares(parts, CPU, torch.float32), want, rtol=1e-6, atol=0)
    got64 = weighted_squares(parts, CPU, torch.float64)
    assert got64.dtype == torch.float64 and math.isclose(got64, want.double(), rel_tol=1e-6)
    assert weighted_squares([], CPU, torch.float32) == 0


def _grads(seed=0):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    return model


def test_clip_leaves_the_norm_on_the_device_and_scales_the_gradients():
    model = _grads()
    before = [p.grad.clone() for p in model.parameters()]
    want = torch.sqrt(sum(g.pow(2).sum() for g in before))
    norm = clip_grads_norm(model, 0.5, None)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    assert_close(norm, want, rtol=1e-6, atol=0)
    scale = 0.5 / (float(want) + 1e-6)
    for p, g in zip(model.parameters(), before):
        assert_close(p.grad, g * scale, rtol=1e-6, atol=0)
    unclipped = _grads()
    assert clip_grads(unclipped, 0.0, None) == pytest.approx(float(want), rel=1e-6)
    assert_close(next(unclipped.parameters()).grad, before[0])  # max_norm 0: untouched


# ---------------------------------------------------------------------------
# grouped-query attention reaches a fused kernel

def _attention(device, dtype=torch.float32):
    cfg = _cfg("model.dropout=0", "model.seq_len=32").model  # 4 query heads, 2 kv heads
    model = build_model(cfg, cfg.vocab_size, seed=0, device=device).to(dtype)
    attn = model.layers[0].attn
    x = torch.randn(2, 32, cfg.d_model, generator=torch.Generator().manual_seed(1))
    return attn, x.to(device, dtype).requires_grad_()


def _run(attn, x):
    attn.zero_grad(set_to_none=True)
    x.grad = None
    y = attn.partial(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad.clone(), attn.qkv.weight.grad.clone()


def test_gqa_expanded_kv_matches_grouped_sdpa(monkeypatch):
    attn, x = _attention(CPU)
    assert attn.n_kv < attn.n_head
    grouped = _run(attn, x)
    monkeypatch.setattr(attention, "_fused_gqa", lambda *a: False)  # as where no kernel takes it
    expanded = _run(attn, x)
    for g, e in zip(grouped, expanded):
        assert_close(e, g, rtol=1e-5, atol=1e-6)


def test_gqa_on_cpu_runs_in_the_flash_kernel():
    attn, x = _attention(CPU)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # no math fallback allowed
        y, _, _ = _run(attn, x)
    assert torch.isfinite(y).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_on_cuda_runs_in_a_fused_kernel(dtype, strict_fp32):
    attn, x = _attention(CUDA, dtype)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.CUDNN_ATTENTION]
    with sdpa_kernel(fused):  # raises "No available kernel" where only math would do
        y, gx, gw = _run(attn, x)
    with sdpa_kernel([SDPBackend.MATH]):
        ry, rgx, rgw = _run(attn, x)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for got, ref in ((y, ry), (gx, rgx), (gw, rgw)):
        assert_close(got.float(), ref.float(), **tol)


@pytest.mark.cuda
def test_cuda_run_defaults(strict_fp32):
    cfg = with_device_precision(_cfg().freeze(), torch.device("cuda", 0))
    assert cfg.train.precision == "bf16"
    use_tf32(torch.device("cuda", 0))
    assert torch.backends.cuda.matmul.allow_tf32
    a = torch.randn(64, 64, device="cuda")
    assert_close(a @ a, (a.double() @ a.double()).float(), rtol=1e-2, atol=1e-2)
