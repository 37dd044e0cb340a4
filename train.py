"""Train a GPT/LLaMA-like model: the entry that torchrun starts on every rank.

    torchrun --standalone --nproc_per_node=2 train.py --config configs/gpt-tiny.yaml [key.sub=value ...]

The command lives in :mod:`oases.cli.train` (exit statuses there and in docs/exit-statuses.md).
"""

import sys

from oases.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
