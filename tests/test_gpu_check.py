"""The GPU check (benchmarks/gpu_check.py) on CPU: it says why it skips and writes
nothing; its pieces that need no GPU (the hidden-communication figure from a trace,
the micro-batch probe's search, the results file) give the right answers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_check import largest_fitting, main
from benchmarks.lib.gpu_env import environment, slug
from benchmarks.lib.gpu_report import lines
from benchmarks.lib.kernel_overlap import hidden_fraction, trace_hidden_fraction
from tests.support.runs import REPO, subprocess_env


def _k(name, ts, dur, dev=0):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"device": dev}}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path needs a machine "
                    "without CUDA")
def test_without_a_gpu_it_skips_with_the_reason_and_writes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(out)],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"torch {torch.__version__}" in proc.stdout
    assert "gpu-check: skipped: no CUDA device is visible" in proc.stdout
    assert not out.exists()
    # in this process main() sets CUDA_DEVICE_MAX_CONNECTIONS: gone again at teardown
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert main(["--out", str(out), "--skip-tests"]) == 0 and not out.exists()
    assert environment()["gpus"] == []


def test_hidden_fraction():
    events = [
        _k("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 0, 10),  # 5 of 10 us under the GEMM
        _k("sm90_xmma_gemm_bf16", 5, 10),
        _k("elementwise_kernel", 12, 4),                        # overlaps the GEMM: merged
        _k("ncclKernel_AllGather", 30, 4),                      # alone: nothing hidden
        _k("ncclDevKernel_AllReduce", 0, 10, dev=1),            # device 1: no compute there
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host events: ignored
    ]
    got = hidden_fraction(events)
    assert got["per_device"][0] == {"comm_us": 14.0, "hidden_us": 5.0, "compute_us": 11.0,
                                    "hidden": 5 / 14}
    assert got["per_device"][1]["hidden"] == 0.0
    assert got["hidden"] == pytest.approx(5 / 24)
    assert hidden_fraction([_k("gemm", 0, 5)])["hidden"] is None  # no communication


def test_hidden_fraction_reads_a_profiler_trace(tmp_path):
    """A real torch.profiler Chrome trace (CPU only: no kernels, so no figure) parses."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert trace_hidden_fraction(path) == {"comm_us": 0, "hidden_us": 0, "hidden": None,
                                           "per_device": {}}
    path.write_text(json.dumps({"traceEvents": [_k("nccl", 0, 2), _k("gemm", 1, 5)]}))
    assert trace_hidden_fraction(path)["hidden"] == 0.5


def test_kernel_busy_is_the_union_of_every_kernel():
    from benchmarks.lib.kernel_overlap import kernel_busy

    events = [_k("gemm", 0, 10), _k("nccl", 5, 10), _k("gemm", 30, 5, dev=1),
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    assert kernel_busy(events) == {"busy_us": 20.0, "kernels": 3}


def test_the_probe_keeps_the_last_micro_batch_that_fits():
    tried = []

    def fits(m):
        tried.append(m)
        return m <= 8
    assert largest_fitting(fits, [2, 4, 8, 16, 32]) == 8 and tried == [2, 4, 8, 16]
    assert largest_fitting(lambda m: False, [2, 4]) is None


def test_the_results_file():
    mode = {"step_s": 0.5, "tokens_per_s": 32768.0, "tflops": 400.0, "mfu": 0.4,
            "peak_mem_gib": 60.0, "predicted_mem_gib": 58.0, "vs_megatron": 0.98}
    res = {"command": "python -m benchmarks.gpu_check", "date": "2026-11-24", "seconds": 600,
           "environment": {"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.6}],
                           "driver": "570.1", "cuda": "12.8", "nccl": "2.27.3",
                           "torch": "2.13.0", "peak_bf16_flops": 989e12},
           "tests": {"command": "python -m pytest -m cuda tests", "seconds": 300,
                     "counts": {"passed": 20, "failed": 1},
                     "failures": ["FAILED tests/test_x.py::test_y"]},
           "one_gpu": [{"model": "gpt-1.3b", "micro_batch_size": 8, "modes": {"megatron": mode},
                        "largest_micro_batch": {"megatron": 16}},
                       {"model": "llama-1b", "error": "no micro-batch of 2 fits in any mode"}],
           "two_gpus": {"micro_batch_size": 8, "tokens_per_s": {"oases-fine": 50000.0,
                                                                "megatron-full": None},
                        "errors": {"megatron-full": "exit 1: see log"},
                        "traces": {"oases-fine": {"comm_us": 12000.0, "hidden": 0.8}}},
           "waits": {"blocking": {"iter_s": 1.2e-3, "wait_host_s": 1.05e-3, "compute_s": 2e-4},
                     "oases": {"iter_s": 2.1e-4, "wait_host_s": 4e-6, "compute_s": 2e-4},
                     "broken": {"error": "exit 1: see wait-2.log"}},
           "host": {"tp2-connections-1": {"modes": {
               "oases+fine+2": {"host_s": 0.031, "gpu_s": 0.030, "busy_s": 0.025,
                                "kernels": 4000, "host_us_per_block_sub_batch": 320.0,
                                "busy_us_per_block_sub_batch": 260.0, "host_bound": True},
               "megatron+full": {"error": "OutOfMemoryError: ..."}}},
               "tp8-connections-1": {"error": "skipped: the budget ran out"}}}
    text = "\n".join(lines(res))
    assert "| blocking | 1.200 | 1.050 | 0.200 |" in text and "| broken | exit 1" in text
    assert "| tp2-connections-1 | oases+fine+2 | 31.00 | 30.00 | 25.00 | 4000 | 320 | 260 | yes |" \
        in text
    assert "| tp2-connections-1 | megatron+full | OutOfMemoryError" in text
    assert "| tp8-connections-1 | skipped: the budget ran out |" in text
    assert "1 failed, 20 passed" in text and "- FAILED tests/test_x.py::test_y" in text
    assert "| gpt-1.3b | megatron | 8 | 500 | 32,768 | 400 | 40.0% | 0.980x | 60.0 | 58.0 | 16 |" \
        in text
    assert "| llama-1b | no micro-batch of 2 fits in any mode |" in text
    assert "| megatron-full | exit 1: see log |" in text
    assert "| oases-fine | 12.0 | 80.0% |" in text
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


@pytest.mark.slow  # the GPU check's host part, run whole
def test_the_host_part_runs_dry_on_the_cpu(tmp_path):
    """benchmarks/lib/gpu_host.py on two CPU ranks (gloo, TP collectives skipped): the code
    a GPU day runs, here with no kernels to count; its figures are what the report reads."""
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.lib.gpu_host", "--device", "cpu",
                           "--model", "gpt-tiny", "--tp", "2", "--mbs", "2", "--steps", "1",
                           "--warmup", "1", "--modes", "megatron+full", "oases+fine+2",
                           "--out", str(out)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["tp"] == 2 and set(got["modes"]) == {"megatron+full", "oases+fine+2"}
    for mode, m in got["modes"].items():
        assert "error" not in m, (mode, m)
        assert m["host_s"] > 0 and m["kernels"] == 0 and m["blocks"] == 9
    assert got["modes"]["oases+fine+2"]["sub_batches"] == 2
