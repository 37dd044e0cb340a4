"""Export an oases checkpoint as a Hugging Face model directory.

    python -m oases.export runs/gpt-tiny --to-hf out/gpt-tiny-hf             # the run's latest
    python -m oases.export runs/gpt-tiny/checkpoints/step_000200 --to-hf out/hf

writes ``config.json`` and ``model.safetensors`` that ``AutoModelForCausalLM.from_pretrained(out)``
loads, and the tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``: :mod:`oases.cli.tokenizer`) that ``AutoTokenizer`` loads: the
one ``oases.prepare`` recorded for the run's corpus (its sha256 checked), or
``--tokenizer PATH``; with the tokenizer's chat template (or ``--chat-template FILE``) in
``chat_template.jinja`` and ``tokenizer_config.json``, and the end of an assistant's turn
(:mod:`oases.cli.chat`) among the EOS ids of ``generation_config.json`` and
``config.json``, so that ``apply_chat_template`` and ``generate`` stop a reply where
``oases generate --chat`` does. It reads the DCP checkpoint in one
process, without a process group, whatever the layout and ZeRO level it was saved
with, one tensor at a time (``oases.runtime.checkpoint.iter_model_tensors``: fused
QKV / gate-up parts reassembled, vocabulary padding removed; optimizer state is not
read): the safetensors header is written first, then each Hugging Face tensor at its
offset, so the peak is about the largest tensor. The model (shape, RoPE, norm eps,
...) is the checkpoint's own, as its ``meta.json`` records it; a checkpoint older than
that record takes its shape from ``meta.json`` and the rest from the run's
``config.yaml`` (in the parent of ``checkpoints/``).

Bad input is one line on stderr and exit status 2; a non-empty ``--to-hf``
directory is refused rather than overwritten, and a destination that cannot be created
or written (no permission, a full disk) is one line too, the directory left as it was
(absent, or empty).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch

from oases.config.hf import hf_config_dict
from oases.models.hf import hf_layout, hf_tensors, model_fields
from oases.cli import tokenizer as toks
from oases.cli.chat import Chat
from oases.errors import EXIT_USER_ERROR, UserError
from oases.progress import io_progress
from oases.runtime import checkpoint as ckpt
from oases.runtime.generate import checkpoint_model_config

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64"}


def _write_safetensors(ck: Path, mc, path: Path, cast: Optional[torch.dtype] = None) -> None:
    """``model.safetensors`` of the checkpoint, streamed: the header from the shapes,
    then each tensor's bytes at its offset (missing GPT biases stay zero); ``cast``:
    every tensor in that dtype (None: the checkpoint's, fp32 masters in every mode)."""
    layout, shapes = hf_layout(model_fields(mc))
    meta, names = ckpt.model_keys(ck)
    extra = sorted(set(names) - set(layout))
    if extra:
        raise UserError(f"export: tensor {extra[0]} has no Hugging Face name "
                        f"(tie_embeddings={mc.tie_embeddings}, bias={mc.bias})")
    missing = sorted(set(layout) - set(names))
    if missing:
        raise UserError(f"export: the checkpoint has no tensor {missing[0]}")
    dtype = {q.hf: ckpt.full_shape(meta, n, names[n])[1] for n, ps in layout.items() for q in ps}
    header, off = {}, 0
    for hf in sorted(shapes):
        dt = cast or dtype.get(hf, torch.float32)
        n = math.prod(shapes[hf]) * dt.itemsize
        header[hf] = {"dtype": _DTYPES[dt], "shape": list(shapes[hf]),
                      "data_offsets": [off, off + n]}
        off += n
    head = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":"))
    head += " " * (-len(head) % 8)
    start = 8 + len(head)
    with open(path, "wb") as f, io_progress("writing model.safetensors", off, "write"):
        f.write(len(head).to_bytes(8, "little") + head.encode())
        f.truncate(start + off)  # zeros: the GPT biases a bias=false model does not have
        for name, t in ckpt.iter_model_tensors(ck):
            for hf, h in hf_tensors(name, t, layout[name]).items():
                if list(h.shape) != header[hf]["shape"]:
                    raise UserError(f"export: {hf} would have shape {list(h.shape)}, "
                                    f"expected {header[hf]['shape']}")
                f.seek(start + header[hf]["data_offsets"][0])
                h = h if cast is None else h.to(cast)
                f.write(h.contiguous().view(-1).view(torch.uint8).numpy().data)  # no copy


