"""Train a GPT/LLaMA-like model (``train.py``, ``oases train``): the parallel layout is the
config's (``parallel.*``: tp, pp, per-block degrees, ZeRO, SP), dp = world / (pp x tp).

    torchrun --standalone --nproc_per_node=2 train.py --config configs/gpt-tiny.yaml [key.sub=value ...]

Bad input (config, data, checkpoint, out_dir) prints one line and exits with
status 2; ``debug=true`` shows the traceback. A run that cannot go on prints one
line too: status 3 for a non-finite loss or gradient with
``train.on_nonfinite=stop``, status 4 for a collective that failed or timed out
(``parallel.timeout_s``: a peer rank died or hangs), status 5 after SIGTERM or
SIGUSR1 (the step in progress finished and a checkpoint was saved; ``resume=auto``
continues), status 6 for a checkpoint that could not be written (disk full, an I/O
error; ``latest`` still names the last complete one). (Under torchrun the workers
exit with these and torchrun reports their failure with its own status 1, or
restarts them with ``--max-restarts``; ``python -m oases.config`` checks a config
with status 2 before launching.)

An error every rank meets alike (config, data, checkpoint, a non-finite step, a failed
save) is printed by rank 0.
Under torchrun the agent stops all workers as soon as one exits with a failure, so a
rank that exited at once could have a rank 0 that is a little behind killed before it
prints: no line at all. The other ranks therefore stay until the agent stops them (rank
0's exit makes it do so), and print the line themselves, with their rank, only if that
has not happened within ``PEER_REPORT_GRACE_S``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from oases.errors import (EXIT_USER_ERROR, CheckpointError, CheckpointWriteError, CollectiveError,
                          ConfigError, DataError, NonFiniteError, Preempted, TrainingError,
                          UserError)
from oases.progress import rank, under_torchrun

# How long a rank other than 0 waits, after an error every rank meets, for the agent to
# stop it once rank 0 has reported: longer than ranks drift apart at start-up (imports,
# data files on a slow disk; 8 s has been seen), short enough for a rank 0 that does not
# meet the error (a data file one node lacks) to be told about promptly.
PEER_REPORT_GRACE_S = 30.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="train.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    debug = any(o.replace(" ", "") in ("debug=true", "debug=True", "debug=1")
                for o in args.overrides)
    try:
        # deferred: a bad config fails in a fraction of a second, before torch is imported
        from oases.config import load_config

        cfg = load_config(args.config, args.overrides)
        debug = cfg.debug
        cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))  # before torch is even imported
        from oases.runtime.trainer import run  # deferred: torch, after the config is known good

        run(cfg)
    except UserError as e:
        if debug:
            raise
        report("error", e, alike=isinstance(e, (ConfigError, DataError, CheckpointError)))
        return EXIT_USER_ERROR
    except TrainingError as e:
        if debug:
            raise
        if isinstance(e, CollectiveError):  # its message names its rank
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif isinstance(e, Preempted):  # every rank stops on the same step; rank 0 says so
            if rank() == 0:
                print(f"stopped: {e}", file=sys.stderr, flush=True)
        else:
            report("error", e, alike=isinstance(e, (NonFiniteError, CheckpointWriteError)))
        return e.exit_code
    return 0


def report(label: str, e: BaseException, alike: bool) -> None:
    """Print ``label: e`` as this rank's one line: rank 0 at once; another rank with its
    rank named, at once when the error is its own, and when ``alike`` (every rank meets
    it) only under torchrun and only if the agent has not stopped it after
    :data:`PEER_REPORT_GRACE_S` (rank 0 has then not reported; see the module doc)."""
    me = rank()
    if me != 0 and alike:
        if not under_torchrun():
            return  # no agent stops rank 0 when this rank exits: it prints the line
        time.sleep(PEER_REPORT_GRACE_S)
    where = f"[rank {me}] " if me != 0 else ""
    print(f"{label}: {where}{e}", file=sys.stderr, flush=True)

