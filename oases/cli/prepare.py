"""Tokenize documents into token shards for ``data.kind=tokens``.

    python -m oases.prepare --builtin pydoc --out data/pydoc
    python -m oases.prepare --input 'corpus/*.jsonl.zst' --tokenizer tok/ --out data/c
    python -m oases.prepare --input a.parquet hf_dir/ notes.txt --split-on '\\n\\n' --out data/c
    python -m oases.prepare --chat --input chats.jsonl --tokenizer hf_dir/ --seq-len 2048 --out data/sft

``--chat`` prepares conversations for fine-tuning instead: :mod:`oases.cli.prepare_chat`.

Inputs: any number of files, directories or globs of text (``.txt``: one document per
file unless ``--split-on`` cuts it), jsonl (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``:
one document per line, the ``--text-key`` field), parquet (the ``--text-key`` column,
read a row group at a time) and local HF ``datasets`` directories (``save_to_disk`` or
``.arrow`` files). Every document is followed by the tokenizer's EOS (``--eos-id``),
and preceded by a BOS where the tokenizer's template puts one (``--bos``).

The work streams: ``--workers`` processes (default: every core) parse and tokenize
chunks of a few MB while this process reads ahead and writes, so memory is bounded by
the chunks in flight, not by the corpus. Output: ``OUT/train.bin`` and ``OUT/val.bin``
(or ``train-00000.bin``, ... past ``--shard-tokens``; raw little-endian uint16/uint32
ids, no header) and ``OUT/meta.json`` (vocab size, dtype, tokenizer and its sha256,
EOS/BOS ids, per-shard tokens, largest id and documents, the sources). Validation takes
whole documents (``--val-docs N`` first documents, or every ``1/--val-fraction``-th);
a corpus of one document is cut by tokens instead, its last ``--val-fraction``.

Bad input (a missing file, a glob matching nothing, a bad jsonl line, a missing text
key or column, a vocabulary too big for the dtype, an output already there) is one
line on stderr with exit status 2; nothing already written is touched without
``--force``. The corpus is written in a directory beside ``--out`` and swapped in whole
once complete, so a run that fails (or is killed), forced or not, leaves ``--out`` as it
was: never a mix of the old corpus and the new one.
"""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import NoReturn, Optional

import numpy as np

from oases.cli.prepare_chat import prepare_chat, summary
from oases.cli.prepare_encode import Encoder, resolve_tokenizer, worker_encode, worker_init
from oases.cli.prepare_sources import Input, expand, read
from oases.cli.prepare_write import SPLITS, Router, ShardWriter, Staging, check_out
from oases.errors import EXIT_USER_ERROR, DataError, UserError
from oases.progress import progress
from oases.runtime.tokens import np_dtype

# tokens per shard by default: 1 GiB of uint16 ids
SHARD_TOKENS = 1 << 29


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as ONE line (exit 2), like every other
    oases entry point, instead of the usage block plus the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m oases.prepare",
                description="Tokenize documents into token shards and meta.json.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH",
                     help="files, globs or HF datasets directories: .txt, .jsonl[.gz|.zst], "
                          ".parquet, save_to_disk/.arrow")
    src.add_argument("--builtin", choices=("pydoc",),
                     help="a built-in corpus: pydoc = CPython's documentation topics")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|PATH",
                   help="'bytes' (byte-level, vocab 256; default), a local HF tokenizer.json "
                        "or its directory, or a local tiktoken BPE file")
    p.add_argument("--text-key", default="text", help="jsonl field / parquet or HF column")
    p.add_argument("--split-on", default=None, metavar="SEP",
                   help="cut text files into documents at SEP (escapes allowed: '\\n\\n')")
    p.add_argument("--eos-id", type=int, default=None, help="the id after every document "
                   "(default: the tokenizer's end-of-text token; byte 0 for bytes)")
    p.add_argument("--bos", default="auto", metavar="auto|none|ID",
                   help="the id before every document (auto: as the tokenizer's template)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="share of the documents for validation (0: none)")
    p.add_argument("--val-docs", type=int, default=None,
                   help="the first N documents for validation (instead of --val-fraction)")
    p.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                   help="token file dtype (default: uint16 if vocab <= 65536, else uint32)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: every core; 1: in this process)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                   help=f"tokens per shard at most (default {SHARD_TOKENS})")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip (and count) bad jsonl lines and rows without text")
    p.add_argument("--force", action="store_true", help="overwrite existing output files")
    chat = p.add_argument_group("chat data (--chat; docs/data.md#chat-data)")
    chat.add_argument("--chat", action="store_true",
                      help="rows of messages (or prompt/completion) rendered by the chat "
                           "template, packed into --seq-len rows, assistant tokens counting")
    chat.add_argument("--seq-len", type=int, default=None, metavar="T",
                      help="tokens per packed row: the model's model.seq_len")
    chat.add_argument("--chat-template", default=None, metavar="FILE",
                      help="a Jinja chat template (default: the --tokenizer directory's)")
    chat.add_argument("--overlong", choices=("truncate", "drop"), default="truncate",
                      help="a conversation longer than --seq-len (default: truncate)")
    chat.add_argument("--messages-key", default="messages",
                      help="the field of the messages (else 'prompt' and 'completion')")
    return p


