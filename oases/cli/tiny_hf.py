"""A tiny Hugging Face Llama with a chat template, and toy conversations to fine-tune it on:
the starting point of docs/sft.md, made here, without network.

    python -m oases.cli.tiny_hf --out data/tiny-llama-chat --conversations data/chat.jsonl

``--out`` gets what a published instruction-tuned Llama 3 directory holds, at toy size:
``config.json`` and ``model.safetensors`` (``LlamaForCausalLM``: 2 layers, hidden 64, 4
heads, 2 KV heads, randomly initialised from ``--seed``), ``tokenizer.json``,
``tokenizer_config.json`` and ``chat_template.jinja`` (Llama 3's template), and
``generation_config.json`` (EOS ids ``<|end_of_text|>`` and ``<|eot_id|>``, as Llama 3
Instruct lists them). The tokenizer is byte-level without merges: id ``b`` is byte
``b``, then Llama 3's special tokens (:data:`SPECIALS`), ``<|begin_of_text|>`` added
in front of a text as Llama 3's ``tokenizer.json`` does; 261 ids in all.

``--conversations FILE`` writes ``--count`` jsonl rows of ``messages`` (OpenAI/HF form):
a user asks for a capital, a sum or a word spelt backwards, sometimes after a system
message, and the assistant answers in one short sentence; the same ``--seed`` gives the
same rows. Needs ``transformers``, ``tokenizers`` and ``safetensors`` (the hf and data
extras). An ``--out`` that is not empty is refused (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Optional

from oases.errors import EXIT_USER_ERROR, UserError

SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>")
BOS, EOS, EOT = SPECIALS[0], SPECIALS[1], SPECIALS[4]

# Meta's Llama 3 (8B) Instruct template, as its tokenizer_config.json has it
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}")

SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True)


def byte_tokenizer(specials=SPECIALS, bos: Optional[str] = BOS):
    """A ``tokenizers.Tokenizer``: id ``b`` is byte ``b`` (byte-level BPE without merges),
    then ``specials`` as special tokens; ``bos`` (one of them, or None) is put in front of
    a text when special tokens are added."""
    try:
        # deferred: optional packages (the data and hf extras), only for this command
        from tokenizers import (AddedToken, Tokenizer, decoders, models, pre_tokenizers,
                                processors)
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # deferred: as above
    except ImportError as e:
        raise UserError(f"the tiny HF directory needs 'tokenizers' and 'transformers' "
                        f"({e})") from None
    table = bytes_to_unicode()
    tok = Tokenizer(models.BPE({table[b]: b for b in range(256)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)])
    return tok


def make_tiny_llama(out: Path, seed: int = 0) -> Path:
    """Write the tiny Llama 3-style chat directory (module docstring) into ``out``."""
    try:
        import torch  # deferred: the command's --help needs no torch
        # deferred: the hf extra, only for this command
        from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM,
                                  PreTrainedTokenizerFast)
    except ImportError as e:
        raise UserError(f"the tiny HF directory needs 'transformers' ({e}): "
                        f"pip install transformers safetensors") from None
    tok = byte_tokenizer()
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        **SHAPE, vocab_size=tok.get_vocab_size(), bos_token_id=ids[BOS],
        eos_token_id=[ids[EOS], ids[EOT]]))
    model.generation_config = GenerationConfig(bos_token_id=ids[BOS],
                                               eos_token_id=[ids[EOS], ids[EOT]])
    model.save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT,
                            chat_template=LLAMA3_TEMPLATE).save_pretrained(out)
    if not (out / "chat_template.jinja").is_file():  # transformers 4 keeps it in the config
        (out / "chat_template.jinja").write_text(LLAMA3_TEMPLATE, encoding="utf-8")
    return out


CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo",
            "Cuba": "Havana", "Chile": "Santiago", "Greece": "Athens", "Poland": "Warsaw"}
SYSTEM = "You are a terse assistant."


def toy_conversations(count: int, seed: int = 0) -> list[dict]:
    """``count`` rows ``{"messages": [...]}`` (module docstring), the same for a seed."""
    rng = random.Random(seed)
    words = ["cat", "tree", "oases", "river", "lamp", "stone", "cloud", "bread"]
    rows = []
    for _ in range(count):
        kind = rng.randrange(3)
        if kind == 0:
            country = rng.choice(sorted(CAPITALS))
            q = f"What is the capital of {country}?"
            a = f"The capital of {country} is {CAPITALS[country]}."
        elif kind == 1:
            x, y = rng.randrange(10), rng.randrange(10)
            q, a = f"What is {x} plus {y}?", f"{x} plus {y} is {x + y}."
        else:
            w = rng.choice(words)
            q, a = f"Spell {w} backwards.", f"{w} backwards is {w[::-1]}."
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        rows.append({"messages": messages + [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oases.cli.tiny_hf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="new (or empty) directory")
    p.add_argument("--conversations", metavar="FILE.jsonl", help="also write toy conversations")
    p.add_argument("--count", type=int, default=600, metavar="N", help="conversations (600)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="weights and rows (0)")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise UserError(f"--out {out} exists and is not an empty directory")
        if args.count < 1:
            raise UserError(f"--count {args.count} must be >= 1")
        make_tiny_llama(out, args.seed)
        if args.conversations:
            conv = Path(args.conversations)
            conv.parent.mkdir(parents=True, exist_ok=True)
            conv.write_text("".join(json.dumps(r) + "\n"
                                    for r in toy_conversations(args.count, args.seed)))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(f"wrote a tiny Llama with a chat template to {out}"
          + (f" and {args.count} conversations to {args.conversations}"
             if args.conversations else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
