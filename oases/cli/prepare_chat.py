"""``python -m oases.prepare --chat``: conversations into packed rows of token ids, with a
per-token flags file beside each token shard (:mod:`oases.runtime.tokens`: which tokens
count as targets, where each document starts, which are padding).

    python -m oases.prepare --chat --input chats.jsonl --tokenizer hf_dir/ --seq-len 2048 --out data/sft

**Template.** Each conversation is rendered by the tokenizer's own chat template
(``chat_template.jinja`` or ``tokenizer_config.json``'s ``chat_template`` in the
``--tokenizer`` directory), or ``--chat-template FILE``, through transformers'
``apply_chat_template``, and tokenized as it tokenizes (no special tokens added beyond
what the template writes). **Loss mask.** Where the template marks the assistant's
tokens with ``{% generation %}``, they are transformers' ``assistant_masks``. Otherwise
the conversation is rendered prefix by prefix: the tokens assistant message ``i`` adds
(from the end of ``messages[:i]`` with the generation prompt to the end of
``messages[:i+1]``, less the whitespace the template writes after the end-of-turn
token) count; the assistant header does not. A template whose prefixes are not the
start of the whole rendering (one that rewrites earlier turns) is refused for that
conversation.

**Packing.** First fit in input order: a conversation goes into the first of the open
rows (at most :data:`OPEN_ROWS`, oldest closed first) with room for it; a full row, or
the oldest when one too many are open, is padded to ``--seq-len`` and written. A
split is N rows of T tokens and one final pad token, so training window ``w``
(``tokens[w*T : w*T+T+1]``) is row ``w`` and its targets. Padding is its own document
and never counts. A conversation longer than ``--seq-len`` is truncated to it, or
dropped (``--overlong``); a truncated one left with no counted target is dropped too.
Conversations go to val as prepare's documents do (``--val-fraction``, ``--val-docs``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from oases.cli.prepare_chat_rows import Conversation, conversations
from oases.cli.prepare_encode import resolve_tokenizer
from oases.cli.prepare_sources import Input
from oases.cli.prepare_write import SPLITS, Router, ShardWriter, Staging, check_out
from oases.errors import DataError, first_line
from oases.progress import progress
from oases.runtime.tokens import FLAG_COUNTS, FLAG_PAD, FLAG_START, FLAGS_DTYPE, np_dtype

# Open rows first fit considers: enough that short conversations fill the gaps of long
# ones, few enough that placing a conversation stays cheap.
OPEN_ROWS = 64
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass
class ChatTokenizer:
    """A transformers tokenizer and the chat template it renders with."""
    tok: object
    template: str
    source: str            # where the template came from
    generation: bool       # the template marks assistant tokens with {% generation %}

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    @property
    def masking(self) -> str:
        return "generation" if self.generation else "prefixes"

    def _render(self, messages: list[dict], prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, chat_template=self.template,
                                            tokenize=False, add_generation_prompt=prompt)

    def encode(self, conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's token ids and whether each is an assistant token."""
        try:
            if self.generation:
                out = self.tok.apply_chat_template(
                    conv.messages, chat_template=self.template, tokenize=True,
                    return_dict=True, return_assistant_tokens_mask=True)
                return (np.asarray(out["input_ids"], np.int64),
                        np.asarray(out["assistant_masks"], bool))
            text = self._render(conv.messages)
            spans = [self._span(conv, i, text) for i, m in enumerate(conv.messages)
                     if m["role"] == "assistant"]
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja's and the template's own errors
            raise DataError(f"{conv.where}: the chat template ({self.source}) cannot render "
                            f"the conversation: {first_line(e)}") from None
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return np.asarray(enc["input_ids"], np.int64), _in_spans(enc["offset_mapping"], spans)

    def _span(self, conv: Conversation, i: int, text: str) -> tuple[int, int]:
        """The characters assistant message ``i`` adds to the rendering ``text``."""
        head = self._render(conv.messages[:i], prompt=True)
        upto = self._render(conv.messages[:i + 1])
        if not (text.startswith(head) and text.startswith(upto) and len(upto) >= len(head)):
            raise DataError(f"{conv.where}: the chat template ({self.source}) renders "
                            f"messages[:{i + 1}] as other than the start of the whole "
                            f"conversation, so the tokens of assistant message {i} are not "
                            f"known; use a template with {{% generation %}} marks")
        return len(head), max(len(head), len(upto.rstrip()))


