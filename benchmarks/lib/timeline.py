"""Per-rank event traces (``parallel.trace=true``): drawn as a timeline PNG, and summed.

One row pair per rank: compute segments (the oases engine's sub-batch a blue, b
orange; the megatron engine's forward grey, backward dark grey)
and collectives (green; their overlap with compute is the hidden communication).
A pipelined run's trace also has a "pipeline" lane (oases.pipeline.runner): it is
drawn as a third row per rank, forwards ``F<m>`` light blue, backwards ``B<m>``
light orange, a zero-bubble schedule's weight gradients ``W<m>`` plum (labelled with
their micro-batch), waits for a transfer (``wait F<m>``,
``wait B<m>``) red and the end-of-step ``wait sends`` purple; the white gaps of that
row are the rank's pipeline bubble. Traces without that lane draw as before.
The traces are also plain Chrome trace JSON (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def _color(name: str, cat: str) -> str:
    if cat == "comm":
        return "tab:green"
    tag = name.split()[0] if name else ""
    # the oases engine's spans: "Fa ...", "Rb ...", "Ba ..." (phase, sub-batch)
    if len(tag) == 2 and tag[1] == "a":
        return "tab:blue"
    if len(tag) == 2 and tag[1] == "b":
        return "tab:orange"
    if tag in ("backward", "B"):  # the megatron engine: "forward", "backward", "F 3", "B 3"
        return "dimgray"
    return "tab:gray"


def _pipeline_color(name: str) -> str:
    if name.startswith("wait sends"):
        return "tab:purple"
    if name.startswith("wait"):
        return "tab:red"
    if name[:1] == "F":
        return "lightskyblue"
    if name[:1] == "B":
        return "navajowhite"
    if name[:1] == "W":
        return "plum"
    return "lightgray"


def render(paths: list[Path], out: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [json.loads(Path(p).read_text())["traceEvents"] for p in paths]
    piped = any(e.get("tid") == "pipeline" for ev in traces for e in ev)
    lanes = ("pipeline", "compute", "comm") if piped else ("compute", "comm")
    pitch = len(lanes) + 0.5
    fig, ax = plt.subplots(figsize=(14 if not piped else 16,
                                    1.2 + (1.0 if not piped else 1.35) * len(traces)))
    t_end = max((e["ts"] + e["dur"]) / 1e3 for ev in traces for e in ev) if any(traces) else 1.0
    yticks, ylabels = [], []
    for r, events in enumerate(traces):
        for lane_i, lane in enumerate(lanes):
            y = (len(traces) - 1 - r) * pitch + (len(lanes) - 1 - lane_i)
            if lane == "pipeline":
                spans = [(e["ts"] / 1e3, e["dur"] / 1e3, _pipeline_color(e["name"]), e["name"])
                         for e in events if e["tid"] == lane]
            else:
                spans = [(e["ts"] / 1e3, e["dur"] / 1e3, _color(e["name"], e["cat"]), "")
                         for e in events if e["tid"] == lane]
            for t0, d, c, label in spans:
                ax.broken_barh([(t0, d)], (y, 0.8), facecolors=c, edgecolor="black",
                               linewidth=0.2)
                # label F<m>/B<m>/W<m> where the bar is wide enough to hold it
                if label[:1] in ("F", "B", "W") and d > 0.012 * t_end:
                    ax.text(t0 + d / 2, y + 0.4, label, ha="center", va="center", fontsize=7)
            yticks.append(y + 0.4)
            ylabels.append(f"rank {r} {lane}")
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("ms since step start")
    default = "per-rank timeline (blue: sub-batch a, orange: b, green: all-reduce)"
    if piped:
        default = ("per-rank timeline (pipeline row: F light blue, B light orange, red: wait "
                   "for a transfer, purple: wait sends; compute row: blue sub-batch a, orange b; "
                   "green: all-reduce)")
    ax.set_title(title or default, fontsize=10 if piped else None)
    if piped:
        from matplotlib.patches import Patch

        legend = [("F<m>", "lightskyblue"), ("B<m>", "navajowhite"), ("W<m>", "plum"),
                  ("wait for a transfer", "tab:red"), ("wait sends", "tab:purple"),
                  ("sub-batch a", "tab:blue"), ("sub-batch b", "tab:orange"),
                  ("forward / backward (megatron)", "tab:gray"), ("all-reduce", "tab:green")]
        ax.legend(handles=[Patch(facecolor=c, edgecolor="black", label=n) for n, c in legend],
                  loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=len(legend),
                  fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def slug(mode: str) -> str:
    """A mode's name as a file name."""
    return mode.replace(":", "-").replace("+", "-")


def render_timelines(runs: list[dict], out_dir: Path, prefix: str, multi: bool) -> dict:
    """The first traced run of each (cluster and) mode drawn to
    ``<out_dir>/<prefix>[<cluster>-]<mode>.png``, titled with the stages train.py
    printed (the run's ``layout``); returns key -> PNG."""
    out = {}
    for r in runs:
        key = f"{r['cluster']} {r['mode']}" if multi else r["mode"]
        if not r.get("traces") or key in out:
            continue
        png = out_dir / (f"{prefix}{r['cluster']}-{slug(r['mode'])}.png" if multi
                         else f"{prefix}{slug(r['mode'])}.png")
        try:
            stages = r.get("layout") or "ranks 0-1 = stage 0, ranks 2-3 = stage 1"
            render([Path(p) for p in r["traces"]], png,
                   f"{r['mode']} on {r['cluster']}: one step (step 3); {stages}")
            out[key] = str(png)
        except Exception as e:  # a chart must not lose the numbers
            print(f"warning: timeline of {key}: {type(e).__name__}: {e}", file=sys.stderr)
    return out


def trace_stats(paths: list[str]) -> dict:
    """Per rank: ms in F, B, waits for transfers, wait sends, and the step span."""
    out = {}
    for p in paths:
        ev = json.loads(Path(p).read_text())["traceEvents"]
        pl = [e for e in ev if e.get("tid") == "pipeline"]
        if not pl:
            continue
        r = int(re.search(r"rank(\d+)", p).group(1))
        agg: dict = {"F": 0.0, "B": 0.0, "wait_F": 0.0, "wait_B": 0.0, "wait_sends": 0.0}
        for e in pl:
            n = e["name"]
            k = ("wait_sends" if n.startswith("wait sends") else
                 f"wait_{n.split()[1][0]}" if n.startswith("wait") else n[0])
            agg[k] = agg.get(k, 0.0) + e["dur"] / 1e3
        agg["span"] = max(e["ts"] + e["dur"] for e in pl) / 1e3
        comm = [e for e in ev if e.get("cat") == "comm"]
        agg["comm_ms"] = sum(e["dur"] for e in comm) / 1e3
        out[r] = {k: round(v, 1) for k, v in agg.items()}
    return out
