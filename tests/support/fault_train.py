"""``train.py`` with a file fault from ``OASES_TEST_FAULT`` (:mod:`tests.support.ckpt_faults`):
what the checkpoint fault tests start under torchrun in place of ``train.py``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests` importable

from oases.cli.train import main  # noqa: E402
from tests.support.ckpt_faults import install_from_env  # noqa: E402

if __name__ == "__main__":
    install_from_env()
    sys.exit(main())