def _chunks(inputs: list[Input], args, bar):
    """Every input's chunks, in order, advancing the bar by the input bytes they used."""
    for inp in inputs:
        for chunk, consumed in read(inp, args.text_key, args.split_on, args.skip_bad):
            bar.update(consumed)
            yield chunk


def _encoded(inputs: list[Input], args, spec, bar):
    """The encoded chunks, in input order: in this process (one worker) or from a pool
    with at most two chunks per worker in flight (bounded memory, busy workers)."""
    if args.workers <= 1:
        enc = Encoder(spec, parallel=True)
        for chunk in _chunks(inputs, args, bar):
            yield enc.encode(chunk, args.skip_bad)
        return
    import multiprocessing  # deferred: only with several workers

    # spawn: a fresh interpreter per worker, safe whatever threads this process has
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.workers, initializer=worker_init, initargs=(spec,)) as pool:
        pending: deque = deque()
        for chunk in _chunks(inputs, args, bar):
            pending.append(pool.apply_async(worker_encode, ((chunk, args.skip_bad),)))
            if len(pending) >= 2 * args.workers:
                yield _result(pending.popleft().get())
        while pending:
            yield _result(pending.popleft().get())


def _result(r):
    if isinstance(r, str):  # a worker's DataError
        raise DataError(r)
    return r


def _route(res, router: Router, writers: dict, doc: int) -> int:
    """Write one encoded chunk's pieces to their splits; returns the next document index.
    Pieces go in runs of one split (a piece is routed by the document it belongs to)."""
    ids, lengths, ends, _, _ = res
    if not len(lengths):
        return doc
    piece_doc = doc + np.cumsum(ends) - ends  # the document each piece belongs to
    val = router.is_val(piece_doc)
    tok_end = np.cumsum(lengths)
    cuts = np.flatnonzero(np.diff(val.astype(np.int8))) + 1
    for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(lengths)]):
        lo = tok_end[a - 1] if a else 0
        writers["val" if val[a] else "train"].write(ids[lo:tok_end[b - 1]],
                                                     int(ends[a:b].sum()))
    return doc + int(ends.sum())


