"""Export an oases checkpoint as a Hugging Face model directory.

    python -m oases.export runs/gpt-tiny --to-hf out/gpt-tiny-hf             # the run's latest
    python -m oases.export runs/gpt-tiny/checkpoints/step_000200 --to-hf out/hf

writes ``config.json`` and ``model.safetensors`` that ``GPT2LMHeadModel`` /
``LlamaForCausalLM.from_pretrained(out)`` load. It reads the DCP checkpoint in one
process, without a process group, whatever the TP/DP layout it was saved with
(``oases.runtime.checkpoint.full_model_state``: fused QKV / gate-up parts
reassembled, vocabulary padding removed; optimizer state is not read). The model
shape comes from the checkpoint's ``meta.json``, the rest (norm eps, rope theta)
from the run's ``config.yaml`` (in the parent of ``checkpoints/``).

Bad input is one line on stderr and exit status 2; a non-empty ``--to-hf``
directory is refused rather than overwritten.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Optional

import yaml

from models.hf import export_hf
from oases.config import ModelConfig
from oases.config.typed_yaml import build_dataclass
from oases.errors import EXIT_USER_ERROR, CheckpointError, UserError
from oases.progress import io_progress, nbytes
from oases.runtime import checkpoint as ckpt


def _model_config(ck: Path, meta: dict):
    """The run's ModelConfig: shape from meta.json, the other fields from config.yaml."""

    run_cfg = ck.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise CheckpointError(f"no config.yaml of the run next to {ck.parent} (needed for "
                              f"norm_eps and rope_theta)")
    try:
        data = dict((yaml.safe_load(run_cfg.read_text()) or {}).get("model") or {})
    except (yaml.YAMLError, AttributeError, TypeError, ValueError):
        raise CheckpointError(f"{run_cfg} is not a valid run config") from None
    data["init_from"] = ""  # the weights come from the checkpoint, not from HF
    mc = build_dataclass(ModelConfig, data, "model.")
    shape = meta.get("model_shape") or {}
    for k, v in shape.items():
        setattr(mc, k, v)
    mc.resolve()
    mc.validate()
    return mc


def export_checkpoint(src: str | Path, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--to-hf {out} exists and is not an empty directory; refusing to "
                        f"overwrite it")
    ck = ckpt.resolve_checkpoint(src)
    meta = ckpt.read_meta(ck)
    mc = _model_config(ck, meta)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended
        warnings.simplefilter("ignore", UserWarning)
        state = ckpt.full_model_state(ck)
    with io_progress("writing model.safetensors", nbytes(state.values()), "write"):
        export_hf(state, mc, out)
    return ck


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oases.export",
                                description="Export an oases checkpoint as a Hugging Face model.")
    p.add_argument("checkpoint", help="checkpoints/step_N directory, or a run directory "
                                      "(uses checkpoints/latest)")
    p.add_argument("--to-hf", required=True, metavar="OUT_DIR",
                   help="new (or empty) directory for config.json + model.safetensors")
    p.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    args = p.parse_args(argv)
    try:
        ck = export_checkpoint(args.checkpoint, args.to_hf)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(f"exported {ck} to {args.to_hf} (Hugging Face format)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
