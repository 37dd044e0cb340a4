"""``python -m oases.plan``: the command lives in :mod:`oases.cli.plan`; this module keeps
the old import path and ``-m`` name working."""

from oases.cli.plan import *  # noqa: F401,F403
from oases.cli.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
