"""``python -m oases.config``: the command lives in :mod:`oases.cli.config`."""

from oases.cli.config import main

raise SystemExit(main())
