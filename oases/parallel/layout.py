"""The parallel layout of a run: pipeline stages, each with its own dp x tp mesh.

    world 8, pp 2, default:      stage 0: layers [0, n/2)  dp 2 x tp 2   ranks 0-3
                                 stage 1: layers [n/2, n)  dp 2 x tp 2   ranks 4-7
    world 8, pp 2, from a plan:  stage 0: layers [0, 5)    dp 1 x tp 4   ranks 0-3
                                 stage 1: layers [5, 8)    dp 2 x tp 2   ranks 4-7

Stage s owns the consecutive ranks ``first_s .. first_s + dp_s*tp_s - 1`` (stages
in order, each world/pp ranks), and inside it ``rank = first_s + dp_rank*tp_s +
tp_rank`` as at pp=1, so a TP group stays inside a node and a stage boundary is
where the pipeline crosses the slow links. A stage may give each of its blocks
its own TP degree (``degrees``: attn, mlp of each of its layers).

This is the one description of a layout: the group builder
(:func:`oases.parallel.groups.build_pipeline_context`), the model (which layers a
rank builds), the pipeline runtime and checkpoints read it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from oases.errors import ConfigError


@dataclass(frozen=True)
class StageLayout:
    layers: tuple[int, int]                   # transformer layers [start, stop)
    dp: int
    tp: int
    first: int                                # first global rank of the stage
    degrees: Optional[tuple[int, ...]] = None  # per block (2 per layer); None: all at tp

    @property
    def size(self) -> int:
        return self.dp * self.tp

    @property
    def ranks(self) -> range:
        return range(self.first, self.first + self.size)

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of a global rank of this stage."""
        return divmod(rank - self.first, self.tp)


@dataclass(frozen=True)
class PipelineLayout:
    stages: tuple[StageLayout, ...]

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def world(self) -> int:
        return sum(s.size for s in self.stages)

    def stage_of(self, rank: int) -> int:
        for i, s in enumerate(self.stages):
            if rank in s.ranks:
                return i
        raise ValueError(f"rank {rank} is outside the layout's {self.world} ranks")

    def chunks(self, stage: int, virtual: int) -> tuple[tuple[int, int], ...]:
        """The layers [a, b) of each of ``stage``'s ``virtual`` chunks (interleaved-1f1b):
        the model's layers as pp x virtual equal stages, chunk c being virtual stage
        c * pp + stage (Megatron's). Raises ConfigError for a layout that is not that:
        stages of another split (a plan's) or blocks below their stage's TP degree."""
        n = self.stages[-1].layers[1]
        if n % (self.pp * virtual):
            raise ConfigError(f"{n} layers do not divide into pp={self.pp} x "
                              f"pp_virtual={virtual} equal chunks")
        for i, (s, even) in enumerate(zip(self.stages, even_split(n, self.pp))):
            if s.layers != even or (s.degrees is not None and set(s.degrees) != {s.tp}):
                raise ConfigError(
                    f"interleaved-1f1b runs each stage's layers as {virtual} equal chunks at "
                    f"the stage's TP degree; stage {i} has layers {s.layers[0]}-"
                    f"{s.layers[1] - 1}" + (f" at degrees {list(s.degrees)}"
                                            if s.degrees is not None else "")
                    + f" (the even split gives {even[0]}-{even[1] - 1})")
        per = n // (self.pp * virtual)
        return tuple((g * per, (g + 1) * per) for g in range(stage, self.pp * virtual, self.pp))

    def describe(self, virtual: int = 1) -> str:
        """One line; ``virtual`` > 1 (interleaved-1f1b): each rank's chunks of layers, the
        pp x virtual equal stages, chunk c of stage i being virtual stage c * pp + i."""
        def layers(i: int, s: StageLayout) -> str:
            if virtual == 1:
                return f"{s.layers[0]}-{s.layers[1] - 1}"
            return ", ".join(f"{a}-{b - 1}" for a, b in self.chunks(i, virtual))
        return " | ".join(f"stage {i}: layers {layers(i, s)} dp {s.dp} x tp {s.tp}"
                          for i, s in enumerate(self.stages))


