"""The CUDA tier: the parallel paths on real GPUs and NCCL, against one GPU.

On CPU every test here skips with a reason (the ``cuda`` marker, tests/conftest.py);
the CPU suite checks the same orderings under NCCL's rules emulated on gloo
(tests/support/distributed.py). Here each layout trains 3 steps through ``torchrun
train.py`` on 2 GPUs and its losses must equal those of the same global batch on
one GPU. fp32 with TF32 off (``NVIDIA_TF32_OVERRIDE=0``), dropout 0: the sharded
runs differ from the reference by float32 rounding in another summation order
(~1e-6 relative over a few steps); rtol 1e-4. A dropped micro-batch, a wrong stage
or a mis-scaled gradient moves the loss by far more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.runs import run_single, run_train
from tests.support.torchrun_procs import metrics

pytestmark = pytest.mark.slow

# each the same global batch (8 sequences per step) as the one-GPU reference
CASES = {
    "tp2-megatron": ["parallel.tp=2", "parallel.schedule=megatron", "train.micro_batch_size=4",
                     "train.grad_accum=2"],
    "tp2-oases": ["parallel.tp=2", "parallel.schedule=oases", "parallel.recompute=fine",
                  "train.micro_batch_size=4", "train.grad_accum=2"],
    "dp2-zero2": ["parallel.tp=1", "parallel.zero=2", "train.micro_batch_size=2",
                  "train.grad_accum=2"],
    "dp2-zero3": ["parallel.tp=1", "parallel.zero=3", "train.micro_batch_size=2",
                  "train.grad_accum=2"],
    "pp2-1f1b": ["parallel.tp=1", "parallel.pp=2", "parallel.pp_schedule=1f1b",
                 "train.micro_batch_size=4", "train.grad_accum=2"],
    "pp2-gpipe": ["parallel.tp=1", "parallel.pp=2", "parallel.pp_schedule=gpipe",
                  "train.micro_batch_size=4", "train.grad_accum=2"],
    "pp2-eager-overlap_fb": ["parallel.tp=1", "parallel.pp=2", "parallel.pp_schedule=eager-1f1b",
                             "parallel.schedule=oases", "parallel.overlap_fb=true",
                             "train.micro_batch_size=2", "train.grad_accum=4"],
}

ENV = {"NVIDIA_TF32_OVERRIDE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _args(out: Path, data_args: list[str], *extra: str) -> list[str]:
    return ["--config", "configs/gpt-tiny.yaml", f"out_dir={out}", "train.steps=3",
            "train.log_interval=1", "eval.interval=0", "wandb.mode=disabled",
            "parallel.device=cuda", "train.precision=fp32", "model.dropout=0", *data_args,
            *extra]


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in metrics(out) if "loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_args) -> list[float]:
    out = tmp_path_factory.mktemp("nccl") / "ref"
    run_single(_args(out, data_args, "parallel.tp=1", "train.micro_batch_size=4",
                     "train.grad_accum=2"), expect_rc=0, env=ENV)
    return _losses(out)


@pytest.mark.cuda(gpus=2)
@pytest.mark.parametrize("name", list(CASES))
def test_two_gpus_match_one(name, reference, tmp_path, data_args):
    out = tmp_path / name
    run_train(_args(out, data_args, *CASES[name]), nproc=2, env=ENV)
    got = _losses(out)
    assert len(got) == len(reference) == 3
    for s, (a, b) in enumerate(zip(got, reference)):
        assert abs(a - b) <= 1e-4 * abs(b), f"{name}: step {s + 1} loss {a} vs one GPU {b}"


def test_every_case_has_the_references_global_batch():
    """Runs on CPU: a case whose global batch differs from the reference's would fail
    on GPUs for a reason that is not NCCL's."""
    def global_batch(args, world=2):
        kv = dict(a.split("=", 1) for a in args)
        dp = world // (int(kv.get("parallel.tp", 1)) * int(kv.get("parallel.pp", 1)))
        return dp * int(kv["train.micro_batch_size"]) * int(kv["train.grad_accum"])
    ref = global_batch(["train.micro_batch_size=4", "train.grad_accum=2"], world=1)
    assert {name: global_batch(a) for name, a in CASES.items()} == {n: ref for n in CASES}


@pytest.mark.cuda(gpus=1)
def test_one_gpu_defaults_to_bf16_and_trains(tmp_path, data_args):
    out = tmp_path / "bf16"
    args = [a for a in _args(out, data_args) if a != "train.precision=fp32"]
    proc = run_single([*args, "train.steps=20", "parallel.tp=1"], expect_rc=0)
    assert "bf16" in proc.stdout
    assert "precision: bf16" in (out / "config.yaml").read_text()
    losses = _losses(out)
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.cuda(gpus=2)
@pytest.mark.parametrize("schedule", ["megatron", "oases"])
def test_cuda_observability(schedule, tmp_path, data_args):
    """On NCCL: the exposed TP time from CUDA events, the profiler trace with CUDA
    activity, its view on the device's clock (labels' device ranges, NCCL kernels) and
    the memory snapshot."""
    out = tmp_path / schedule
    run_train(_args(out, data_args, "parallel.tp=2", f"parallel.schedule={schedule}",
                    "parallel.recompute=" + ("fine" if schedule == "oases" else "full"),
                    "profile.steps=[2,2]", "profile.memory_snapshot=true",
                    "parallel.trace=true"), nproc=2, env=ENV)
    recs = [r for r in metrics(out) if "loss" in r]
    assert recs and all(0.0 <= r["tp_comm_exposed_s"] < r["step_time_s"] for r in recs)
    assert all(r["peak_mem_gib"] > 0 for r in recs)
    for k in (0, 1):
        raw = json.loads((out / "profile" / f"rank{k}.json").read_text())["traceEvents"]
        assert any(e.get("cat") == "kernel" and "nccl" in e["name"].lower() for e in raw)
        view = json.loads((out / f"trace_rank{k}.json").read_text())["traceEvents"]
        names = {e["tid"]: set() for e in view}
        for e in view:
            names[e["tid"]].add(e["name"])
        assert names.keys() == {"compute", "comm"}, k
        want = {"Fa P1", "Ba 1"} if schedule == "oases" else {"F 1", "B 1", "backward"}
        assert want <= names["compute"], k
        assert all(e["dur"] > 0 for e in view if e["name"] in want), k
        assert (out / "profile" / f"memory_rank{k}.pickle").stat().st_size > 0
