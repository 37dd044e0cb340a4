"""Tiny configs: the override lists several test files train with, and one builder.

    tiny_config("train.steps=2", world=2, tp=2, schedule="oases", recompute="fine")

is ``load_config(None, [model.name=gpt-tiny, data.kind=synthetic, parallel.tp=2,
parallel.schedule=oases, parallel.recompute=fine, train.steps=2]).validate(2)``. A test
whose config is its own (the settings its tolerances were derived for) spells it out.
"""

from __future__ import annotations

from oases.config import load_config

# A short run with a metrics record every step and nothing on the side (no eval, no W&B).
TINY_RUN = ["model.name=gpt-tiny", "model.seq_len=64", "data.kind=synthetic", "eval.interval=0",
            "wandb.mode=disabled", "train.log_interval=1", "train.micro_batch_size=2"]

# A 4-step run checkpointed at steps 2 and 4: what the resume and reshard tests restart.
# vocab_size=300 pads differently at tp 1, 2 and 4 (320, 384, 512 rows).
CKPT_STEPS = 4
CKPT_RUN = ["model.name=gpt-tiny", "model.vocab_size=300", "model.seq_len=64",
            "data.kind=synthetic", f"train.steps={CKPT_STEPS}", "train.lr=3e-3",
            "train.warmup_steps=2", "train.log_interval=1", "checkpoint.interval=2",
            "checkpoint.keep=2", "eval.interval=0", "wandb.mode=disabled", "seed=7"]

# Two pipeline stages of different shapes (tp 1 x dp 2, then tp 2) on 4 ranks of gpt-tiny:
# the tied embedding is sharded a different way on each.
MIXED_STAGES = [{"layers": [0, 2], "dp": 2, "tp": 1}, {"layers": [2, 4], "dp": 1, "tp": 2}]

# keyword -> config key of tiny_config's shortcuts
KEYS = {"name": "model.name", "n_layer": "model.n_layer", "seq_len": "model.seq_len",
        "dropout": "model.dropout", "tp": "parallel.tp", "pp": "parallel.pp",
        "zero": "parallel.zero", "schedule": "parallel.schedule",
        "recompute": "parallel.recompute", "mbs": "train.micro_batch_size",
        "grad_accum": "train.grad_accum", "steps": "train.steps"}


def tiny_overrides(*overrides: str, synthetic: bool = True, **keys) -> list[str]:
    """gpt-tiny (``name=``) with the ``keys`` shortcuts (:data:`KEYS`), then ``overrides``."""
    unknown = set(keys) - set(KEYS)
    if unknown:
        raise TypeError(f"tiny_overrides: unknown settings {sorted(unknown)}; "
                        f"known: {sorted(KEYS)}")
    out = [f"model.name={keys.pop('name', 'gpt-tiny')}"]
    if synthetic:
        out.append("data.kind=synthetic")
    out += [f"{KEYS[k]}={v}" for k, v in keys.items()]
    return [*out, *overrides]


def tiny_config(*overrides: str, world: int = 1, synthetic: bool = True, **keys):
    """The validated config of :func:`tiny_overrides` for a world of ``world`` ranks."""
    return load_config(None, tiny_overrides(*overrides, synthetic=synthetic, **keys)
                       ).validate(world)
