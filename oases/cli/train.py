"""Train a GPT/LLaMA-like model with tensor x data parallelism (``train.py``, ``oases train``).

    torchrun --standalone --nproc_per_node=2 train.py --config configs/gpt-tiny.yaml [key.sub=value ...]

Bad input (config, data, checkpoint, out_dir) prints one line and exits with
status 2; ``debug=true`` shows the traceback. A run that cannot go on prints one
line too: status 3 for a non-finite loss or gradient with
``train.on_nonfinite=stop``, status 4 for a collective that failed or timed out
(``parallel.timeout_s``: a peer rank died or hangs), status 5 after SIGTERM or
SIGUSR1 (the step in progress finished and a checkpoint was saved; ``resume=auto``
continues). (Under torchrun the workers
exit with these and torchrun reports their failure with its own status 1, or
restarts them with ``--max-restarts``; ``python -m oases.config`` checks a config
with status 2 before launching.)
"""

from __future__ import annotations

import argparse
import os
import sys

from oases.errors import (EXIT_USER_ERROR, CollectiveError, ConfigError, DataError, Preempted,
                          TrainingError, UserError)


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
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        elif not isinstance(e, (ConfigError, DataError)):  # those are the same on every rank
            print(f"error: [rank {rank}] {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except TrainingError as e:
        if debug:
            raise
        # a non-finite step is seen alike by every rank; a collective failure names its rank
        if int(os.environ.get("RANK", "0")) == 0 or isinstance(e, CollectiveError):
            label = "stopped" if isinstance(e, Preempted) else "error"
            print(f"{label}: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0
