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

Needs no process group and no torchrun. Optimizer state is not written. It streams:
one full tensor is in memory at a time (the peak is about the largest tensor plus
DCP's read of one saved chunk), so a model larger than the machine's memory
consolidates. A missing, partial or corrupt checkpoint is one line on stderr and
exit status 2; ``--out`` is written as ``<out>.tmp`` and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from oases.errors import EXIT_USER_ERROR, CheckpointError, UserError
from oases.progress import io_progress
from oases.runtime import checkpoint as ckpt


def _skeleton(path: Path) -> dict:
    """Every output tensor as a FakeTensor (shape and dtype, no storage), in name order."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # deferred: consolidate only

    meta, names = ckpt.model_keys(path)
    with FakeTensorMode():
        return {n: torch.empty(shape, dtype=dtype) for n, keys in names.items()
                for shape, dtype in [ckpt.full_shape(meta, n, keys)]}


def write_streaming(src: Path, tmp: Path) -> tuple[int, int]:
    """Write ``src``'s full model tensors to ``tmp`` in ``torch.save``'s format, one tensor
    in memory at a time: ``torch.save`` writes the file with every storage's bytes left
    empty (``skip_data``), then each tensor is read from the checkpoint and written at
    its record's offset. Returns (tensors, elements)."""
    skel = _skeleton(src)
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(skel, tmp)
    reader = torch._C.PyTorchFileReader(str(tmp))
    records = [r for r in reader.get_all_records() if r.startswith("data/")]
    if len(records) != len(skel):
        raise RuntimeError(f"{tmp}: {len(records)} storages for {len(skel)} tensors")
    total = sum(t.numel() * t.element_size() for t in skel.values())
    with open(tmp, "r+b") as f, io_progress(f"writing {tmp.name}", total, "write"):
        # torch.save numbers the storages in the order it pickles them: the dict's
        for i, (name, t) in enumerate(ckpt.iter_model_tensors(src)):
            if tuple(t.shape) != tuple(skel[name].shape):
                raise RuntimeError(f"{name}: read {tuple(t.shape)}, "
                                   f"expected {tuple(skel[name].shape)}")
            f.seek(reader.get_record_offset(f"data/{i}"))
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)  # no copy
    return len(skel), sum(t.numel() for t in skel.values())


def consolidate(path: str | Path, out: str | Path) -> tuple[Path, int, int]:
    """Write the full model tensors of the checkpoint at ``path`` (a checkpoint or a run
    directory) to ``out``; returns (the checkpoint used, tensors, elements)."""

    src = ckpt.resolve_checkpoint(path)
    out = Path(out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name such as {out}/model.pt")
    tmp = out.with_name(out.name + ".tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended
            warnings.simplefilter("ignore", UserWarning)
            n, elements = write_streaming(src, tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror or e}") from None
    except CheckpointError:
        tmp.unlink(missing_ok=True)
        raise
    return src, n, elements


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oases.consolidate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a checkpoint directory, or a run directory (its latest checkpoint)")
    p.add_argument("--out", required=True, help="output file (torch.save of a state dict)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = p.parse_args(argv)
    try:
        src, n, elements = consolidate(args.path, args.out)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(f"wrote {args.out}: {n} tensors, {elements / 1e6:.2f}M parameters from {src}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
