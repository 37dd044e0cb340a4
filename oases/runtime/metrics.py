"""Metrics from one rank: console line, ``<out_dir>/metrics.jsonl`` and W&B.

Throughput definitions (per optimizer step):
    tokens/s            = global batch tokens / step time
    TFLOP/s per device  = flops_per_token x tokens/s / world size
    MFU                 = TFLOP/s per device / the device's dense peak at the run's
                          precision: bf16 tensor cores for bf16, TF32 tensor cores for
                          fp32 (the run sets fp32 matmuls to TF32 on CUDA); reported
                          only for devices whose peak is known
    peak_mem_gib        = the most memory allocated on any rank since the first step
                          (CUDA only)
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

# Dense (no sparsity) tensor-core peaks in FLOP/s by device name and the run's precision
# (vendor datasheets): "bf16" with fp32 accumulation, "fp32" as TF32. A key is matched as
# a part of torch.cuda.get_device_name ("NVIDIA H100 80GB HBM3" is the SXM part). V100
# has neither bf16 nor TF32 tensor cores: its fp32 figure is the plain fp32 peak.
PEAK_FLOPS = {
    "H100 SXM": {"bf16": 989e12, "fp32": 494.5e12},
    "H100 PCIe": {"bf16": 756e12, "fp32": 378e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 417.5e12},
    "H100": {"bf16": 989e12, "fp32": 494.5e12},
    "H200": {"bf16": 989e12, "fp32": 494.5e12},
    "H800": {"bf16": 989e12, "fp32": 494.5e12},
    "A100": {"bf16": 312e12, "fp32": 156e12},
    "A800": {"bf16": 312e12, "fp32": 156e12},
    "A10G": {"bf16": 70e12, "fp32": 35e12},
    "L40S": {"bf16": 362e12, "fp32": 183e12},
    "L4": {"bf16": 121e12, "fp32": 60e12},
    "RTX 4090": {"bf16": 165e12, "fp32": 82.6e12},
    "RTX 3090": {"bf16": 71e12, "fp32": 35.6e12},
    "V100": {"fp32": 15.7e12},
}


def peak_for(name: str, precision: str) -> Optional[float]:
    """The dense peak of the device called ``name`` at ``precision`` ("bf16", "fp32"), or
    None where the table does not know it. The longest matching key wins ("H100 PCIe"
    before "H100", "L40S" before "L4")."""
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_FLOPS[key].get(precision)
    return None


def peak_flops(device: torch.device, precision: str = "bf16") -> Optional[float]:
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device), precision)


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` of any rank (collective over the world, if there is one)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def peak_memory_gib(device: torch.device) -> Optional[float]:
    """The most memory allocated on any rank since the last reset, GiB; None off CUDA
    (every rank then skips the reduction alike: the device type is the run's). A
    collective on CUDA: every rank asks at the same steps."""
    if device.type != "cuda":
        return None
    return max_over_ranks(float(torch.cuda.max_memory_allocated(device)), device) / 2**30


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class MetricsLogger:
    def __init__(self, out_dir: str, is_main: bool, total_steps: int, flops_per_token: float,
                 world_size: int, device: torch.device, wandb_cfg=None, run_config: Optional[dict] = None,
                 resume: bool = False, precision: str = "fp32") -> None:
        self.is_main = is_main
        self.total = total_steps
        self.flops_per_token = flops_per_token
        self.world = world_size
        self.device = device
        self.peak = peak_flops(device, precision)  # the resolved train.precision
        self.path = Path(out_dir) / "metrics.jsonl"
        self.wandb = None
        if not is_main:
            return
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            self.wandb = _init_wandb(wandb_cfg, out_dir, run_config, resume)

    def log(self, step: int, loss: float, lr: float, grad_norm: float, step_time: float,
            tokens: int, extra: Optional[dict] = None, step_times_left: Optional[float] = None) -> dict:
        """Record optimizer step ``step`` (1-based); returns the record. Every rank calls
        it at the same steps: on CUDA the peak memory is a maximum over the ranks."""
        tps = tokens / step_time
        rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tps, "tokens_per_s_per_device": tps / self.world,
               "tflops_per_device": self.flops_per_token * tps / self.world / 1e12,
               "step_time_s": step_time}
        if self.peak:
            rec["mfu"] = rec["tflops_per_device"] * 1e12 / self.peak
        mem = peak_memory_gib(self.device)
        if mem is not None:
            rec["peak_mem_gib"] = mem
        if extra:
            rec.update(extra)
        if not self.is_main:
            return rec
        eta = (step_times_left if step_times_left is not None
               else step_time * (self.total - step))
        parts = [f"step {step}/{self.total}", f"loss {loss:.4f}", f"lr {lr:.2e}",
                 f"gnorm {grad_norm:.3f}", f"tok/s {tps:,.0f}", f"tok/s/dev {tps / self.world:,.0f}",
                 f"TFLOP/s/dev {rec['tflops_per_device']:.3f}"]
        if "mfu" in rec:
            parts.append(f"MFU {100 * rec['mfu']:.1f}%")
        if "peak_mem_gib" in rec:
            parts.append(f"mem {rec['peak_mem_gib']:.2f}GiB")
        if "pipeline_bubble" in rec:
            parts.append(f"bubble {100 * rec['pipeline_bubble']:.0f}%")
        parts.append(f"ETA {_fmt_time(eta)}")
        print(" | ".join(parts), flush=True)
        self._write(rec)
        return rec

    def log_eval(self, step: int, val_loss: float) -> None:
        if not self.is_main:
            return
        print(f"step {step}/{self.total} | val_loss {val_loss:.4f} "
              f"| val_ppl {math.exp(min(val_loss, 50)):.2f}", flush=True)
        self._write({"step": step, "val_loss": val_loss})

    def _write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in rec.items() if k != "step"}, step=rec["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _init_wandb(cfg, out_dir: str, run_config: Optional[dict], resume: bool):
    import wandb  # deferred: seconds to import; rank 0 with W&B on only

    os.environ.setdefault("WANDB_SILENT", "true")
    run_id_file = Path(out_dir) / "wandb_run_id"
    run_id = run_id_file.read_text().strip() if resume and run_id_file.exists() else None
    run = wandb.init(project=cfg.project, name=cfg.name or Path(out_dir).name, mode=cfg.mode,
                     dir=out_dir, config=run_config, id=run_id,
                     resume="allow" if run_id else None)
    run_id_file.write_text(run.id)
    return run
