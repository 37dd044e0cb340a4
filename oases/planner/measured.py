"""What the planner's cost model reads of a measured profile (oases.planner.profile
measures it), and the same profile on a device of another speed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Profile:
    """Measured costs. ``blocks[kind][t] = {"fwd": s, "bwd": s, "saved": bytes}`` per
    *sub-batch* at degree t (rows = micro_batch / sub_batches * t / T); ``constant``:
    ``{"fwd": s, "bwd": s}`` per micro-batch for embedding + head + loss, ``"step"`` per
    optimizer step, ``"peak": bytes`` of the head's transient (logits, loss)."""
    blocks: dict
    constant: dict
    comm: dict = field(default_factory=dict)   # measured collective fits (CommModel)


_CONSTANT_TIMES = ("fwd", "bwd", "step", "head_fwd", "embed_bwd")  # Profile.constant's seconds


def at_speed(profile: Profile, speed: float) -> Profile:
    """The profile as a device ``speed`` times the profiled one's would measure it:
    compute seconds / speed; bytes and collectives (the links' business) unchanged."""
    if speed == 1.0:
        return profile
    blocks = {k: {t: {**e, "fwd": e["fwd"] / speed, "bwd": e["bwd"] / speed}
                  for t, e in per.items()} for k, per in profile.blocks.items()}
    const = {k: v / speed if k in _CONSTANT_TIMES else v for k, v in profile.constant.items()}
    return Profile(blocks, const, profile.comm)
