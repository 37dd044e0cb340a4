"""``python -m oases.schedule``: print a pipeline schedule, its simulated timeline,
bubble fraction and activations in flight, to compare schedules before running one.

    python -m oases.schedule --pp 4 --microbatches 8 --kind eager-1f1b --comm 0.5
    python -m oases.schedule --pp 2 --microbatches 4 --p2p    # + the p2p order per stage pair

``--p2p`` prints, per pair of neighbouring stages and per direction, the order in
which each side issues its sends and receives on that direction's process group
(the order NCCL runs them in), and checks that it cannot deadlock.

Bad arguments print ``error: <one line>`` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from oases.errors import EXIT_USER_ERROR
from oases.pipeline.actions import (KINDS, format_actions, format_timeline, pipeline_actions,
                                    simulate)
from oases.pipeline.p2p import format_p2p


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m oases.schedule",
                                 description="Print and simulate a pipeline schedule.")
    ap.add_argument("--pp", type=int, required=True, help="pipeline stages")
    ap.add_argument("--microbatches", type=int, required=True)
    # No argparse choices: the schedule module validates the kind, so the CLI
    # and library callers get the same one-line message.
    ap.add_argument("--kind", default="1f1b", help=f"one of {', '.join(KINDS)} (default 1f1b)")
    ap.add_argument("--f", type=float, default=1.0, help="forward time of one micro-batch")
    ap.add_argument("--b", type=float, default=2.0, help="backward time of one micro-batch")
    ap.add_argument("--comm", type=float, default=0.0, help="time of one stage-to-stage transfer")
    ap.add_argument("--overlap-fb", action="store_true",
                    help="fuse each B with the F after it (parallel.overlap_fb)")
    ap.add_argument("--p2p", action="store_true",
                    help="print each stage pair's point-to-point order and check it for NCCL")
    ap.add_argument("--width", type=int, default=72, help="timeline width in characters")
    args = ap.parse_args(argv)
    try:
        actions = pipeline_actions(args.kind, args.pp, args.microbatches, args.overlap_fb)
        timeline = simulate(actions, args.f, args.b, args.comm, fused=args.overlap_fb)
        chart = format_timeline(timeline, args.width)
        p2p = format_p2p(actions, args.overlap_fb) if args.p2p else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"{args.kind}{' + overlap_fb' if args.overlap_fb else ''}, pp={args.pp}, microbatches={args.microbatches}, "
          f"f={args.f:g}, b={args.b:g}, comm={args.comm:g}")
    print(format_actions(actions))
    print()
    print(chart)
    print()
    print(f"makespan {timeline.makespan:g}, bubble fraction {timeline.bubble_fraction:.3f}")
    print("peak in-flight micro-batches per stage: "
          + " ".join(f"{s}:{n}" for s, n in enumerate(timeline.peak_inflight)))
    if p2p:
        print()
        print(p2p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
