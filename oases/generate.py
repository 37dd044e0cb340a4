"""``python -m oases.generate``: the command lives in :mod:`oases.cli.generate`."""

from oases.cli.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
