"""PNGs of plans: the TP degree of every block, and a pipeline's stages.

matplotlib is imported lazily (Agg backend); each function returns False when it
is missing, so a plan is still written without its picture.
"""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    try:
        import matplotlib  # deferred: slow to import, and only figures need it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # deferred: as matplotlib
    except ImportError:
        return None
    return plt


def plot_degrees(degrees: list[int], kinds: list[str], path: Path, title: str) -> bool:
    """One bar per block, its height the degree (pp = 1 plans of ``--search tp-only``)."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(degrees) + 2), 3))
    colors = ["tab:blue" if k == "attn" else "tab:orange" for k in kinds]
    ax.bar(range(len(degrees)), degrees, color=colors)
    ax.set_xlabel("block (blue: attention, orange: MLP)")
    ax.set_ylabel("TP degree")
    ax.set_yscale("log", base=2)
    ax.set_yticks(sorted(set(degrees)), [str(d) for d in sorted(set(degrees))])
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_stages(stages: list[dict], path: Path, title: str) -> bool:
    """Blocks left to right (attn, mlp of each layer), one row per stage, coloured by
    TP degree; dashed lines at the stage boundaries, each stage labelled dp x tp."""
    plt = _pyplot()
    if plt is None:
        return False
    from matplotlib import patheffects  # deferred: as _pyplot
    from matplotlib.patches import Patch  # deferred: as _pyplot

    per_stage = [st.get("degrees") or [st["tp"]] * 2 * (st["layers"][1] - st["layers"][0])
                 for st in stages]
    n_blocks = 2 * stages[-1]["layers"][1]
    levels = sorted({d for degs in per_stage for d in degs})
    cmap = plt.get_cmap("viridis", max(2, len(levels)))
    color = {d: cmap(i) for i, d in enumerate(levels)}
    fig, ax = plt.subplots(figsize=(min(24, max(6, 0.12 * n_blocks + 3)), 1.0 + 0.5 * len(stages)))
    for p, (st, degs) in enumerate(zip(stages, per_stage)):
        first = 2 * st["layers"][0]
        row = len(stages) - 1 - p  # stage 0 on top
        ax.bar([first + j + 0.5 for j in range(len(degs))], [0.8] * len(degs), width=1.0,
               bottom=row + 0.1, color=[color[d] for d in degs], edgecolor="white", linewidth=0.3)
        ax.text(first, row + 0.5, f" stage {p}: dp {st['dp']} x tp {st['tp']}", va="center",
                fontsize=8, color="white",
                path_effects=[patheffects.withStroke(linewidth=2, foreground="black")])
        if p:
            ax.axvline(first, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(0, n_blocks)
    ax.set_ylim(0, len(stages))
    ax.set_yticks([])
    ax.set_xlabel("block (attention, MLP of each layer)")
    ax.legend(handles=[Patch(color=color[d], label=f"degree {d}") for d in levels],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
