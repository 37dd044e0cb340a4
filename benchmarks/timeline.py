"""Render per-rank event traces (``parallel.trace=true``) as a timeline PNG.

    python -m benchmarks.timeline runs/x/trace_rank*.json --out timeline.png [--title T]

What the rows and colours mean: :mod:`benchmarks.lib.timeline`.
The traces are also plain Chrome trace JSON (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.lib.timeline import render


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