def _tokenizer(ck: Path, choice: Optional[str]):
    """(tokenizer or None, a line saying why none) for ``--tokenizer``: none, a path, or
    (None) the one recorded for the run's corpus."""
    if choice == "none":
        return None, "no tokenizer written (--tokenizer none)"
    if choice:
        return toks.from_path(choice), ""
    t = toks.recorded(ck.parent.parent)
    if t is None:
        return None, ("no tokenizer written: the run's data records none (synthetic or "
                      "unprepared tokens); pass --tokenizer PATH to add one")
    return t, ""


def _clear(out: Path, made: bool) -> None:
    """Leave ``out`` as it was before a failed export: empty, or absent."""
    for p in out.iterdir():
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    if made:
        out.rmdir()


def _with_chat(tok, chat_template: Optional[str], run_dir: Path):
    """``tok`` with the chat template of ``--chat-template``, else the one the run's chat
    corpus was prepared with, else its own, and the end of an assistant's turn among its
    EOS ids (where it has a template)."""
    if chat_template and tok is None:
        raise UserError("--chat-template needs a tokenizer to write it with (not "
                        "--tokenizer none)")
    recorded = None if tok is None or chat_template else toks.recorded_chat_template(run_dir)
    if tok is None or not (chat_template or recorded or tok.chat_template):
        return tok
    chat = Chat.of(tok, chat_template, recorded)
    tok.chat_template = chat.template
    tok.more_eos = tuple(tok.more_eos) + tuple(i for i in chat.stop_ids if i not in tok.more_eos)
    return tok


def export_checkpoint(src: str | Path, out_dir: str | Path,
                      tokenizer: Optional[str] = None,
                      chat_template: Optional[str] = None,
                      dtype: str = "fp32") -> tuple[Path, str]:
    """Write the HF directory ``out_dir`` for the checkpoint ``src``; returns (the
    checkpoint, a note when no tokenizer was written). ``chat_template``: a template
    file to write instead of the tokenizer's own; ``dtype``: the weights' ("fp32", the
    checkpoint's own, or "bf16")."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--to-hf {out} exists and is not an empty directory; refusing to "
                        f"overwrite it")
    ck = ckpt.resolve_checkpoint(src)
    meta = ckpt.read_meta(ck)
    mc = checkpoint_model_config(ck, meta)
    tok, note = _tokenizer(ck, tokenizer)
    tok = _with_chat(tok, chat_template, ck.parent.parent)
    if tok is not None:
        toks.check_fits(tok, mc.vocab_size)
    cfg_json = hf_config_dict(mc)
    cfg_json["torch_dtype"] = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    if tok is not None:
        cfg_json.update(bos_token_id=tok.bos_id, eos_token_id=toks.eos_json(tok))
    made = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
        why = f"{blocker} is a file, not a directory" if blocker else e.strerror or e
        raise UserError(f"--to-hf {out} cannot be created: {why}") from None
    try:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended
            warnings.simplefilter("ignore", UserWarning)
            _write_safetensors(ck, mc, out / "model.safetensors.tmp",
                               torch.bfloat16 if dtype == "bf16" else None)
        if tok is not None:
            toks.write_hf_files(tok, out, mc.vocab_size, mc.seq_len)
        (out / "config.json.tmp").write_text(json.dumps(cfg_json, indent=2) + "\n")
        os.replace(out / "model.safetensors.tmp", out / "model.safetensors")
        os.replace(out / "config.json.tmp", out / "config.json")
    except OSError as e:  # the checkpoint's reads raise CheckpointError: this is a write
        _clear(out, made)
        raise UserError(f"cannot write --to-hf {out}: {e.strerror or e}") from None
    except BaseException:
        _clear(out, made)
        raise
    return ck, note


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oases.export",
                                description="Export an oases checkpoint as a Hugging Face model.")
    p.add_argument("checkpoint", help="checkpoints/step_N directory, or a run directory "
                                      "(uses checkpoints/latest)")
    p.add_argument("--to-hf", required=True, metavar="OUT_DIR",
                   help="new (or empty) directory for config.json, model.safetensors and "
                        "the tokenizer files")
    p.add_argument("--tokenizer", metavar="none|bytes|PATH",
                   help="the tokenizer to write (a tokenizer.json, a directory holding one, a "
                        "tiktoken file, bytes); default: the one oases.prepare recorded for "
                        "the run's data; none: the weights alone")
    p.add_argument("--chat-template", metavar="FILE",
                   help="the chat template to write (default: the tokenizer's own, if any)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the weights' dtype (default fp32: the checkpoint's master weights, "
                        "whatever train.precision was)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    args = p.parse_args(argv)
    try:
        ck, note = export_checkpoint(args.checkpoint, args.to_hf, args.tokenizer,
                                     args.chat_template, args.dtype)
    except UserError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if note:
        print(note, flush=True)
    print(f"exported {ck} to {args.to_hf} (Hugging Face format)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
