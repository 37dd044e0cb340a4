"""``python -m oases.schedule``: print a pipeline schedule, its simulated timeline,
bubble fraction and activations in flight, to compare schedules before running one.

    python -m oases.schedule --pp 4 --microbatches 8 --kind eager-1f1b --comm 0.5
    python -m oases.schedule --pp 2 --microbatches 4 --p2p    # + the p2p order per stage pair
    python -m oases.schedule --pp 4 --microbatches 8 --kind zb-h1 --b 1 --w 1
    python -m oases.schedule --pp 4 --microbatches 8 --kind interleaved-1f1b --virtual 2

``--b`` is the backward's time and ``--w`` its weight-gradient part: a schedule with W
actions (zb-h1, eager-zb-h1) runs B for ``b`` and W for ``w``, one without runs B for
``b + w``, so one set of times compares every kind. Without ``--w``, a schedule with W
splits ``--b`` in half (the header shows the times used).

``--p2p`` prints, per pair of neighbouring stages and per direction, the order in
which each side issues its sends and receives on that direction's process group
(the order NCCL runs them in), and checks that it cannot deadlock.

Bad arguments print ``error: <one line>`` on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

from oases.errors import EXIT_USER_ERROR
from oases.pipeline.actions import format_actions, format_timeline, simulate
from oases.pipeline.p2p import format_p2p
from oases.pipeline.schedules import KINDS, SPLIT_KINDS, pipeline_actions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m oases.schedule",
                                 description="Print and simulate a pipeline schedule.")
    ap.add_argument("--pp", type=int, required=True, help="pipeline stages")
    ap.add_argument("--microbatches", type=int, required=True)
    # No argparse choices: the schedule module validates the kind, so the CLI
    # and library callers get the same one-line message.
    ap.add_argument("--kind", default="1f1b", help=f"one of {', '.join(KINDS)} (default 1f1b)")
    ap.add_argument("--f", type=float, default=1.0, help="forward time of one micro-batch")
    ap.add_argument("--b", type=float, default=2.0, help="backward time of one micro-batch "
                    "(its input-gradient part under zb-h1, eager-zb-h1)")
    ap.add_argument("--w", type=float, default=None,
                    help="weight-gradient time: W's under zb-h1 and eager-zb-h1, added to B "
                    "elsewhere (default: half of --b under zb-h1, eager-zb-h1, else 0)")
    ap.add_argument("--virtual", type=int, default=1,
                    help="stages per rank (interleaved-1f1b; default 1)")
    ap.add_argument("--comm", type=float, default=0.0, help="time of one stage-to-stage transfer")
    ap.add_argument("--overlap-fb", action="store_true",
                    help="fuse each B with the F after it (parallel.overlap_fb)")
    ap.add_argument("--p2p", action="store_true",
                    help="print each stage pair's point-to-point order and check it for NCCL")
    ap.add_argument("--width", type=int, default=72, help="timeline width in characters")
    args = ap.parse_args(argv)
    b, w = args.b, args.w
    if w is None:
        b, w = (b / 2, b / 2) if args.kind in SPLIT_KINDS else (b, 0.0)
    try:
        actions = pipeline_actions(args.kind, args.pp, args.microbatches, args.overlap_fb,
                                   args.virtual)
        timeline = simulate(actions, args.f, b, args.comm, fused=args.overlap_fb, w_cost=w)
        chart = format_timeline(timeline, args.width)
        p2p = format_p2p(actions, args.overlap_fb) if args.p2p else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    virtual = f", virtual={args.virtual}" if args.virtual > 1 else ""
    times = f"b={b:g}, w={w:g}" if w else f"b={b:g}"
    print(f"{args.kind}{' + overlap_fb' if args.overlap_fb else ''}, pp={args.pp}{virtual}, "
          f"microbatches={args.microbatches}, f={args.f:g}, {times}, comm={args.comm:g}")
    print(format_actions(actions))
    print()
    print(chart)
    print()
    print(f"makespan {timeline.makespan:g}, bubble fraction {timeline.bubble_fraction:.3f}")
    print("peak in-flight micro-batches per stage: "
          + " ".join(f"{s}:{n}" for s, n in enumerate(timeline.peak_inflight)))
    if args.kind in SPLIT_KINDS:
        print("peak micro-batches between F and W per stage: "
              + " ".join(f"{s}:{n}" for s, n in enumerate(timeline.peak_stashed)))
    if p2p:
        print()
        print(p2p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
