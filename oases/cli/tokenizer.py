"""The tokenizer of a run (the one ``python -m oases.prepare`` recorded in its corpus's
``meta.json``), of a ``--tokenizer PATH`` or of a Hugging Face directory, as one
``tokenizers.Tokenizer`` with its EOS and BOS ids; and the Hugging Face files that make
an exported model directory complete (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``, the chat template).

Every kind ``oases.prepare`` knows becomes a ``tokenizers`` tokenizer with the same ids:

* ``bytes``: byte-level BPE without merges, id ``b`` = byte ``b`` (GPT-2's byte-to-
  character table); id 0, the EOS, is the special token ``<|endoftext|>`` (text holds
  no byte 0);
* an HF ``tokenizer.json``: loaded as it is, after its sha256 is checked against the
  record;
* a tiktoken BPE file: converted (``transformers``' ``TikTokenConverter``) with the
  split pattern ``oases.prepare`` used and ``<|endoftext|>`` after the ranks.

A BOS the corpus was prepared with (``oases.prepare --bos``) that the tokenizer's own
template does not add is added by the written ``tokenizer.json``'s template, so that
``AutoTokenizer`` encodes a text to the ids the model was trained on: the written
``tokenizer.json`` must encode a sample text, special tokens added, to the source's ids
after that BOS; other ids are an error. The EOS ids of a source's Hugging Face directory
(``generation_config.json``'s ``eos_token_id``, an id or a list) are kept: generation
stops at any of them. A chat template (``chat_template.jinja`` or
``tokenizer_config.json``'s, beside the ``tokenizer.json``) travels with the tokenizer
and is written to both; :mod:`oases.cli.chat` renders it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import yaml

from oases.cli.prepare_encode import (TIKTOKEN_PATTERN, load_hf, load_tiktoken, file_sha256,
                                      template_bos, resolve_tokenizer)
from oases.errors import DataError, UserError
from oases.runtime.tokens import read_meta, resolve

EOT = "<|endoftext|>"
SAMPLE = "Hello, wörld! 1234 Ā 漢字\n\ttabs  and\r\nlines <b>x</b> don't."
_PASS = "pass --tokenizer PATH (or --tokenizer none for the weights alone)"


@dataclass
class Tok:
    tok: object                   # tokenizers.Tokenizer
    eos_id: Optional[int]
    bos_id: Optional[int]
    source: str                   # for messages: bytes, a path
    reference: Optional[object] = None   # text -> ids of the original (round-trip check)
    chat_template: Optional[str] = None
    more_eos: tuple[int, ...] = ()       # other ids that end a generation (an HF directory's)

    @property
    def eos_ids(self) -> list[int]:
        """The ids that end a generation: the EOS first, then :attr:`more_eos`."""
        first = [] if self.eos_id is None else [self.eos_id]
        return first + [i for i in self.more_eos if i not in first]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as the training data had them: the BOS (if any) first, no EOS."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)


def _hf():
    """The optional packages (the hf and data extras) a tokenizer needs here."""
    try:
        import tokenizers  # deferred: optional, only where a tokenizer is used
        import transformers  # deferred: as above

        # the module, not transformers' function of the same name
        convert = importlib.import_module("transformers.convert_slow_tokenizer")
    except ImportError as e:
        raise UserError(f"a tokenizer needs the 'tokenizers' and 'transformers' packages "
                        f"({e}): pip install tokenizers transformers") from None
    return tokenizers, transformers, (convert.TikTokenConverter, convert.bytes_to_unicode)


def _bytes_tokenizer():
    tk, _, convert = _hf()
    table = convert[1]()
    models, pre_tokenizers, decoders = tk.models, tk.pre_tokenizers, tk.decoders
    vocab = {table[b]: b for b in range(1, 256)}
    vocab[EOT] = 0
    tok = tk.Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([tk.AddedToken(EOT, special=True, normalized=False)])
    return tok


def _tiktoken_tokenizer(path: str):
    return _hf()[2][0](path, pattern=TIKTOKEN_PATTERN,
                             extra_special_tokens=[EOT]).converted()


def chat_template_of(directory: Path) -> Optional[str]:
    """The chat template of a Hugging Face tokenizer directory, where transformers looks
    for it: ``chat_template.jinja`` (transformers 5 writes it there), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates:
    the one named ``default``); None: no template."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    cfg = directory / "tokenizer_config.json"
    try:
        found = json.loads(cfg.read_text()).get("chat_template") if cfg.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(found, list):
        found = next((t.get("template") for t in found
                      if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) else None


def load(kind: str, path: str, eos_id: Optional[int], bos_id: Optional[int]) -> Tok:
    if kind == "bytes":
        return Tok(_bytes_tokenizer(), eos_id, bos_id, "bytes",
                   lambda s: list(s.encode("utf-8")))
    if kind == "tiktoken":
        enc = load_tiktoken(path)
        return Tok(_tiktoken_tokenizer(path), eos_id, bos_id, path, enc.encode_ordinary)
    tok = load_hf(path)
    return Tok(tok, eos_id, bos_id, path, chat_template=chat_template_of(Path(path).parent),
               more_eos=tuple(hf_eos(Path(path).parent)))


def from_path(name: str, eos_id: Optional[int] = None) -> Tok:
    """``--tokenizer``: ``bytes``, a tokenizer.json, a directory holding one, or a tiktoken
    file; EOS (unless ``eos_id`` is given) and BOS as ``oases.prepare`` would find them."""
    spec = resolve_tokenizer(name, eos_id, "auto")
    return load(spec.kind, spec.path, spec.eos_id, spec.bos_id)


def _data_paths(run_dir: Path) -> list[str]:
    try:
        data = (yaml.safe_load((run_dir / "config.yaml").read_text()) or {}).get("data") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return []
    if data.get("kind", "synthetic") != "tokens":
        return []
    paths = [e.get("path") for e in data.get("train_paths") or [] if isinstance(e, dict)]
    return [str(p) for p in [data.get("train_path"), *paths, data.get("val_path")] if p]


def recorded(run_dir: Path) -> Optional[Tok]:
    """The tokenizer recorded for the run's corpus (None: the run trained on synthetic
    tokens or on files without a record). A recorded file that is missing or has
    changed (sha256) is an error."""
    records = {}
    for p in _data_paths(run_dir):
        try:
            files = resolve(p)
        except DataError:
            raise UserError(f"the run's data path {p} is gone, so its tokenizer is unknown; "
                            f"{_PASS}") from None
        meta = read_meta(files[0])
        if meta.get("tokenizer_kind"):
            key = (meta["tokenizer_kind"], meta.get("tokenizer_sha256"))
            records.setdefault(key, (p, meta))
    if not records:
        return None
    if len(records) > 1:
        names = ", ".join(f"{m.get('tokenizer')} ({p})" for p, m in records.values())
        raise UserError(f"the run's corpora were prepared with different tokenizers: "
                        f"{names}; {_PASS}")
    (kind, sha), (p, meta) = next(iter(records.items()))
    path = str(meta.get("tokenizer") or "")
    if kind != "bytes":
        f = Path(path)
        if not f.is_file():
            raise UserError(f"tokenizer {path} (recorded for {p}) does not exist; {_PASS}")
        if sha and file_sha256(f) != sha:
            raise UserError(f"tokenizer {path} has changed since {p} was prepared (sha256 "
                            f"differs); {_PASS}")
    eos, bos = meta.get("eos_id"), meta.get("bos_id")
    return load(kind, path, eos if isinstance(eos, int) else None,
                bos if isinstance(bos, int) else None)


def recorded_chat_template(run_dir: Path) -> Optional[str]:
    """The chat template the run's chat corpus was prepared with (``meta.json``'s
    ``chat`` record: ``template_source``, ``template_sha256``); None: no chat corpus. A
    source that is gone or whose template has changed is an error."""
    for p in _data_paths(run_dir):
        try:
            chat = read_meta(resolve(p)[0]).get("chat")
        except DataError:
            continue
        if not isinstance(chat, dict) or not chat.get("template_source"):
            continue
        src = Path(chat["template_source"])
        hint = f"pass --chat-template FILE (the template {p} was prepared with)"
        try:
            text = (chat_template_of(src.parent) if src.name == "tokenizer_config.json"
                    else src.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            text = None
        if text is None:
            raise UserError(f"chat template {src} (recorded for {p}) cannot be read; {hint}")
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != chat.get("template_sha256"):
            raise UserError(f"chat template {src} has changed since {p} was prepared "
                            f"(sha256 differs); {hint}")
        return text
    return None


def hf_eos(hf_dir: Path) -> list[int]:
    """The EOS ids of a Hugging Face directory: its ``generation_config.json``'s
    ``eos_token_id`` (an id or a list), else its ``config.json``'s, else none."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((hf_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids = [i for i in (eos if isinstance(eos, list) else [eos])
               if isinstance(i, int) and not isinstance(i, bool)]
        if ids:
            return ids
    return []


def from_hf_dir(hf_dir: Path, eos_id: Optional[int] = None) -> Optional[Tok]:
    """A Hugging Face directory's ``tokenizer.json`` with the BOS its template adds and
    the directory's EOS ids (:func:`hf_eos`; ``eos_id`` first where given); None: no
    tokenizer.json."""
    if not (hf_dir / "tokenizer.json").is_file():
        return None
    t = from_path(str(hf_dir), eos_id)
    if eos_id is None and t.more_eos:
        t.eos_id = t.more_eos[0]
    return t


def check_fits(t: Tok, vocab_size: int) -> None:
    """The tokenizer's ids (its EOS ids and BOS too) are ids of the model's vocabulary."""
    ids = t.eos_ids + ([] if t.bos_id is None else [t.bos_id])
    if t.vocab_size > vocab_size or any(i >= vocab_size for i in ids):
        eos = eos_json(t)
        raise UserError(f"tokenizer {t.source} has {t.vocab_size} tokens (EOS {eos}, "
                        f"BOS {t.bos_id}) but the model's vocabulary is {vocab_size}")


def eos_json(t: Tok):
    """``eos_token_id`` for config.json and generation_config.json: the EOS id, or the
    list of them where the source has several, or None."""
    ids = t.eos_ids
    return ids if len(ids) > 1 else ids[0] if ids else None


def _special(tok, i: Optional[int]) -> Optional[str]:
    """The text of token ``i`` where it is a special token of ``tok`` (None otherwise: as
    a special token of the written tokenizer it would stop matching its text)."""
    added = tok.get_added_tokens_decoder()
    return added[i].content if i in added and added[i].special else None


def _with_bos(tk, tok, bos_id: int, source: str):
    """A copy of ``tok`` whose post-processor puts the BOS ``bos_id`` before a text:
    after its own one where that adds no token (ByteLevel's offsets), instead of it where
    it does."""
    bos = tok.id_to_token(bos_id)
    if bos is None:
        raise UserError(f"the BOS id {bos_id} the corpus was prepared with is no token of "
                        f"tokenizer {source}; {_PASS}")
    tok = tk.Tokenizer.from_str(tok.to_str())
    template = tk.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)])
    old, adds = tok.post_processor, tok.encode("", add_special_tokens=True).ids
    tok.post_processor = (template if old is None or adds
                          else tk.processors.Sequence([old, template]))
    return tok


def _declared(t: Tok, tok, key: str) -> Optional[str]:
    """The ``bos_token``/``eos_token`` the ``tokenizer_config.json`` beside ``t``'s
    tokenizer.json declares, where it is a token of ``tok`` (None otherwise)."""
    if t.source in ("", "bytes"):
        return None
    try:
        value = json.loads((Path(t.source).parent / "tokenizer_config.json").read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) and tok.token_to_id(value) is not None else None


def hf_fast(t: Tok, tok=None, seq_len: Optional[int] = None):
    """``t`` as the ``transformers.PreTrainedTokenizerFast`` an export writes (``tok``:
    its ``tokenizers`` object instead of ``t.tok``): BOS and EOS tokens those the
    source's ``tokenizer_config.json`` declares, else the texts of ``t``'s BOS and first
    EOS id; the first EOS id's text the padding token; left padding; ``t``'s chat
    template, which sees these ``bos_token`` and ``eos_token`` (as it does where
    ``AutoTokenizer`` loads the source directory)."""
    _, tf, _ = _hf()
    tok = t.tok if tok is None else tok
    eos = _special(tok, t.eos_id)
    kw = {} if seq_len is None else {"model_max_length": seq_len}
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, padding_side="left", eos_token=_declared(t, tok, "eos_token") or eos,
        pad_token=eos, bos_token=_declared(t, tok, "bos_token") or _special(tok, t.bos_id), **kw)
    if t.chat_template:
        fast.chat_template = t.chat_template
    return fast


def write_hf_files(t: Tok, out: Path, vocab_size: int, seq_len: int) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json into ``out``,
    after checking that the tokenizer fits the model's vocabulary; the written
    tokenizer.json must encode a sample, special tokens added, as the run's data has it
    (the BOS, then the source's ids)."""
    tk, tf, _ = _hf()
    check_fits(t, vocab_size)
    tok = t.tok
    if t.bos_id is not None and template_bos(tok) != t.bos_id:
        tok = _with_bos(tk, tok, t.bos_id, t.source)
    fast = hf_fast(t, tok, seq_len)
    fast.save_pretrained(str(out))
    if t.chat_template:  # transformers before 4.43 reads the template from here only
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.setdefault("chat_template", t.chat_template)
        cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    written = tk.Tokenizer.from_file(str(out / "tokenizer.json"))
    want = ([] if t.bos_id is None else [t.bos_id]) + list(
        t.reference(SAMPLE) if t.reference else t.tok.encode(SAMPLE, add_special_tokens=False).ids)
    got = written.encode(SAMPLE, add_special_tokens=True).ids
    if list(got) != want:
        raise UserError(f"the tokenizer.json written for {t.source} encodes text differently "
                        f"from the run's data (ids {got[:3]}... where it has {want[:3]}...); "
                        f"{_PASS}")
    tf.GenerationConfig(bos_token_id=t.bos_id, eos_token_id=eos_json(t),
                        pad_token_id=t.eos_id).save_pretrained(str(out))
