"""Every benchmark with a committed result still runs: ``make bench-smoke``.

Each case is the command a result's .md names, ``python -m benchmarks.<name>``, at a
smoke size (one to three rounds, a layer or two, a few steps), written to a temporary
``--out``; then ``--from-json`` on the JSON it wrote must write the same .md again, byte
for byte. Figures at these sizes are not results: a target may read FAIL.

Not part of ``make test``: the cases take ~11 minutes on 2 cores, and those on the emulated
cluster need root, ``ip`` and ``tc`` (they skip without them, with the reason). Run them
as root after a change to what a benchmark calls: ``sudo make bench-smoke``. The GPU
benchmarks (``gpu_check``, ``ring_cuda``) need CUDA and skip without it; the GPU check's
CPU path is ``tests/test_gpu_check.py``'s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.runs import REPO, describe

CLUSTER = "cluster"   # needs root, ip and tc
CUDA = "cuda"
WORK = ["--workdir", "{tmp}/work"]   # run directories: not the repository's runs/
TINY = ["d_model=64", "n_layer=1", "n_head=4", "seq_len=32", "micro_batch_size=2"]

# name -> (what it needs, its smoke-size arguments; "{tmp}": the test's temporary folder)
CASES: dict[str, tuple[str | None, list[str]]] = {
    "async_save": (None, ["--rounds", "1", "--set", "model.n_layer=1"]),
    "collectives": (CLUSTER, ["--repeats", "1", "--mib", "0.25"]),
    "comm_exposed": (CLUSTER, [*WORK, "--rounds", "1", "--steps", "3", "--warmup", "1",
                               "--model", *TINY]),
    "compile_block": (None, ["--rounds", "1", "--reps", "1", "--warmup", "1", "--seq", "64",
                             "--modes", "eager", "compiled"]),
    "cp_memory": (None, ["model.n_layer=1", "--seq", "256", "--cp", "1", "2"]),
    "cp_ring": (CLUSTER, [*WORK, "--rounds", "1", "--steps", "3", "--warmup", "1",
                          "--model", *TINY]),
    "generate_speed": (None, ["--rounds", "3", "--prompt", "4", "--new", "4"]),
    "host_bound": (None, ["--rounds", "3", "--steps", "4", "--warmup", "1"]),
    "host_overhead": (None, ["--rounds", "3", "--reps", "2", "--calls", "10"]),
    "init_scaling": (None, ["--model", "gpt-tiny", "--cases", "0:1", "1:2", "--repeats", "1"]),
    "overlap": (CLUSTER, [*WORK, "--quick", "--steps", "3", "--warmup", "1",
                          "--modes", "megatron+full", "oases+fine", "--model", *TINY]),
    "pipeline": (CLUSTER, [*WORK, "--quick", "--steps", "3", "--warmup", "1",
                           "--clusters", "configs/cluster/hetero-4.yaml",
                           "--modes", "oases+fine+1f1b", "reshard:eager-1f1b", "pp4:zb-h1",
                           "--model", "d_model=64", "n_layer=4", "n_head=4", "seq_len=32",
                           "micro_batch_size=4"]),
    "plan_search": (None, ["--repeats", "1", "--budget", "1", "--max-exhaustive-s", "5"]),
    "planner": (CLUSTER, [*WORK, "--repeats", "1", "--random", "1", "--steps", "3",
                          "--warmup", "1", "--clusters", "configs/cluster/two-nodes-1g.yaml",
                          "--n-layer", "2", "--d-model", "64", "--n-head", "4",
                          "--seq-len", "32"]),
    "planner_layouts": (CLUSTER, [*WORK, "--quick", "--random", "1", "--steps", "3",
                                  "--warmup", "1", "--n-layer", "2", "--d-model", "64",
                                  "--n-head", "4", "--seq-len", "32"]),
    "prepare_scale": (None, ["--gb", "0.005", "--workers", "2", "--dir", "{tmp}/scale"]),
    "reshard": (CLUSTER, [*WORK, "--quick"]),
    "sp_memory": (None, ["--tp", "2", "--micro-batch-size", "2", "model.n_layer=1"]),
    "tp1_overhead": (None, ["--rounds", "3", "--steps", "2", "--warmup", "1"]),
    "wire_bytes": (None, ["model.n_layer=2"]),
    "zero": (CLUSTER, [*WORK, "--rounds", "1", "--steps", "3", "--warmup", "1", "--modes",
                       "megatron+z0", "oases+z3", "megatron+z2+bf16", "--model", *TINY]),
    "zero_ckpt_memory": (None, ["--quick"]),
    "zero_secondary": (CLUSTER, [*WORK, "--rounds", "1", "--steps", "3", "--warmup", "1",
                                 "--model", *TINY]),
    "gpu_check": (CUDA, ["--budget-s", "120", "--skip-tests"]),
    "ring_cuda": (CUDA, ["--seq", "1024"]),
}


def missing(need: str | None) -> str | None:
    """Why a case cannot run here, or None."""
    if need == CLUSTER:
        if os.geteuid() != 0:
            return "the emulated cluster needs root (sudo make bench-smoke)"
        if not (shutil.which("ip") and shutil.which("tc")):
            return "the emulated cluster needs iproute2 (ip, tc)"
    if need == CUDA and not torch.cuda.is_available():
        return "needs a CUDA device"
    return None


def bench(name: str, *args: str, timeout: float = 540) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, describe(proc)
    return proc


@pytest.mark.bench
@pytest.mark.parametrize("name", list(CASES))
def test_benchmark_runs_and_rerenders(name, tmp_path):
    need, args = CASES[name]
    why = missing(need)
    if why:
        pytest.skip(why)
    out = tmp_path / name
    bench(name, *(a.replace("{tmp}", str(tmp_path)) for a in args), "--out", str(out))
    written = out.with_suffix(".json")
    if out.is_dir():  # gpu_check: --out is a folder that gets gpu-<device>.json and .md
        written = min(out.glob("gpu-*.json"), default=written)
    assert written.is_file(), f"{name} wrote no {written.name}"
    report = written.with_suffix(".md").read_text()
    again = tmp_path / "again" / name
    again.parent.mkdir()
    bench(name, "--from-json", str(written), "--out", str(again))
    assert again.with_suffix(".md").read_text() == report, \
        f"{name}: --from-json wrote another report than the run"


def test_every_benchmark_has_a_smoke_case():
    """Part of ``make test``: a new benchmark script gets a case here."""
    scripts = {p.stem for p in (REPO / "benchmarks").glob("*.py")} - {"__init__", "timeline"}
    assert scripts == set(CASES), (f"without a smoke case: {sorted(scripts - set(CASES))}; "
                                   f"no such benchmark: {sorted(set(CASES) - scripts)}")
