"""Training and validation batches from nanoGPT-style token files (or synthetic tokens).

A token file is a raw little-endian ``uint16`` or ``uint32`` array with no header
(``train.bin``, ``val.bin``, as written by ``python -m oases.prepare``); it is
read through ``np.memmap`` so a multi-GB file costs no RAM up front.

**Training** (:class:`TrainBatches`) cuts the file into ``n = (len - 1) // T``
windows of ``T + 1`` tokens starting every ``T`` tokens (window ``w`` is
``tokens[w*T : w*T + T + 1]``: inputs plus the next-token targets; neighbours
share one token, so every token but the first is a target exactly once). A *global
sample counter* ``g`` walks one random permutation of the windows per epoch
(epoch ``e = g // n`` uses the permutation seeded from ``(seed, e)``). Every DP
rank holds the same counter ``consumed``; a call gives rank ``r`` the samples
``consumed + r*mbs + j`` (``j < mbs``) and then advances ``consumed`` by
``mbs * dp``. So the DP ranks advance in lockstep, together consume disjoint
samples, and the whole data order is a function of ``(seed, consumed)`` alone:
checkpointing ``{"consumed": int}`` is enough to resume bit-exactly, and resuming
with a different ``dp`` still continues the same global sample stream. A *blend*
(``data.train_paths``, :mod:`oases.runtime.blend`) maps each global sample to one
of several files and that file's own sample counter; each file walks its own
permutations (seeded from ``(seed, file index, epoch)``) and the per-file counts
join ``consumed`` in the checkpoint.

**Validation** (:class:`ValBatches`, :func:`val_batches`) uses the val file's
windows from its start, in order, so every eval sees the same tokens and the
numbers are comparable across steps and runs. A file that does not fill its last
global batch still counts every window: that batch is padded with rows whose
targets are all ``IGNORE_INDEX``, which the token-weighted eval loss ignores.

**Chat data** (``oases.prepare --chat``: rows of ``seq_len`` tokens, per-token flags
beside the tokens, :mod:`oases.runtime.tokens`) gives batches whose target ``y[t]`` is
``IGNORE_INDEX`` where token ``t+1`` does not count (``data.loss_on=assistant``: not an
assistant token; ``all``: a pad) or starts a document (a target across documents),
and whose documents start at the flagged tokens (:class:`ChatFraming`). Validation
counts the same targets. Blends of chat corpora are read alike; a blend mixing chat
and plain corpora is refused.

Everything wrong with the data (missing file, wrong dtype, too short, token id
outside the vocabulary) raises :class:`~oases.errors.DataError`, which the entry
points report as one line with exit status 2.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from oases.config import DataConfig
from oases.errors import CheckpointError, ConfigError, DataError
from oases.models.documents import Documents
from oases.parallel.batch import Batch
from oases.parallel.loss import IGNORE_INDEX
from oases.runtime.blend import Blend
from oases.runtime.chat_batches import ChatFraming, check_chat_seq_len, gather_flags
from oases.runtime.tokens import Corpus, ShardedTokens, open_corpus

PathLike = Union[str, Path]

# Domain tags mixed into the RNG seeds so the permutation streams and the
# synthetic-token stream never share a seed, whatever (seed, epoch, sample) are.
_PERM_STREAM = 0
_SYNTH_STREAM = 1
_BLEND_PERM_STREAM = 2  # file k of a blend: seeded from (seed, k, epoch)


def _rng(stream: int, seed: int, *index: int) -> np.random.Generator:
    """A generator that depends only on ``(stream, seed, *index)``.

    ``SeedSequence`` hashes the whole tuple (unlike ``seed + index``, which makes
    (1, 2) and (2, 1) collide); it needs non-negative words, hence the mod 2**64
    so a negative config seed still works.
    """
    return np.random.default_rng([stream, seed % (1 << 64), *index])


def _gather_windows(tokens: np.ndarray, windows: np.ndarray, seq_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``tokens[w*T : w*T + T + 1]`` for each window ``w``, split into inputs
    and next-token targets, as int64 (what ``nn.Embedding`` and the loss want)."""
    offsets = windows.astype(np.int64)[:, None] * seq_len + np.arange(seq_len + 1)  # (B, T+1)
    buf = torch.from_numpy(np.asarray(tokens[offsets], dtype=np.int64))  # (B, T+1)
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # (B, T), (B, T)


