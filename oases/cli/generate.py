"""Generate text with an oases checkpoint or a Hugging Face directory, at any TP degree.

    python -m oases.generate runs/my-run --prompt "The meaning of" --max-new-tokens 32
    python -m oases.generate --hf out/my-run-hf --prompt "a" --prompt "bc" --temperature 0.8
    torchrun --standalone --nproc_per_node 2 -m oases.generate runs/my-run --prompt "x"
    python -m oases.generate runs/my-run --ids 1,2,3 --json
    python -m oases.generate runs/my-sft --chat --prompt "Hi" --conversations chats.jsonl

The prompts are encoded with the run's tokenizer (the one ``oases.prepare`` recorded for
its corpus, the HF directory's ``tokenizer.json``, or ``--tokenizer``); with ``--ids``
they are token ids. With ``--chat`` each ``--prompt`` is a user message and each row of
``--conversations`` a conversation, rendered with the tokenizer's chat template (or
``--chat-template FILE``) and the assistant's header (:mod:`oases.cli.chat`); a reply
stops at the template's end of turn, and the replies alone are printed. Under torchrun
the model is split over TP = the world size, each rank loading its shard; rank 0
prints. Decoding, the KV cache and sampling are :mod:`oases.runtime.generate`'s. Bad
input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from oases.cli import tokenizer as toks
from oases.cli.chat import Chat, Conversation, read_conversations
from oases.cli.train import report
from oases.errors import EXIT_USER_ERROR, UserError
from oases.parallel.groups import ParallelContext, init_distributed, pick_device
from oases.progress import progress, rank
from oases.runtime import checkpoint as ckpt
from oases.runtime.generate import Sampling, generate, model_from_checkpoint, model_from_hf


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UserError(f"--ids {text!r} is not a comma-separated list of token ids") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oases.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", help="a run directory (its latest checkpoint) or "
                                                 "a checkpoints/step_N directory")
    p.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory instead")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for a batch)")
    p.add_argument("--ids", action="append", default=[], metavar="1,2,3",
                   help="a prompt as token ids (repeat for a batch)")
    p.add_argument("--chat", action="store_true",
                   help="apply the chat template: each --prompt is a user message; the "
                        "replies stop at the template's end of turn")
    p.add_argument("--conversations", metavar="FILE.jsonl",
                   help="with --chat: jsonl rows of 'messages' (a final assistant message "
                        "is the reference, answered anew) or of 'prompt'")
    p.add_argument("--chat-template", metavar="FILE",
                   help="with --chat: this Jinja template instead of the tokenizer's")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 (default): off")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1 (default): off")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    p.add_argument("--tokenizer", metavar="none|bytes|PATH",
                   help="tokenizer (default: the run's recorded one or the HF directory's)")
    p.add_argument("--eos-id", type=int, action="append", metavar="ID",
                   help="stop a row at this id; repeat for several, the first pads (default: "
                        "the tokenizer's or the HF directory's EOS ids; -1: never)")
    p.add_argument("--tp", type=int, metavar="N", help="TP degree (default: the world size)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--no-cache", action="store_true",
                   help="recompute the whole sequence at each step (no KV cache)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", action="store_true", help="show tracebacks for bad input")
    return p


def _tokenizer(args) -> Optional[toks.Tok]:
    eos = args.eos_id[0] if args.eos_id and args.eos_id[0] >= 0 else None
    if args.tokenizer == "none":
        return None
    if args.tokenizer:
        return toks.from_path(args.tokenizer, eos)
    if args.hf:
        return toks.from_hf_dir(Path(args.hf), eos)
    return toks.recorded(ckpt.resolve_checkpoint(args.checkpoint).parent.parent)


def _chat(args, tok: Optional[toks.Tok]) -> tuple[Optional[Chat], list[Conversation]]:
    """(the chat template with its stop ids, the conversations) under ``--chat``."""
    if not args.chat:
        if args.conversations or args.chat_template:
            raise UserError("--conversations and --chat-template need --chat")
        return None, []
    if args.ids:
        raise UserError("--chat takes --prompt TEXT or --conversations FILE, not --ids")
    if tok is None:
        raise UserError("--chat needs a tokenizer (its chat template renders the "
                        "conversation): pass --tokenizer PATH")
    convs = [Conversation([{"role": "user", "content": p}]) for p in args.prompt]
    if args.conversations:
        convs += read_conversations(args.conversations)
    if not convs:
        raise UserError("--chat needs --prompt TEXT or --conversations FILE")
    recorded = None if args.hf or args.chat_template else toks.recorded_chat_template(
        ckpt.resolve_checkpoint(args.checkpoint).parent.parent)
    return Chat.of(tok, args.chat_template, recorded), convs


def _context(args) -> ParallelContext:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp = args.tp or world
    if tp != world:
        raise UserError(f"--tp {tp} must equal the world size {world} (start one process per "
                        f"TP rank: torchrun --nproc_per_node {tp})")
    if world == 1:
        return ParallelContext.single(pick_device(args.device))
    return init_distributed(tp, args.device)


def run(args) -> dict:
    """Generate as ``args`` say; returns the JSON record (every rank; rank 0 prints)."""
    if (args.checkpoint is None) == (args.hf is None):
        raise UserError("give a checkpoint (a run directory or checkpoints/step_N) or --hf "
                        "DIR, not both")
    if args.prompt and args.ids:
        raise UserError("give --prompt or --ids, not both")
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    tok = _tokenizer(args)
    if args.prompt and tok is None:
        whose = ("--tokenizer none" if args.tokenizer == "none" else
                 f"{args.hf} has no tokenizer.json" if args.hf else "the run's data records none")
        raise UserError(f"no tokenizer to encode --prompt: {whose}; pass --tokenizer PATH, "
                        f"or --ids")
    chat, convs = _chat(args, tok)
    if chat is not None:
        prompts = [chat.prompt_ids(c.messages) for c in convs]
    elif args.prompt:
        prompts = [tok.encode(t) for t in args.prompt]
    else:
        prompts = [_ids(t) for t in args.ids]
    if args.eos_id:
        eos = [] if args.eos_id == [-1] else args.eos_id
    elif chat is not None:
        eos = chat.stop_ids
    else:
        eos = tok.eos_ids if tok is not None else toks.hf_eos(Path(args.hf)) if args.hf else []
    ctx = _context(args)
    if args.hf:
        model, cfg = model_from_hf(args.hf, ctx)
    else:
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended
            warnings.simplefilter("ignore", UserWarning)
            model, cfg, _ = model_from_checkpoint(args.checkpoint, ctx)
    with progress(total=args.max_new_tokens, desc="generating", unit="token") as bar:
        out = generate(model, prompts, args.max_new_tokens, sampling, eos, ctx=ctx,
                       cache=not args.no_cache, on_step=bar.update)
    rows = []
    for n, (p, ids) in enumerate(zip(prompts, out.rows())):
        row = {"prompt_ids": p, "ids": ids, "finished": any(i in eos for i in ids)}
        if tok is not None:  # the continuation alone, and decoded with its prompt
            row["text"], row["full_text"] = tok.decode(ids), tok.decode(p + ids)
        if chat is not None:
            row["messages"] = convs[n].messages
            if convs[n].reference is not None:
                row["reference"] = convs[n].reference
        rows.append(row)
    return {"chat": chat is not None, "outputs": rows, "new_tokens": sum(out.lengths),
            "seconds": round(out.seconds, 4), "tokens_per_s": round(out.tokens_per_s, 2),
            "batch": len(prompts), "tp": ctx.tp, "device": ctx.device.type,
            "kv_cache": not args.no_cache}


def _print(rec: dict, as_json: bool, ids_only: bool) -> None:
    if as_json:
        print(json.dumps(rec), flush=True)
        return
    for i, row in enumerate(rec["outputs"]):
        if i:
            print("---")
        if ids_only or "text" not in row:
            print(",".join(map(str, row["ids"])))
        else:  # a chat reply alone: the conversation it answers is the input
            print(row["text"] if rec["chat"] else row["full_text"])
    print(f"generated {rec['new_tokens']} tokens in {rec['seconds']:.2f} s: "
          f"{rec['tokens_per_s']:.1f} tokens/s (batch {rec['batch']}, tp {rec['tp']}, "
          f"{rec['device']})", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        rec = run(args)
    except UserError as e:
        if args.debug:
            raise
        report("error", e, alike=True)
        return EXIT_USER_ERROR
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank() == 0:
        _print(rec, args.json, bool(args.ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
