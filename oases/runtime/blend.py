"""Data blends: training samples drawn from several token files in set proportions.

``data.train_paths`` lists token files with weights ``w_k`` (normalised to sum 1).
As in Megatron's ``BlendedDataset``, a blend is a deterministic function of the
global sample index ``g`` that :class:`~oases.runtime.data.TrainBatches` walks:
sample ``g`` comes from file ``k(g)``, and is that file's ``c``-th sample, where
``c`` counts the earlier samples taken from the same file. Each file turns its own
sample counter into windows through its own permutation per epoch (see
``oases.runtime.data``), so a small file wraps around to its next epoch on its own
while a large one is still in its first.

**Which file.** Megatron picks the file whose count lags its share the most
(the largest ``w_k g - c_k``). That keeps two files within one sample of their
shares, but with three or more a file can fall more than a sample behind. oases
uses the same greedy idea with Tijdeman's refinement (the "chairman assignment"
algorithm, 1980), which bounds every file's error below one sample: with ``K``
files, ``c_k`` samples taken so far and ``t = g + 1``, the *candidates* are the
files with ``w_k t - c_k >= d``, ``d = 1 / (2K - 2)``, and the one chosen is the
candidate whose next sample falls due first (the least ``(c_k + 1 - d) / w_k``;
ties go to the lower index). After any ``n`` samples, every file has had
``w_k n`` samples to within ``1 - d`` (a half for two files, 0.75 for three).

**State.** The choice depends only on the weights and the counts, so the ``K``
counts are all a resume needs: a checkpoint stores them with each file's path and
weight (a few numbers, whatever the corpus size), and resuming under another
blend is refused, since it would silently change the data mix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from oases.errors import CheckpointError

# Two runs' weights are the same blend when they agree to this relative tolerance (a
# config that writes 0.3/0.7 as 3/7 normalises to the same floats within an ulp or two).
_WEIGHT_RTOL = 1e-9


class Blend:
    """Which file each global training sample comes from (see the module docstring).

    ``take(n)`` hands out the next ``n`` global samples and advances the counts; every
    DP rank calls it for the whole global micro-batch (so the counts stay identical on
    every rank) and keeps its own slice.
    """

    def __init__(self, paths: Sequence[str], weights: Sequence[float]) -> None:
        if not paths or len(paths) != len(weights) or min(weights) <= 0:
            raise ValueError(f"a blend needs files with weights > 0, got {paths}, {weights}")
        total = math.fsum(weights)
        self.paths = tuple(str(p) for p in paths)
        self.weights = tuple(float(w) / total for w in weights)
        self.counts = [0] * len(paths)
        k = len(paths)
        # How far ahead of its due time a file may be picked; 0 for a single file.
        self._lead = 1.0 / (2 * k - 2) if k > 1 else 0.0

    @property
    def consumed(self) -> int:
        """Samples handed out so far (all files together)."""
        return sum(self.counts)

    def _choose(self, t: int) -> int:
        """The file of the ``t``-th sample (1-based), from the counts before it.

        The lags ``w_k t - c_k`` sum to 1 (the counts sum to ``t - 1``), so some lag is
        at least ``1/K >= d`` and there is always a candidate; the fallback to the
        largest lag only guards against rounding.
        """
        best, due = -1, math.inf
        for k, (w, c) in enumerate(zip(self.weights, self.counts)):
            if w * t - c >= self._lead:
                when = (c + 1 - self._lead) / w
                if when < due:
                    best, due = k, when
        if best < 0:
            lags = [w * t - c for w, c in zip(self.weights, self.counts)]
            best = lags.index(max(lags))
        return best

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``n`` global samples as ``(file index, that file's sample index)``
        arrays, advancing the counts."""
        files = np.empty(n, dtype=np.int64)
        local = np.empty(n, dtype=np.int64)
        t = self.consumed
        for i in range(n):
            t += 1
            k = self._choose(t)
            files[i], local[i] = k, self.counts[k]
            self.counts[k] += 1
        return files, local

    def describe(self) -> str:
        return ", ".join(f"{p} (weight {w:.6g})" for p, w in zip(self.paths, self.weights))

    def state_dict(self) -> list[dict]:
        """Per file: its path, its normalised weight and the samples taken from it."""
        return [{"path": p, "weight": w, "consumed": c}
                for p, w, c in zip(self.paths, self.weights, self.counts)]

    def load_state_dict(self, entries, consumed: int) -> None:
        """Restore the counts of a blend with the same files and weights, whose counts
        add up to the data state's ``consumed``; anything else is a CheckpointError and
        leaves the counts untouched."""
        if not isinstance(entries, list) or not all(
                isinstance(e, Mapping) and isinstance(e.get("path"), str)
                and _is_number(e.get("weight")) and _is_count(e.get("consumed"))
                for e in entries):
            raise CheckpointError(f"data state has a malformed blend {entries!r}")
        saved = [(e["path"], float(e["weight"])) for e in entries]
        same = len(saved) == len(self.paths) and all(
            p == q and math.isclose(w, v, rel_tol=_WEIGHT_RTOL)
            for (p, w), q, v in zip(saved, self.paths, self.weights))
        if not same:
            was = ", ".join(f"{p} (weight {w:.6g})" for p, w in saved)
            raise CheckpointError(f"the checkpoint's data blend is {was} but data.train_paths "
                                  f"is {self.describe()}; resume with the checkpoint's blend "
                                  f"(a new blend needs a new out_dir)")
        counts = [int(e["consumed"]) for e in entries]
        if sum(counts) != consumed:
            raise CheckpointError(f"data state's blend counts {counts} add up to {sum(counts)}, "
                                  f"not its consumed count {consumed}")
        self.counts = counts


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
