"""Chat data's batches (``oases.prepare --chat``): the per-token flags of a window
(:mod:`oases.runtime.tokens`) make its targets that count and its documents."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import torch

from oases.errors import DataError
from oases.models.documents import Documents
from oases.parallel.batch import Batch
from oases.parallel.loss import IGNORE_INDEX
from oases.runtime.tokens import FLAG_COUNTS, FLAG_PAD, FLAG_START, Corpus

PathLike = Union[str, Path]


def gather_flags(flags, windows: np.ndarray, seq_len: int) -> torch.Tensor:
    """The (B, T+1) uint8 flags of the windows' tokens (chat data)."""
    offsets = windows.astype(np.int64)[:, None] * seq_len + np.arange(seq_len + 1)
    return torch.from_numpy(np.asarray(flags[offsets], dtype=np.uint8))


@dataclass(frozen=True)
class ChatFraming:
    """How chat data's flags become a batch: which targets count (``loss_on``:
    ``assistant`` or ``all``, ``data.loss_on``) and whether positions restart at each
    document (``data.reset_position_ids``)."""

    loss_on: str = "assistant"
    reset_positions: bool = False

    def batch(self, x: torch.Tensor, y: torch.Tensor, flags: torch.Tensor) -> Batch:
        """``x``, ``y`` (B, T) and the window's flags (B, T+1) -> the Batch: ``y[t]``
        kept where token t+1 counts and does not start a document."""
        nxt = flags[:, 1:]
        keep = (nxt & FLAG_START) == 0
        keep &= ((nxt & FLAG_COUNTS) != 0) if self.loss_on == "assistant" else \
            ((nxt & FLAG_PAD) == 0)
        docs = Documents.from_starts((flags[:, :-1] & FLAG_START) != 0, self.reset_positions)
        return Batch(x, y.masked_fill(~keep, IGNORE_INDEX), docs)


def check_chat_seq_len(corpus: Corpus, path: PathLike, seq_len: int) -> None:
    """A chat corpus's rows line up with the training windows only at its own seq_len."""
    packed = corpus.chat.get("seq_len")
    if packed != seq_len:
        raise DataError(f"chat corpus {path} was packed into rows of {packed} tokens "
                        f"(meta.json chat.seq_len) but model.seq_len={seq_len}; prepare it "
                        f"again with --seq-len {seq_len}")
