"""``python -m oases.dashboard``: the command lives in :mod:`oases.cli.dashboard`."""

from oases.cli.dashboard import *  # noqa: F401,F403
from oases.cli.dashboard import main

if __name__ == "__main__":
    raise SystemExit(main())