def even_split(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Layers split as evenly as possible; the earlier stages take the remainder (the
    last stage also runs the head and the loss)."""
    base, extra = divmod(n_layer, pp)
    out, a = [], 0
    for s in range(pp):
        b = a + base + (1 if s < extra else 0)
        out.append((a, b))
        a = b
    return out


def uniform_layout(world: int, pp: int, tp: int, n_layer: int,
                   degrees: Optional[list[int]] = None) -> PipelineLayout:
    """pp stages of dp x tp ranks each (dp = world / (pp tp)), layers split evenly;
    ``degrees`` (per block of the whole model) are cut along the same layer ranges."""
    dp = world // (pp * tp)
    stages = []
    for s, (a, b) in enumerate(even_split(n_layer, pp)):
        d = tuple(degrees[2 * a: 2 * b]) if degrees is not None else None
        stages.append(StageLayout((a, b), dp, tp, s * dp * tp, d))
    return PipelineLayout(tuple(stages))


def stages_layout(stages: list[dict], world: int, n_layer: int, where: str,
                  micro_batch_rows: int) -> PipelineLayout:
    """A layout from a plan file's ``stages`` (a list of ``{layers: [a, b], dp, tp,
    degrees?}``); every mistake is a :class:`ConfigError` that names it."""
    pp = len(stages)
    if pp == 0 or world % pp:
        raise ConfigError(f"{where}: {pp} stages do not divide the world size {world}")
    per_stage = world // pp
    out, expect = [], 0
    for s, st in enumerate(stages):
        if not isinstance(st, dict) or not {"layers", "dp", "tp"} <= set(st):
            raise ConfigError(f"{where}: stage {s} needs layers: [start, stop], dp and tp")
        unknown = sorted(set(st) - {"layers", "dp", "tp", "degrees"})
        if unknown:
            raise ConfigError(f"{where}: stage {s} has unknown keys: {', '.join(unknown)}")
        lay, dp, tp = st["layers"], st["dp"], st["tp"]
        if not (isinstance(lay, list) and len(lay) == 2 and all(isinstance(v, int) for v in lay)):
            raise ConfigError(f"{where}: stage {s} layers must be [start, stop], got {lay!r}")
        a, b = lay
        if a != expect or b <= a:
            raise ConfigError(f"{where}: stage {s} has layers [{a}, {b}); the stages must cover "
                              f"layers 0..{n_layer - 1} in order without gaps (expected a range "
                              f"starting at {expect})")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (dp, tp)):
            raise ConfigError(f"{where}: stage {s} dp and tp must be positive integers")
        if dp * tp != per_stage:
            raise ConfigError(f"{where}: stage {s} has dp {dp} x tp {tp} = {dp * tp} ranks; "
                              f"every stage must have world / pp = {per_stage}")
        if micro_batch_rows % dp:
            raise ConfigError(f"{where}: stage {s} has dp {dp}, which does not divide the "
                              f"pipeline micro-batch of {micro_batch_rows} sequences")
        deg = st.get("degrees")
        if deg is not None:
            if not (isinstance(deg, list) and all(isinstance(t, int) for t in deg)):
                raise ConfigError(f"{where}: stage {s} degrees must be a list of integers")
            if len(deg) != 2 * (b - a):
                raise ConfigError(f"{where}: stage {s} has {len(deg)} degrees for {2 * (b - a)} "
                                  f"blocks (attn and mlp of layers {a}-{b - 1})")
            deg = tuple(deg)
        out.append(StageLayout((a, b), dp, tp, s * per_stage, deg))
        expect = b
    if expect != n_layer:
        raise ConfigError(f"{where}: the stages cover layers 0..{expect - 1} but the model has "
                          f"{n_layer} layers")
    return PipelineLayout(tuple(out))