def prepare(inputs: list[Input], out: Path, args) -> dict:
    """Tokenize ``inputs`` into ``out``; returns the meta dict (plus ``_stats``)."""
    if not 0.0 <= args.val_fraction < 1.0:
        raise DataError(f"--val-fraction={args.val_fraction} must be in [0, 1)")
    if args.val_docs is not None and args.val_docs < 0:
        raise DataError(f"--val-docs={args.val_docs} must be >= 0")
    if args.shard_tokens <= 0 or args.workers <= 0:
        raise DataError("--shard-tokens and --workers must be > 0")
    check_out(out, args.force)
    spec = resolve_tokenizer(args.tokenizer, args.eos_id, args.bos)
    dtype = args.dtype or ("uint16" if spec.vocab_size <= 65536 else "uint32")
    if dtype == "uint16" and spec.vocab_size > 65536:
        raise DataError(f"--dtype uint16 cannot hold the vocab of {spec.vocab_size} tokens "
                        f"of --tokenizer {args.tokenizer}; use --dtype uint32")
    stage = Staging(out)  # the new corpus, beside --out until it is complete
    writers = {s: ShardWriter(stage.dir, s, np_dtype(dtype), args.shard_tokens) for s in SPLITS}
    router = Router(args.val_fraction, args.val_docs)
    t0, doc, bad, nbytes = time.monotonic(), 0, 0, 0
    total = sum(i.size() for i in inputs) or None
    try:
        with progress(total=total, desc="prepare", unit="B") as bar:
            for res in _encoded(inputs, args, spec, bar):
                doc = _route(res, router, writers, doc)
                bad += res[3]
                nbytes += res[4]
                if hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(f"{doc:,} docs", refresh=False)
        split_by = _check_split(writers, doc, args)
        meta = _meta(writers, spec, dtype, split_by, inputs, args)
        meta["_stats"] = {"docs": doc, "skipped": bad, "bytes": total or nbytes,
                          "seconds": time.monotonic() - t0}
        with open(stage.dir / "meta.json", "w") as f:
            f.write(json.dumps({k: v for k, v in meta.items() if k != "_stats"}, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        stage.publish()  # --out: the old corpus until here, the new one whole from here
    except OSError as e:
        for w in writers.values():
            w.discard()
        stage.discard()
        raise DataError(f"cannot write to {out}: {e.strerror or e}") from None
    except BaseException:
        for w in writers.values():
            w.discard()
        stage.discard()
        raise
    return meta


def _check_split(writers: dict, docs: int, args) -> str:
    """How the val split was taken ("documents", "tokens" or "none"); a one-document
    corpus moves the last --val-fraction of its tokens to val here."""
    train, val = writers["train"], writers["val"]
    if docs == 1 and args.val_fraction > 0 and args.val_docs is None:
        n_val = int(round(train.tokens * args.val_fraction))
        if 0 < n_val < train.tokens:
            for part in train.take_tail(n_val):
                val.write(part, 0)
            val.shards[-1]["docs"] = 1
            train.shards[-1]["docs"] = 0  # the document continues into val
            return "tokens"
    want_val = args.val_docs if args.val_docs is not None else args.val_fraction
    if train.tokens == 0 or (want_val and val.tokens == 0):
        raise DataError(f"{docs} documents ({train.tokens + val.tokens} tokens) are too few "
                        f"to split with --val-fraction={args.val_fraction}"
                        + (f" --val-docs={args.val_docs}" if args.val_docs is not None else ""))
    return "documents" if want_val else "none"


def _meta(writers: dict, spec, dtype: str, split_by: str, inputs: list[Input], args) -> dict:
    shards = {s: w.finish() for s, w in writers.items()}
    meta = {"vocab_size": spec.vocab_size, "dtype": dtype, "tokenizer": spec.describe(),
            "tokenizer_kind": spec.kind, "tokenizer_sha256": spec.sha256,
            "eos_id": spec.eos_id, "bos_id": spec.bos_id, "separator": "eos"}
    for s, w in writers.items():
        meta[f"{s}_tokens"] = sum(e["tokens"] for e in shards[s])
        meta[f"{s}_docs"] = sum(e["docs"] for e in shards[s])
        meta[f"{s}_max_id"] = max((e["max_id"] for e in shards[s]), default=-1)
    meta["documents"] = meta["train_docs"] + meta["val_docs"]
    meta["val_split"] = split_by
    meta["shards"] = shards
    meta["source"] = ("builtin:pydoc" if args.builtin else
                      [str(i.path.resolve()) for i in inputs])
    meta["text_key"], meta["split_on"] = args.text_key, args.split_on
    return meta


def unescape(sep: str) -> str:
    """``--split-on``'s backslash escapes (``\\n``, ``\\t``, ``\\x00``, ``\\u2028``) decoded;
    any other character stays itself (``é``, ``。``)."""
    try:
        # backslashreplace: what latin-1 lacks reaches the decoder as its own \u escape
        return codecs.decode(sep.encode("latin-1", "backslashreplace"), "unicode_escape")
    except UnicodeDecodeError as e:
        raise DataError(f"--split-on '{sep}' has a bad escape ({e.reason}); write a "
                        f"separator such as '\\n\\n' or '\\x1e'") from None


def _check_chat_args(args) -> None:
    if args.chat and args.builtin:
        raise DataError("--chat reads conversations from --input, not --builtin")
    if not args.chat:
        given = [f for f, v in (("--seq-len", args.seq_len), ("--chat-template",
                                 args.chat_template)) if v is not None]
        if given:
            raise DataError(f"{' and '.join(given)} need{'s' * (len(given) == 1)} --chat")


def main(argv: Optional[list[str]] = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        _check_chat_args(args)
        if args.chat:
            out = Path(args.out)
            print(summary(prepare_chat(expand(args.input), out, args), out))
            return 0
        if args.split_on is not None:
            args.split_on = unescape(args.split_on)
        inputs = ([Input(Path("pydoc"), "builtin")] if args.builtin
                  else expand(args.input))
        out = Path(args.out)
        meta = prepare(inputs, out, args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    st = meta["_stats"]
    mb = st["bytes"] / 1e6
    rate = f"{mb / st['seconds']:.1f} MB/s" if st["seconds"] > 0 else "-"
    skipped = f", {st['skipped']:,} bad skipped" if st["skipped"] else ""
    print(f"prepared {st['docs']:,} documents{skipped}: {meta['train_tokens']:,} train + "
          f"{meta['val_tokens']:,} val tokens (vocab {meta['vocab_size']}, {meta['dtype']}, "
          f"tokenizer {args.tokenizer}, EOS {meta['eos_id']}) in "
          f"{len(meta['shards']['train']) + len(meta['shards']['val'])} shards -> {out}; "
          f"{mb:,.1f} MB in {st['seconds']:.1f}s ({rate})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
