"""``python -m oases.config``: check a config for a world of N processes."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from oases.config.schema import ConfigError, load_config
from oases.errors import EXIT_USER_ERROR


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m oases.config --config X.yaml [--nproc N] [overrides]``: check a config
    for a world of N processes; one line and exit status 2 if it is invalid."""

    p = argparse.ArgumentParser(prog="python -m oases.config", description=main.__doc__)
    p.add_argument("--config")
    p.add_argument("--nproc", type=int, default=1, help="world size the run will have")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides).validate(args.nproc)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    m = cfg.model
    pp_text = f"pp {cfg.parallel.pp} x " if cfg.parallel.pp > 1 else ""
    print(f"config ok: {m.name} ({m.arch}, {m.n_layer} layers, d {m.d_model}) | "
          f"world {args.nproc} = {pp_text}dp {cfg.dp} x "
          f"{f'cp {cfg.parallel.cp} x ' if cfg.parallel.cp > 1 else ''}tp {cfg.parallel.tp} | "
          f"global batch {cfg.global_batch_size} x {m.seq_len}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