def _in_spans(offsets, spans: list[tuple[int, int]]) -> np.ndarray:
    """Tokens overlapping a character span (as transformers' ``assistant_masks``)."""
    off = np.asarray(offsets, np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), bool)
    for a, b in spans:
        mask |= (off[:, 1] > a) & (off[:, 0] < b)
    return mask


def load_chat_tokenizer(name: str, template_path: Optional[str]) -> ChatTokenizer:
    """``--tokenizer`` (an HF tokenizer directory or tokenizer.json) and its template
    (``--chat-template FILE``, else the directory's)."""
    try:
        from transformers import PreTrainedTokenizerFast  # deferred: slow import, --chat only
    except ImportError:
        raise DataError("--chat needs the 'transformers' package: pip install transformers"
                        ) from None
    p = Path(name)
    try:
        if p.is_dir():
            tok = PreTrainedTokenizerFast.from_pretrained(str(p), local_files_only=True)
        elif p.is_file():
            tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
        else:
            raise DataError(f"--tokenizer {name} is not an HF tokenizer directory or "
                            f"tokenizer.json (--chat renders with transformers)")
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad dir
        raise DataError(f"--tokenizer {name} cannot be loaded by transformers: "
                        f"{first_line(e)}") from None
    if template_path is not None:
        try:
            template = Path(template_path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--chat-template {template_path} cannot be read: {e}") from None
        source = str(Path(template_path).resolve())
    else:
        template = tok.chat_template
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
        if not isinstance(template, str) or not template:
            raise DataError(f"--tokenizer {name} has no chat template (tokenizer_config.json's "
                            f"chat_template, chat_template.jinja); pass --chat-template FILE")
        jinja = p / "chat_template.jinja"
        source = str((jinja if jinja.is_file() else p / "tokenizer_config.json").resolve()
                     if p.is_dir() else p.resolve())
    return ChatTokenizer(tok, template, source, bool(_GENERATION.search(template)))


class Packer:
    """First-fit packing of conversations into rows of ``seq_len`` tokens (module
    docstring); ``emit(ids, flags, conversations)`` receives each closed row."""

    def __init__(self, seq_len: int, pad_id: int,
                 emit: Callable[[np.ndarray, np.ndarray, int], None]) -> None:
        self.seq_len, self.pad_id, self.emit = seq_len, pad_id, emit
        self.rows: list[tuple[list, list]] = []  # open rows: (id arrays, flag arrays)
        self.used: list[int] = []
        self.closed = 0

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        n = len(ids)
        k = next((i for i, u in enumerate(self.used) if u + n <= self.seq_len), None)
        if k is None:
            self.rows.append(([], []))
            self.used.append(0)
            k = len(self.rows) - 1
        self.rows[k][0].append(ids)
        self.rows[k][1].append(flags)
        self.used[k] += n
        if self.used[k] == self.seq_len:
            self._close(k)
        elif len(self.rows) > OPEN_ROWS:
            self._close(0)

    def _close(self, k: int) -> None:
        ids, flags = self.rows.pop(k)
        pad = self.seq_len - self.used.pop(k)
        if pad:
            ids.append(np.full(pad, self.pad_id, np.int64))
            f = np.full(pad, FLAG_PAD, FLAGS_DTYPE)
            f[0] |= FLAG_START
            flags.append(f)
        self.emit(np.concatenate(ids), np.concatenate(flags), len(ids) - (pad > 0))
        self.closed += 1

    def finish(self) -> None:
        """Close the open rows in order, then the final pad token (the last window's
        last target), if any row was written."""
        while self.rows:
            self._close(0)
        if self.closed:
            self.emit(np.array([self.pad_id], np.int64),
                      np.array([FLAG_START | FLAG_PAD], FLAGS_DTYPE), 0)


@dataclass
class Counts:
    conversations: int = 0   # rows read
    truncated: int = 0
    dropped: int = 0
    packed: int = 0          # conversations written (train + val)


def flags_of(mask: np.ndarray) -> np.ndarray:
    """A conversation's flags: its assistant tokens count, its first token starts it."""
    f = np.where(mask, FLAG_COUNTS, 0).astype(FLAGS_DTYPE)
    f[0] |= FLAG_START
    return f


def prepare_chat(inputs: list[Input], out: Path, args) -> dict:
    """Render, pack and write ``inputs`` into ``out``; returns the meta dict (plus
    ``_stats``). Written beside ``out`` and swapped in whole (as plain prepare)."""
    T = args.seq_len
    if T is None or T < 2:
        raise DataError(f"--chat needs --seq-len, the model's seq_len (>= 2): got {T}")
    if not 0.0 <= args.val_fraction < 1.0:
        raise DataError(f"--val-fraction={args.val_fraction} must be in [0, 1)")
    if args.val_docs is not None and args.val_docs < 0:
        raise DataError(f"--val-docs={args.val_docs} must be >= 0")
    if args.shard_tokens <= 0:
        raise DataError(f"--shard-tokens={args.shard_tokens} must be > 0")
    if args.tokenizer == "bytes":
        raise DataError("--chat needs --tokenizer DIR: an HF tokenizer directory (with its chat "
                        "template) or a tokenizer.json with --chat-template FILE")
    check_out(out, args.force)
    chat = load_chat_tokenizer(args.tokenizer, args.chat_template)
    # the EOS meta.json records: --eos-id, the tokenizer config's eos_token (a chat
    # model's end of turn), else the end-of-text token plain prepare finds
    spec = resolve_tokenizer(args.tokenizer, args.eos_id if args.eos_id is not None
                             else chat.tok.eos_token_id, "none")
    eos = spec.eos_id
    pad = chat.tok.pad_token_id if chat.tok.pad_token_id is not None else eos
    vocab = max(spec.vocab_size, len(chat.tok))
    dtype = args.dtype or ("uint16" if vocab <= 65536 else "uint32")
    if dtype == "uint16" and vocab > 65536:
        raise DataError(f"--dtype uint16 cannot hold the vocab of {vocab} tokens of "
                        f"--tokenizer {args.tokenizer}; use --dtype uint32")
    stage = Staging(out)
    writers = {s: (ShardWriter(stage.dir, s, np_dtype(dtype), args.shard_tokens),
                   ShardWriter(stage.dir, s, FLAGS_DTYPE, args.shard_tokens, ext="flags"))
               for s in SPLITS}
    counted = dict.fromkeys(SPLITS, 0)

    def emitter(split: str):
        def emit(ids: np.ndarray, flags: np.ndarray, n: int) -> None:
            writers[split][0].write(ids, n)
            writers[split][1].write(flags, 0)
        return emit

    packers = {s: Packer(T, pad, emitter(s)) for s in SPLITS}
    router, counts, t0 = Router(args.val_fraction, args.val_docs), Counts(), time.monotonic()
    try:
        with progress(total=sum(i.size() for i in inputs) or None, desc="prepare --chat",
                      unit="B") as bar:
            for inp in inputs:
                for conv, used in conversations(inp, args.messages_key):
                    bar.update(used)
                    counts.conversations += 1
                    kept = _fit(*chat.encode(conv), T, args.overlong, counts)
                    if kept is None:
                        continue
                    split = "val" if router.is_val(np.array([counts.packed]))[0] else "train"
                    counts.packed += 1
                    counted[split] += int((kept[1][1:] & FLAG_COUNTS).astype(bool).sum())
                    packers[split].add(*kept)
                    if hasattr(bar, "set_postfix_str"):
                        bar.set_postfix_str(f"{counts.packed:,} conversations", refresh=False)
        for p in packers.values():
            p.finish()
        _check_split(writers, counts, args)
        meta = _meta(writers, spec, chat, dtype, eos, pad, counts, counted, inputs, args)
        meta["_stats"] = {"seconds": time.monotonic() - t0}
        with open(stage.dir / "meta.json", "w") as f:
            f.write(json.dumps({k: v for k, v in meta.items() if k != "_stats"}, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        stage.publish()
    except OSError as e:
        _discard(writers, stage)
        raise DataError(f"cannot write to {out}: {e.strerror or e}") from None
    except BaseException:
        _discard(writers, stage)
        raise
    return meta


def _fit(ids: np.ndarray, mask: np.ndarray, T: int, overlong: str, counts: Counts
         ) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The conversation's ids and flags as packed (truncated to ``T``), or None: dropped."""
    if len(ids) > T:
        if overlong == "drop":
            counts.dropped += 1
            return None
        ids, mask = ids[:T], mask[:T]
        if not mask[1:].any():  # what is left of it teaches nothing
            counts.dropped += 1
            return None
        counts.truncated += 1
    return ids, flags_of(mask)


def _discard(writers: dict, stage: Staging) -> None:
    for pair in writers.values():
        for w in pair:
            w.discard()
    stage.discard()


def _check_split(writers: dict, counts: Counts, args) -> None:
    want_val = args.val_docs if args.val_docs is not None else args.val_fraction
    train, val = writers["train"][0], writers["val"][0]
    if train.tokens == 0 or (want_val and val.tokens == 0):
        raise DataError(f"{counts.packed} conversations ({counts.conversations} read, "
                        f"{counts.dropped} dropped) are too few to split with "
                        f"--val-fraction={args.val_fraction}"
                        + (f" --val-docs={args.val_docs}" if args.val_docs is not None else ""))


def _meta(writers: dict, spec, chat: ChatTokenizer, dtype: str, eos: int, pad: int,
          counts: Counts, counted: dict, inputs: list[Input], args) -> dict:
    shards = {}
    for s, (tw, fw) in writers.items():
        shards[s] = tw.finish()
        for e, fe in zip(shards[s], fw.finish()):
            e["flags"] = fe["file"]
    meta = {"vocab_size": max(spec.vocab_size, len(chat.tok)), "dtype": dtype,
            "tokenizer": spec.describe(), "tokenizer_kind": spec.kind,
            "tokenizer_sha256": spec.sha256, "eos_id": eos, "bos_id": chat.tok.bos_token_id,
            "separator": "chat"}
    for s in SPLITS:
        meta[f"{s}_tokens"] = sum(e["tokens"] for e in shards[s])
        meta[f"{s}_docs"] = sum(e["docs"] for e in shards[s])
        meta[f"{s}_max_id"] = max((e["max_id"] for e in shards[s]), default=-1)
    meta["documents"] = meta["train_docs"] + meta["val_docs"]
    meta["val_split"] = "documents" if (args.val_docs or args.val_fraction) else "none"
    meta["shards"] = shards
    meta["source"] = [str(i.path.resolve()) for i in inputs]
    meta["chat"] = {
        "seq_len": args.seq_len, "template_source": chat.source,
        "template_sha256": chat.sha256, "masking": chat.masking, "packing": "first-fit",
        "open_rows": OPEN_ROWS, "overlong": args.overlong, "pad_id": pad,
        "messages_key": args.messages_key, "conversations": counts.conversations,
        "packed": counts.packed, "truncated": counts.truncated, "dropped": counts.dropped,
        "train_rows": meta["train_tokens"] // args.seq_len,
        "val_rows": meta["val_tokens"] // args.seq_len,
        "train_counted": counted["train"], "val_counted": counted["val"],
        "flags": {"counts": FLAG_COUNTS, "start": FLAG_START, "pad": FLAG_PAD}}
    return meta


def summary(meta: dict, out: Path) -> str:
    """prepare --chat's closing line."""
    c = meta["chat"]
    return (f"prepared {c['packed']:,} of {c['conversations']:,} conversations "
            f"({c['truncated']:,} truncated, {c['dropped']:,} dropped, --overlong "
            f"{c['overlong']}) into {c['train_rows']:,} train + {c['val_rows']:,} val rows of "
            f"{c['seq_len']} tokens; {c['train_counted']:,} + {c['val_counted']:,} targets "
            f"count (assistant tokens, masking by {c['masking']}); template "
            f"{c['template_source']} -> {out} in {meta['_stats']['seconds']:.1f}s")