def _check_layout(seq_len: int, micro_batch_size: int, dp_rank: int, dp: int) -> None:
    """Arguments that come from validated config; a bad one here is a caller bug."""
    if seq_len <= 0 or micro_batch_size <= 0 or dp <= 0:
        raise ValueError(f"seq_len={seq_len}, micro_batch_size={micro_batch_size} and "
                         f"dp={dp} must be > 0")
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp})")


class _TrainFile:
    """One training file's windows, in a fresh random order per epoch.

    The file's own sample ``s`` is window ``perm(s // n)[s % n]`` of its ``n``
    windows, ``perm(e)`` seeded from ``seed_words + (e,)``: a file on its own walks
    the global sample counter; a file of a blend walks its own count.
    """

    def __init__(self, path: PathLike, tokens: Union[np.ndarray, ShardedTokens], seq_len: int,
                 seed_words: tuple[int, ...], eos_id: Optional[int] = None,
                 flags: Optional[Union[np.ndarray, ShardedTokens]] = None) -> None:
        self.path = path
        self.tokens = tokens
        self.eos_id = eos_id
        self.flags = flags  # chat data: the per-token flags (oases.runtime.tokens)
        self.num_windows = max(len(tokens) - 1, 0) // seq_len
        self._seed_words = seed_words
        # epoch -> permutation of the windows; at most two live (samples arrive in
        # increasing order, and a batch can straddle an epoch boundary), so a long run
        # does not accumulate permutations.
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = _rng(*self._seed_words, epoch).permutation(self.num_windows)
            for old in [e for e in self._perms if e < epoch - 1]:
                del self._perms[old]
            self._perms[epoch] = perm
        return perm

    def windows(self, samples: np.ndarray) -> np.ndarray:
        """The window of each of this file's samples ``samples`` (increasing)."""
        n = self.num_windows
        return np.array([self._perm(int(s) // n)[int(s) % n] for s in samples],
                        dtype=np.int64)


def _recorded_dtype(path: PathLike) -> Optional[str]:
    """The dtype in the ``meta.json`` next to ``path``, if it records one (an unreadable
    meta.json is reported by :func:`~oases.runtime.tokens.open_corpus`)."""
    try:
        meta = json.loads((Path(path).parent / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    return dtype if isinstance(dtype, str) else None


def _open_blend(cfg: DataConfig, seq_len: int, vocab_size: int, seed: int
                ) -> tuple[list[_TrainFile], Blend]:
    """Open and check every file of ``data.train_paths``; file ``k`` permutes its
    windows from ``(seed, k, epoch)``."""
    cfg.validate()  # a config built in code: train_path left set, a bad entry, a missing file
    pairs = cfg.blend()
    recorded = [(p, d) for p, d in ((p, _recorded_dtype(p)) for p, _ in pairs) if d]
    for path, dtype in recorded[1:]:
        if dtype != recorded[0][1]:
            raise ConfigError(f"data.train_paths mixes token dtypes: {recorded[0][0]} is "
                              f"{recorded[0][1]} but {path} is {dtype} (per their meta.json); "
                              f"every file is read as data.dtype: prepare them with one --dtype")
    files = []
    for k, (path, _) in enumerate(pairs):
        corpus = open_corpus(path, cfg.dtype, vocab_size, cfg.eos_id)
        if corpus.flags is not None:
            check_chat_seq_len(corpus, path, seq_len)
        f = _TrainFile(path, corpus.tokens, seq_len, (_BLEND_PERM_STREAM, seed, k),
                       corpus.eos_id, corpus.flags)
        if f.num_windows == 0:
            raise DataError(f"data file {path} (data.train_paths[{k}]) holds fewer than "
                            f"{seq_len + 1} tokens: not one window of a training sample")
        files.append(f)
    chat = [f.flags is not None for f in files]
    if any(chat) and not all(chat):
        raise ConfigError(f"data.train_paths mixes chat data ({pairs[chat.index(True)][0]}) "
                          f"and plain tokens ({pairs[chat.index(False)][0]}); blend chat "
                          f"corpora only with chat corpora")
    return files, Blend([str(Path(p).resolve()) for p, _ in pairs], [w for _, w in pairs])


def _common_eos(files: list[_TrainFile], cfg: DataConfig) -> Optional[int]:
    """The EOS id that ends every document of the training data (``data.eos_id``, else
    what meta.json records), or None; ``data.reset_attention_at_eos`` needs one."""
    ids = {f.eos_id for f in files}
    eos = ids.pop() if len(ids) == 1 else None
    if cfg.reset_attention_at_eos and eos is None:
        raise ConfigError("data.reset_attention_at_eos needs the EOS id that ends each document: "
                          "the training files' meta.json records none (or they disagree); "
                          "set data.eos_id")
    return eos


def _chat_framing(cfg: DataConfig, files: list[_TrainFile]) -> Optional[ChatFraming]:
    """Chat training data's framing, None for plain tokens; the document settings
    checked against the kind of data, known now that the files are open."""
    if files and files[0].flags is not None:
        if cfg.reset_attention_at_eos:
            raise ConfigError("data.reset_attention_at_eos cuts documents at EOS ids, but "
                              f"{files[0].path} is chat data, whose documents (conversations) "
                              "prepare recorded: set data.reset_attention_at_eos=false")
        return ChatFraming(cfg.loss_on, cfg.reset_position_ids)
    if cfg.reset_position_ids and not cfg.reset_attention_at_eos:
        raise ConfigError("data.reset_position_ids restarts positions at each document: plain "
                          "token data needs data.reset_attention_at_eos=true (documents ended "
                          "by EOS); chat data (oases.prepare --chat) has its own")
    return None


def eos_documents(cfg: DataConfig, eos_id: Optional[int]):
    """``data.reset_attention_at_eos``: what makes a batch's :class:`Documents` from its
    ids (documents ended by ``eos_id``, positions restarting at each under
    ``data.reset_position_ids``); None: one document per row."""
    if not cfg.reset_attention_at_eos or eos_id is None:
        return None
    return lambda x: Documents.from_eos(x, eos_id, cfg.reset_position_ids)


def corpus_identity(corpus: Corpus) -> dict:
    """What a checkpoint records of a single ``data.train_path`` for a resume to check:
    the token count, each file's name and size, and the sha256 of the ``meta.json``
    beside them (a corpus moved elsewhere is the same; another or a re-prepared one is
    not)."""
    digest = None
    try:
        digest = hashlib.sha256((corpus.files[0].parent / "meta.json").read_bytes()).hexdigest()
    except (OSError, IndexError):  # no meta.json (a raw or foreign corpus)
        pass
    return {"tokens": len(corpus.tokens),
            "files": [[f.name, f.stat().st_size] for f in corpus.files if f.is_file()],
            "meta_sha256": digest}


class TrainBatches:
    """An endless, resumable stream of training micro-batches for one DP rank.

    See the module docstring for the sample order. ``next_batch()`` returns CPU
    int64 tensors ``x, y`` of shape ``(micro_batch_size, seq_len)`` with
    ``y[:, t] == x[:, t+1]`` along the window; the caller moves them to a device.
    All ranks must call ``next_batch()`` the same number of times (they do: every
    rank runs every micro-step), as each call advances the shared counter.

    ``masked``: whether a target may be ``IGNORE_INDEX`` (chat data); False: every
    target counts (plain tokens, synthetic data). ``documents``: what makes a batch's
    documents (:func:`eos_documents`), the :class:`ChatFraming` of chat data, or None.
    """

    def __init__(self, cfg: DataConfig, seq_len: int, vocab_size: int,
                 micro_batch_size: int, dp_rank: int, dp: int, seed: int) -> None:
        _check_layout(seq_len, micro_batch_size, dp_rank, dp)
        if vocab_size <= 0:
            raise ValueError(f"vocab_size={vocab_size} must be > 0")
        self.kind = cfg.kind
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp = dp
        self.seed = seed
        self.consumed = 0  # global samples consumed by all DP ranks together
        self._files: list[_TrainFile] = []
        self._blend: Optional[Blend] = None  # data.train_paths: which file each sample is from
        self.corpus: Optional[dict] = None  # a single data.train_path: corpus_identity
        if cfg.kind == "tokens" and cfg.train_paths is not None:
            self._files, self._blend = _open_blend(cfg, seq_len, vocab_size, seed)
        elif cfg.kind == "tokens":
            corpus = open_corpus(cfg.train_path, cfg.dtype, vocab_size, cfg.eos_id)
            if corpus.flags is not None:
                check_chat_seq_len(corpus, cfg.train_path, seq_len)
            self._files = [_TrainFile(cfg.train_path, corpus.tokens, seq_len,
                                      (_PERM_STREAM, seed), corpus.eos_id, corpus.flags)]
            self.corpus = corpus_identity(corpus)
            n, need = self._files[0].num_windows, micro_batch_size * dp
            if n < need:
                raise DataError(
                    f"data file {cfg.train_path} has {n} windows of "
                    f"{seq_len + 1} tokens, fewer than one global micro-batch "
                    f"(mbs x dp = {micro_batch_size} x {dp} = {need})")
        elif cfg.kind != "synthetic":
            raise DataError(f"data.kind={cfg.kind!r} is not one of synthetic, tokens")
        self.num_windows = sum(f.num_windows for f in self._files)
        self.chat = _chat_framing(cfg, self._files)
        self.masked = self.chat is not None
        self.eos_id = _common_eos(self._files, cfg)
        self.documents = self.chat or eos_documents(cfg, self.eos_id)


    @property
    def epoch(self) -> float:
        """Fractional epochs consumed: samples over the windows of all the training files
        together (one file: passes over it; a blend: see ``file_epochs`` for each file's
        own); 0.0 for synthetic data."""
        return self.consumed / self.num_windows if self.num_windows else 0.0

    @property
    def file_epochs(self) -> list[float]:
        """Fractional epochs of each training file consumed (in a blend, a small or
        heavily weighted file runs ahead of the others)."""
        if self._blend is None:
            return [self.epoch] if self._files else []
        return [c / f.num_windows for c, f in zip(self._blend.counts, self._files)]

    def _samples(self) -> np.ndarray:
        """Global sample indices of this rank's next micro-batch."""
        first = self.consumed + self.dp_rank * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size, dtype=np.int64)

    def _blend_batch(self) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """This rank's slice of the next global micro-batch of the blend (and its flags,
        chat data). Every rank assigns the whole global micro-batch, so the per-file
        counts agree on all ranks."""
        mbs = self.micro_batch_size
        which, local = self._blend.take(mbs * self.dp)
        lo = self.dp_rank * mbs
        which, local = which[lo:lo + mbs], local[lo:lo + mbs]
        x = torch.empty((mbs, self.seq_len), dtype=torch.int64)
        y = torch.empty_like(x)
        flags = None if self.chat is None else \
            torch.empty((mbs, self.seq_len + 1), dtype=torch.uint8)
        for k in np.unique(which):
            sel = which == k
            f = self._files[int(k)]
            rows = torch.from_numpy(np.flatnonzero(sel))
            windows = f.windows(local[sel])
            x[rows], y[rows] = _gather_windows(f.tokens, windows, self.seq_len)
            if flags is not None:
                flags[rows] = gather_flags(f.flags, windows, self.seq_len)
        return x, y, flags

    def next_batch(self) -> Batch:
        """This rank's next ``(x, y)``, each ``(micro_batch_size, seq_len)`` int64, with
        the rows' documents (chat data, ``data.reset_attention_at_eos``; else None)."""
        flags = None
        if self._blend is not None:
            x, y, flags = self._blend_batch()
        elif self._files:
            f = self._files[0]
            windows = f.windows(self._samples())
            x, y = _gather_windows(f.tokens, windows, self.seq_len)
            if self.chat is not None:
                flags = gather_flags(f.flags, windows, self.seq_len)
        else:
            rows = [_rng(_SYNTH_STREAM, self.seed, int(g)).integers(
                0, self.vocab_size, self.seq_len + 1, dtype=np.int64) for g in self._samples()]
            buf = torch.from_numpy(np.stack(rows))  # (mbs, T+1)
            x, y = buf[:, :-1].contiguous(), buf[:, 1:].contiguous()  # (mbs, T) each
        self.consumed += self.micro_batch_size * self.dp
        if self.chat is not None:
            return self.chat.batch(x, y, flags)
        return Batch(x, y, None if self.documents is None else self.documents(x))

    def state_dict(self) -> dict:
        """All that is needed to resume the exact batch sequence: the global count, and
        for a blend each file's path, weight and count."""
        state: dict = {"consumed": self.consumed}
        if self._blend is not None:
            state["blend"] = self._blend.state_dict()
        return state

    def load_state_dict(self, state: Mapping) -> None:
        consumed = state.get("consumed") if isinstance(state, Mapping) else None
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            raise CheckpointError(f"data state {state!r} has no valid 'consumed' count")
        blend = state.get("blend")
        if self._blend is not None and blend is None:
            raise CheckpointError("the checkpoint's data position is not in a blend (it was "
                                  "written with data.train_path or synthetic data) but this run "
                                  "sets data.train_paths; resume with the checkpoint's data")
        if self._blend is None and blend is not None:
            here = f"data.train_path={self._files[0].path}" if self._files else "synthetic data"
            raise CheckpointError(f"the checkpoint's data position is in a blend "
                                  f"(data.train_paths) but this run reads {here}; resume with "
                                  f"the checkpoint's data.train_paths")
        if self._blend is not None:
            self._blend.load_state_dict(blend, consumed)
        self.consumed = consumed


class ValBatches:
    """The first ``num_batches`` global validation batches of a val file, in order.

    Batch ``b`` on DP rank ``r`` holds windows ``(b*dp + r)*mbs + j`` (``j < mbs``):
    contiguous windows from the file's start, so each eval is over exactly the
    same tokens. Open (and scan) the file once and iterate the object at every
    eval; each iteration starts again from the beginning.

    A file whose window count is not a multiple of the global batch (``mbs x dp``)
    ends in a partial batch, one shorter than a whole batch included: its missing
    rows are padding, input id 0 and every target ``IGNORE_INDEX``, so every rank
    runs the same shapes (and collectives) and the padding counts for nothing in the
    token-weighted loss (:func:`oases.runtime.step.evaluate`). Only a file without
    a single window of ``seq_len + 1`` tokens is refused.

    A chat val corpus counts the targets the training data does (:class:`ChatFraming`:
    the training data's, passed as ``documents``, else assistant tokens); chat training
    data with a plain val file is refused.
    """

    def __init__(self, path: PathLike, dtype: str, seq_len: int, vocab_size: int,
                 micro_batch_size: int, dp_rank: int, dp: int, max_batches: int,
                 documents=None) -> None:
        """``documents``: the rows' :class:`Documents` from their ids (:func:`eos_documents`),
        the training data's :class:`ChatFraming` (``TrainBatches.documents``), or None:
        one document per row."""
        _check_layout(seq_len, micro_batch_size, dp_rank, dp)
        self.documents = documents
        if max_batches <= 0:
            raise ValueError(f"max_batches={max_batches} must be > 0")
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp = dp
        corpus = open_corpus(path, dtype, vocab_size)
        self._tokens, self._flags = corpus.tokens, corpus.flags
        self.chat: Optional[ChatFraming] = None
        if corpus.flags is not None:
            check_chat_seq_len(corpus, path, seq_len)
            self.chat = documents if isinstance(documents, ChatFraming) else ChatFraming()
        elif isinstance(documents, ChatFraming):
            raise DataError(f"val file {path} is plain tokens but the training data is chat "
                            f"data: validate on the val split of the chat corpus")
        self.num_windows = max(len(self._tokens) - 1, 0) // seq_len
        if self.num_windows == 0:
            raise DataError(
                f"val file {path} has {len(self._tokens)} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}")
        per_batch = micro_batch_size * dp
        self.num_batches = min(max_batches, -(-self.num_windows // per_batch))  # ceil

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        mbs = self.micro_batch_size
        for b in range(self.num_batches):
            first = (b * self.dp + self.dp_rank) * mbs
            windows = np.arange(first, min(first + mbs, self.num_windows), dtype=np.int64)
            x, y = _gather_windows(self._tokens, windows, self.seq_len)
            pad = mbs - len(windows)
            if pad:  # the partial last batch: padding rows count nothing
                x = torch.cat([x, x.new_zeros(pad, self.seq_len)])
                y = torch.cat([y, y.new_full((pad, self.seq_len), IGNORE_INDEX)])
            if self.chat is not None:
                flags = gather_flags(self._flags, windows, self.seq_len)
                yield self.chat.batch(x, y, torch.cat([flags, flags.new_zeros(
                    pad, self.seq_len + 1)]))
            else:
                yield Batch(x, y, None if self.documents is None else self.documents(x))


def val_batches(path: PathLike, dtype: str, seq_len: int, vocab_size: int,
                micro_batch_size: int, dp_rank: int, dp: int, max_batches: int
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Iterator over this rank's val batches (see :class:`ValBatches`).

    Validation happens here, eagerly, not at the first ``next()``: a bad val file
    should fail at startup, not at the first eval hours in.
    """
    return iter(ValBatches(path, dtype, seq_len, vocab_size, micro_batch_size,
                           dp_rank, dp, max_batches))


def num_val_batches(path: PathLike, dtype: str, seq_len: int, vocab_size: int,
                    micro_batch_size: int, dp: int, max_batches: int) -> int:
    """How many batches :func:`val_batches` yields (the same on every DP rank; the last
    may be partial)."""
    return len(ValBatches(path, dtype, seq_len, vocab_size, micro_batch_size,
                          0, dp, max_batches))
