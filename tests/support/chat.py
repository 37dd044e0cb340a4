"""Chat data for the tests: tiny byte-level tokenizers with the chat templates of three
families (Llama 3, Qwen2, Qwen2 with ``{% generation %}`` marks), built in code, and
distinct conversations to prepare."""

from __future__ import annotations

import json
import random
from pathlib import Path

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
_QWEN_SYSTEM = ("{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
                "You are a helpful assistant.<|im_end|>\n{% endif %}")
QWEN2 = ("{% for m in messages %}" + _QWEN_SYSTEM + "<|im_start|>{{ m['role'] }}\n"
         "{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN2_GEN = ("{% for m in messages %}" + _QWEN_SYSTEM + "{% if m['role'] == 'assistant' %}"
             "<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>"
             "{% endgeneration %}{{ '\\n' }}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
             "<|im_end|>\n{% endif %}{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
FAMILIES = {  # template, eos, pad, bos, the end-of-turn text an assistant turn ends with
    "llama3": (LLAMA3, "<|eot_id|>", None, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2": (QWEN2, "<|im_end|>", "<|endoftext|>", None, "<|im_end|>"),
    "qwen2-gen": (QWEN2_GEN, "<|im_end|>", "<|endoftext|>", None, "<|im_end|>"),
}
WORDS = ["hello", "wörld", "café", "tokens", "a", "the", "packing", "mask", "ünïcode", "42"]


def make_tokenizer(path: Path, family: str) -> Path:
    """A byte-level BPE (no merges: one token per byte) with the family's specials and
    template, saved as an HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, eos, pad, bos, _ = FAMILIES[family]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos,
                            chat_template=template).save_pretrained(path)
    return path


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Distinct conversations: an optional system turn, one to three user/assistant
    exchanges of a few words (every one numbered, so no two render alike)."""
    rng = random.Random(seed)
    words = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    out = []
    for i in range(n):
        msgs = [{"role": "system", "content": f"system {i}"}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            msgs += [{"role": "user", "content": f"q{i} " + words(rng.randint(0, 4))},
                     {"role": "assistant", "content": words(rng.randint(1, 5)) + " "}]
        out.append(msgs)
    return out


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(path: Path):
    """The tokenizer :func:`make_tokenizer` saved, through transformers."""
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(path))
