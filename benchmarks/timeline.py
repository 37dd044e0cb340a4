"""Render per-rank event traces (``parallel.trace=true``) as a timeline PNG.

    python benchmarks/timeline.py runs/x/trace_rank*.json --out timeline.png [--title T]

One row pair per rank: compute segments (sub-batch a blue, b orange, other grey)
and collectives (green; their overlap with compute is the hidden communication).
The traces are also plain Chrome trace JSON (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _color(name: str, cat: str) -> str:
    if cat == "comm":
        return "tab:green"
    tag = name.split()[0] if name else ""
    if tag[1:2] == "a":
        return "tab:blue"
    if tag[1:2] == "b":
        return "tab:orange"
    return "tab:gray"


def render(paths: list[Path], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [json.loads(Path(p).read_text())["traceEvents"] for p in paths]
    fig, ax = plt.subplots(figsize=(14, 1.2 + 1.0 * len(traces)))
    yticks, ylabels = [], []
    for r, events in enumerate(traces):
        for lane_i, lane in enumerate(("compute", "comm")):
            y = (len(traces) - 1 - r) * 2.5 + (1 - lane_i)
            spans = [(e["ts"] / 1e3, e["dur"] / 1e3, _color(e["name"], e["cat"]))
                     for e in events if e["tid"] == lane]
            for t0, d, c in spans:
                ax.broken_barh([(t0, d)], (y, 0.8), facecolors=c, edgecolor="black",
                               linewidth=0.2)
            yticks.append(y + 0.4)
            ylabels.append(f"rank {r} {lane}")
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("ms since step start")
    ax.set_title(title or "per-rank timeline (blue: sub-batch a, orange: b, green: all-reduce)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--title", default="")
    a = p.parse_args()
    render(sorted(a.traces), a.out, a.title)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
