"""The names of what a run logs: flat in ``metrics.jsonl``, grouped on W&B and TensorBoard.

Each flat ``metrics.jsonl`` name maps one to one to a grouped key (``train/``,
``perf/``, ``mem/``, ``eval/``); the dashboard (``python -m oases.dashboard``) and
the docs (docs/observability.md) read this table, so a panel names a key the run logs.
Imports nothing heavy: the dashboard command uses it without torch.
"""

from __future__ import annotations

# flat metrics.jsonl name -> grouped W&B / TensorBoard key
GROUPED = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "skipped_steps": "train/skipped_steps",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_device": "perf/tokens_per_s_per_device",
    "tflops_per_device": "perf/tflops_per_device",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "pipeline_bubble": "perf/pipeline_bubble",
    "tp_comm_s": "perf/tp_comm_s",
    "tp_comm_exposed_s": "perf/tp_comm_exposed_s",
    "tp_comm_hidden_frac": "perf/tp_comm_hidden_frac",
    "zero_gather_wait_s": "perf/zero_gather_wait_s",
    "cp_ring_wait_s": "perf/cp_ring_wait_s",
    "peak_mem_gib": "mem/peak_allocated_gib_max",
    "reserved_mem_gib": "mem/reserved_gib_max",
    "val_loss": "eval/loss",
    "val_ppl": "eval/ppl",
}

# each group's own x-axis (W&B define_metric step_metric) and summary
STEP_KEYS = {"train": "train/step", "perf": "perf/step", "mem": "mem/step", "eval": "eval/step"}
SUMMARY = {"train/loss": "min", "eval/loss": "min", "eval/ppl": "min",
           "perf/tokens_per_s": "max", "perf/mfu": "max", "perf/tflops_per_device": "max",
           "mem/peak_allocated_gib_max": "max", "mem/reserved_gib_max": "max"}


def step_key(key: str) -> str:
    """The step key of a grouped key's group (``perf/mfu`` -> ``perf/step``)."""
    return STEP_KEYS[key.split("/", 1)[0]]


def values(rec: dict) -> dict:
    """A ``metrics.jsonl`` record's values as grouped keys (names outside the table and
    None values left out)."""
    return {GROUPED[k]: v for k, v in rec.items() if k in GROUPED and v is not None}


def grouped(rec: dict) -> dict:
    """:func:`values`, with each group's step key set to the record's ``step``."""
    out = values(rec)
    out.update({step_key(k): rec["step"] for k in list(out)})
    return out
