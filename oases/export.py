"""``python -m oases.export``: the command lives in :mod:`oases.cli.export`; this module keeps
the old import path and ``-m`` name working."""

from oases.cli.export import *  # noqa: F401,F403
from oases.cli.export import main

if __name__ == "__main__":
    raise SystemExit(main())
