"""Metrics from one rank: console line, ``<out_dir>/metrics.jsonl`` and W&B.

Throughput definitions (per optimizer step):
    tokens/s            = global batch tokens / step time
    TFLOP/s per device  = flops_per_token x tokens/s / world size
    MFU                 = TFLOP/s per device / the device's dense peak at the run's
                          precision: bf16 tensor cores for bf16, TF32 tensor cores for
                          fp32 (the run sets fp32 matmuls to TF32 on CUDA); reported
                          only for devices whose peak is known
    peak_mem_gib        = the most memory allocated on any rank during the interval (CUDA
                          only; the peaks are reset after start-up and at each log step);
                          reserved_mem_gib likewise for the caching allocator's reserve
    tp_comm_exposed_s   = the most seconds any rank waited on TP collectives in the
                          interval's last step, the one the clock times
                          (oases.overlap.comm_clock); tp_comm_s their whole time;
                          tp_comm_hidden_frac the smallest hidden share of any rank

Throughput and step time are means over the log interval's steps.
``metrics.jsonl`` keeps these flat names; W&B and TensorBoard get them grouped, one to
one (oases.runtime.metric_keys).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from oases.overlap.comm_clock import hidden_fraction
from oases.runtime.sinks import TensorBoardSink, open_wandb, require_tensorboard

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
            return PEAK_FLOPS[key].get("bf16" if precision.startswith("bf16") else precision)
    return None


def peak_flops(device: torch.device, precision: str = "bf16") -> Optional[float]:
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device), precision)


def max_each(values: list[float], device: torch.device) -> list[float]:
    """Each entry's maximum over the ranks: one all-reduce over the world (when there
    is one), so every rank calls it at the same point with as many values."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def memory_gib(device: torch.device) -> dict:
    """This rank's peak allocated and reserved memory since the last call (or the reset
    after start-up), GiB, then resets the peaks; empty off CUDA."""
    if device.type != "cuda":
        return {}
    got = {"peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30,
           "reserved_mem_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    torch.cuda.reset_peak_memory_stats(device)
    return got


_NONE = -1.0  # a figure this rank does not have (no CUDA memory, no TP communication)


def ranks_max(mem: dict, comm: Optional[tuple[float, float]], device: torch.device) -> dict:
    """The memory and TP communication figures of the interval, each the maximum over the
    ranks (one collective: every rank calls it at each log step). ``comm``: this rank's
    (exposed, total) seconds per step, None where it has no TP collectives. The hidden
    fraction is the worst rank's (the smallest)."""
    frac = hidden_fraction(*comm) if comm is not None and comm[1] is not None else None
    vals = [mem.get("peak_mem_gib", _NONE), mem.get("reserved_mem_gib", _NONE),
            comm[0] if comm else _NONE,
            comm[1] if comm and comm[1] is not None else _NONE,
            1.0 - frac if frac is not None else _NONE]
    alloc, reserved, exposed, total, unhidden = max_each(vals, device)
    out = {}
    if alloc != _NONE:
        out.update(peak_mem_gib=alloc, reserved_mem_gib=reserved)
    if exposed != _NONE:
        out["tp_comm_exposed_s"] = exposed
    if total != _NONE:  # on CUDA only the exposed time is measured (CommClock.per_step)
        out["tp_comm_s"] = total
    if unhidden != _NONE:
        out["tp_comm_hidden_frac"] = 1.0 - unhidden
    return out


def _fmt_time(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class MetricsLogger:
    """The run's metrics: console line and ``metrics.jsonl`` (flat names) on rank 0, and
    the grouped keys (:mod:`oases.runtime.metric_keys`) on W&B and TensorBoard
    (:mod:`oases.runtime.sinks`). Every rank builds one and calls :meth:`log` at the same
    steps (the figures of the interval are maxima over the ranks)."""

    def __init__(self, out_dir: str, is_main: bool, total_steps: int, flops_per_token: float,
                 world_size: int, device: torch.device, wandb_cfg=None, run_config: Optional[dict] = None,
                 resume: bool = False, precision: str = "fp32", tensorboard: bool = False,
                 start_step: int = 0, group: str = "") -> None:
        self.is_main = is_main
        self.total = total_steps
        self.flops_per_token = flops_per_token
        self.world = world_size
        self.device = device
        self.peak = peak_flops(device, precision)  # the resolved train.precision
        self.path = Path(out_dir) / "metrics.jsonl"
        self.sinks: list = []
        if tensorboard:  # every rank: a missing package fails alike everywhere
            require_tensorboard()
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":  # every rank: see open_wandb
            wandb = open_wandb(wandb_cfg, out_dir, run_config, resume, group, is_main, device)
            self.sinks += [wandb] if wandb is not None else []
        if not is_main:
            return
        if tensorboard:
            self.sinks.append(TensorBoardSink(out_dir, start_step if resume else 0))

    def log(self, step: int, loss: float, lr: float, grad_norm: float, step_time: float,
            tokens: int, extra: Optional[dict] = None, step_times_left: Optional[float] = None,
            comm: Optional[tuple[float, float]] = None) -> dict:
        """Record optimizer step ``step`` (1-based); returns the record. ``step_time``: the
        mean step time of the interval since the last log, so throughput is the
        interval's (tokens of its steps / their time); ``comm``: this rank's exposed and
        total TP communication seconds per step of the interval (None: it has no TP
        collectives). Every rank calls it at the same steps (:func:`ranks_max`)."""
        tps = tokens / step_time
        rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
               "tokens_per_s": tps, "tokens_per_s_per_device": tps / self.world,
               "tflops_per_device": self.flops_per_token * tps / self.world / 1e12,
               "step_time_s": step_time}
        if self.peak:
            rec["mfu"] = rec["tflops_per_device"] * 1e12 / self.peak
        rec.update(ranks_max(memory_gib(self.device), comm, self.device))
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
        if "tp_comm_hidden_frac" in rec:
            parts.append(f"TP comm hidden {100 * rec['tp_comm_hidden_frac']:.0f}%")
        if "pipeline_bubble" in rec:
            parts.append(f"bubble {100 * rec['pipeline_bubble']:.0f}%")
        parts.append(f"ETA {_fmt_time(eta)}")
        print(" | ".join(parts), flush=True)
        self._write(rec)
        return rec

    def log_eval(self, step: int, val_loss: float) -> None:
        if not self.is_main:
            return
        ppl = math.exp(min(val_loss, 50))
        print(f"step {step}/{self.total} | val_loss {val_loss:.4f} | val_ppl {ppl:.2f}",
              flush=True)
        self._write({"step": step, "val_loss": val_loss, "val_ppl": ppl})

    def _write(self, rec: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        for sink in self.sinks:
            sink.log(rec)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
