"""``python -m oases.launch``: the command lives in :mod:`oases.cli.launch`; this module keeps
the old import path and ``-m`` name working."""

from oases.cli.launch import *  # noqa: F401,F403
from oases.cli.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
