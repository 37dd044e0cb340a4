"""Write a checkpoint's model as one file of full (unsharded) tensors.

    python -m oases.consolidate runs/gpt-tiny --out model.pt                  # the latest checkpoint
    python -m oases.consolidate runs/gpt-tiny/checkpoints/step_000200 --out model.pt

The output is a ``torch.save``'d ``{parameter name: tensor}`` dict with oases'
parameter names (``embed.wte.weight``, ``layers.0.attn.qkv.weight``, ...): fused
parts (QKV, gate+up) reassembled, vocabulary padding removed (the embedding and
an untied head have exactly ``vocab_size`` rows), whatever the (dp, tp) layout
the checkpoint was written with. It loads with ``model.load_state_dict`` into an
unsharded model built with ``padded_vocab = vocab_size``:

    model = build_model(cfg.model, cfg.model.vocab_size, seed=None)
    model.load_state_dict(torch.load("model.pt"))

Needs no process group and no torchrun. Optimizer state is not written. A
missing, partial or corrupt checkpoint is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from oases.errors import EXIT_USER_ERROR, UserError
from oases.progress import io_progress, nbytes
from oases.runtime import checkpoint as ckpt
from oases.runtime.checkpoint import num_elements


def consolidate(path: str | Path, out: str | Path) -> tuple[Path, dict]:
    """Write the full model tensors of the checkpoint at ``path`` (a checkpoint or a run
    directory) to ``out``; returns (the checkpoint used, the state dict)."""

    src = ckpt.resolve_checkpoint(path)
    state = ckpt.full_model_state(src)
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name such as {out}/model.pt")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with io_progress(f"writing {out.name}", nbytes(state.values()), "write"):
            torch.save(state, tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    return src, state


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oases.consolidate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a checkpoint directory, or a run directory (its latest checkpoint)")
    p.add_argument("--out", required=True, help="output file (torch.save of a state dict)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = p.parse_args(argv)
    try:
        src, state = consolidate(args.path, args.out)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(f"wrote {args.out}: {len(state)} tensors, {num_elements(state) / 1e6:.2f}M parameters "
          f"from {src}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
