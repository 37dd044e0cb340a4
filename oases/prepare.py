"""``python -m oases.prepare``: the command lives in :mod:`oases.cli.prepare`; this module keeps
the old import path and ``-m`` name working."""

from oases.cli.prepare import *  # noqa: F401,F403
from oases.cli.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())
