"""Train a GPT/LLaMA-like model with tensor x data parallelism.

    torchrun --standalone --nproc_per_node=2 train.py --config configs/gpt-tiny.yaml [key.sub=value ...]

Bad input (config, data, checkpoint, out_dir) prints one line and exits with
status 2; ``debug=true`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys

from oases.errors import EXIT_USER_ERROR, UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config file (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100")
    args = parser.parse_args(argv)
    debug = any(o.replace(" ", "") in ("debug=true", "debug=True", "debug=1")
                for o in args.overrides)
    try:
        from oases.config import load_config
        from oases.runtime.trainer import run

        cfg = load_config(args.config, args.overrides)
        debug = cfg.debug
        run(cfg)
    except UserError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
