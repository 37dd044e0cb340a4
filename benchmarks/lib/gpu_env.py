"""The GPU check's first two parts: what this machine is, and the cuda-marked tests.

:func:`environment` names the GPUs and the driver, CUDA, NCCL and torch versions, and
the dense peaks the MFU figures divide by (``oases.runtime.metrics.peak_for``);
:func:`run_cuda_tests` runs ``pytest -m cuda tests`` and reads its summary.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from oases.runtime.metrics import peak_for

REPO = Path(__file__).resolve().parents[2]


def _driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def environment() -> dict:
    """This machine as the check sees it (no CUDA device: ``gpus`` is empty)."""
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "cuda": torch.version.cuda, "host": platform.node(), "gpus": []}
    if not torch.cuda.is_available():
        return env
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        env["gpus"].append({"name": p.name, "memory_gib": p.total_memory / 2**30,
                            "capability": f"{p.major}.{p.minor}"})
    name = env["gpus"][0]["name"] if env["gpus"] else ""
    env["driver"] = _driver()
    try:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError):
        env["nccl"] = None
    env["peak_bf16_flops"] = peak_for(name, "bf16")
    env["peak_fp32_flops"] = peak_for(name, "fp32")
    env["launch_us"] = launch_us(torch.device("cuda", 0))
    return env


def launch_us(device: torch.device, n: int = 2000) -> dict:
    """The host's microseconds to issue one tiny kernel (an add into a 16-element tensor)
    and one small bf16 matmul (8 x 256 by 256 x 256): what every op of a step costs the
    host before the GPU sees it, whatever its size (medians of 3 runs of ``n``)."""
    a, b = torch.ones(16, device=device), torch.ones(16, device=device)
    c = torch.empty(16, device=device)
    x = torch.ones(8, 256, device=device, dtype=torch.bfloat16)
    w = torch.ones(256, 256, device=device, dtype=torch.bfloat16)
    out = {}
    for name, op in (("add", lambda: torch.add(a, b, out=c)),
                     ("linear_bf16", lambda: torch.nn.functional.linear(x, w))):
        runs = []
        for _ in range(3):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(n):
                op()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize(device)
        out[name] = sorted(runs)[1]
    return out


def launch_line(us: dict) -> str:
    return (f"host: {us['add']:.1f} us to issue a tiny kernel, {us['linear_bf16']:.1f} us a "
            f"small bf16 matmul")


def describe(env: dict) -> list[str]:
    """Console lines for :func:`environment`'s answer."""
    lines = [f"torch {env['torch']} (CUDA {env['cuda'] or 'none: a CPU build'}), "
             f"python {env['python']}"]
    if not env["gpus"]:
        return lines
    names = sorted({g["name"] for g in env["gpus"]})
    lines.append(f"{len(env['gpus'])} GPU(s): {', '.join(names)}, "
                 f"{env['gpus'][0]['memory_gib']:.1f} GiB each; driver {env['driver'] or '?'}, "
                 f"NCCL {env['nccl'] or '?'}")
    if env.get("launch_us"):
        lines.append(launch_line(env["launch_us"]))
    peak = env["peak_bf16_flops"]
    lines.append("assumed dense bf16 peak: " + (f"{peak / 1e12:.0f} TFLOP/s" if peak else
                 "unknown for this GPU (MFU not reported; add it to "
                 "oases/runtime/metrics.py PEAK_FLOPS)"))
    return lines


def slug(name: str) -> str:
    """A file-name form of a GPU's name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def run_cuda_tests(timeout_s: float = 1200.0) -> dict:
    """``pytest -m cuda tests`` in the repository: status, counts and the output's tail.
    Tests needing more GPUs than this machine has skip with that reason."""
    # a test module whose optional imports this machine lacks must not hide the others
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
           "--continue-on-collection-errors", "tests"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        out, rc = out + f"\ntimed out after {timeout_s:.0f} s", None
    counts = {k: int(n) for n, k in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|deselected)", out.splitlines()[-1] if out else "")}
    return {"command": " ".join(["python", *cmd[1:]]), "returncode": rc,
            "seconds": time.monotonic() - t0, "counts": counts,
            "failures": [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))],
            "tail": out[-3000:]}
