"""``python -m oases.consolidate``: the command lives in :mod:`oases.cli.consolidate`; this module keeps
the old import path and ``-m`` name working."""

from oases.cli.consolidate import *  # noqa: F401,F403
from oases.cli.consolidate import main

if __name__ == "__main__":
    raise SystemExit(main())
