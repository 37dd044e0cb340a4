"""``python -m oases.schedule``: the command lives in :mod:`oases.cli.schedule`; this module keeps
the old import path and ``-m`` name working."""

from oases.cli.schedule import *  # noqa: F401,F403
from oases.cli.schedule import main

if __name__ == "__main__":
    raise SystemExit(main())
