"""``train.py`` with a file fault from ``OASES_TEST_FAULT`` (:mod:`tests.ckpt_faults`):
what the checkpoint fault tests start under torchrun in place of ``train.py``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `tests` importable

from oases.cli.train import main  # noqa: E402
from tests.ckpt_faults import install_from_env  # noqa: E402

if __name__ == "__main__":
    install_from_env()
    sys.exit(main())
