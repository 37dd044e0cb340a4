"""Conversations through a chat template, rendered by ``transformers`` itself, so that
``oases generate --chat`` and ``AutoTokenizer.apply_chat_template`` of an exported
directory give the same ids.

    t = tokenizer.from_hf_dir(Path("tiny-llama-chat"))
    chat = Chat.of(t)                                  # or Chat.of(t, "template.jinja")
    chat.prompt_ids([{"role": "user", "content": "Hi"}])   # ... + the generation prompt
    chat.stop_ids                                       # the EOS ids + the end of a turn

The template is a file (``--chat-template``), else the one a run's chat corpus was
prepared with (:func:`oases.cli.tokenizer.recorded_chat_template`), else the tokenizer's
own (``chat_template.jinja`` or ``tokenizer_config.json`` of its directory:
:func:`oases.cli.tokenizer.chat_template_of`). It is rendered
by ``PreTrainedTokenizerFast.apply_chat_template`` with the ``bos_token`` and
``eos_token`` an export writes (:func:`oases.cli.tokenizer.hf_fast`), then tokenized
without adding special tokens (the template writes its own BOS), as transformers does.

The end of a turn is found by rendering a probe conversation (a user message, then an
assistant message holding :data:`PROBE`): the first token of what the template writes
after the assistant's content (``<|eot_id|>`` for Llama 3, ``<|im_end|>`` for Qwen2,
``eos_token`` for templates that close a turn with it) stops generation when it is a
special token; a template that writes nothing there, or plain text, adds no stop id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from oases.cli import tokenizer as toks
from oases.cli.prepare_chat_rows import message_list
from oases.errors import UserError

PROBE = "OASES_PROBE_REPLY"


def template_text(t: toks.Tok, path: Optional[str], recorded: Optional[str] = None) -> str:
    """The template in ``path`` (``--chat-template FILE``), else ``recorded`` (the one a
    run's chat corpus was prepared with), else the tokenizer's own."""
    if recorded is not None and not path:
        return recorded
    if path:
        try:
            return Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--chat-template {path} cannot be read: "
                            f"{getattr(e, 'strerror', None) or e}") from None
    if not t.chat_template:
        raise UserError(f"tokenizer {t.source} has no chat template (no chat_template.jinja "
                        f"or tokenizer_config.json chat_template beside it); pass "
                        f"--chat-template FILE")
    return t.chat_template


@dataclass
class Chat:
    """A tokenizer with a chat template; ``stop_ids`` ends an assistant's turn."""

    tok: toks.Tok
    template: str
    fast: object = field(repr=False)          # transformers.PreTrainedTokenizerFast
    stop_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, t: toks.Tok, path: Optional[str] = None,
           recorded: Optional[str] = None) -> "Chat":
        template = template_text(t, path, recorded)
        fast = toks.hf_fast(toks.Tok(t.tok, t.eos_id, t.bos_id, t.source,
                                     chat_template=template))
        chat = cls(t, template, fast)
        chat.stop_ids = t.eos_ids + [i for i in chat.end_of_turn_ids() if i not in t.eos_ids]
        return chat

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.fast.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        except Exception as e:  # jinja2's TemplateError, raise_exception's message, ...
            raise UserError(f"the chat template failed on {_brief(messages)}: "
                            f"{type(e).__name__}: {e}") from None

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` and the generation prompt (the assistant's header)."""
        text = self.render(messages, add_generation_prompt=True)
        return list(self.fast(text, add_special_tokens=False)["input_ids"])

    def end_of_turn_ids(self) -> list[int]:
        """The special token the template writes right after an assistant's content, as
        a list (empty: none; module docstring)."""
        text = self.render([{"role": "user", "content": "Hi"},
                            {"role": "assistant", "content": PROBE}], False)
        at = text.rfind(PROBE)
        if at < 0:
            raise UserError("the chat template does not write an assistant message's "
                            "content; pass --eos-id ID for the ids that end a reply")
        after = self.fast(text[at + len(PROBE):], add_special_tokens=False)["input_ids"]
        if not after:
            return []
        added = self.fast.added_tokens_decoder
        return [after[0]] if after[0] in added and added[after[0]].special else []


def _brief(messages: list[dict]) -> str:
    roles = ", ".join(str(m.get("role")) for m in messages[:6] if isinstance(m, dict))
    more = ", ..." if len(messages) > 6 else ""
    return f"a conversation of {len(messages)} messages ({roles}{more})"


@dataclass
class Conversation:
    messages: list[dict]                  # what the reply follows
    reference: Optional[str] = None       # the row's own final assistant reply, if any


def read_conversations(path: str) -> list[Conversation]:
    """``--conversations FILE``: jsonl rows of ``messages`` (a final assistant message is
    the reference reply: the model answers in its place) or of ``prompt`` (one user
    message); an unreadable file or a bad row is one error naming the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--conversations {path} cannot be read: "
                        f"{getattr(e, 'strerror', None) or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise UserError(f"{where}: not a JSON object ({e})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and "messages" not in row:
            out.append(Conversation([{"role": "user", "content": row["prompt"]}]))
            continue
        if not isinstance(row, dict) or "messages" not in row:
            raise UserError(f"{where}: a row needs 'messages' (or 'prompt')")
        messages = message_list(row["messages"], "messages", where)
        reference = None
        if messages[-1]["role"] == "assistant":
            reference = messages.pop()["content"]
        if not messages:
            raise UserError(f"{where}: nothing precedes the assistant's reply")
        out.append(Conversation(messages, reference))
    if not out:
        raise UserError(f"--conversations {path} holds no conversation")
    return out
