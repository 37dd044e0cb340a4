"""``oases <command> [args]``: every command of oases behind one console script.

    oases train --config configs/gpt-tiny.yaml          one process; torchrun train.py for more
    oases plan --config ... --cluster ... --out plan.yaml
    oases prepare --builtin pydoc --out data/pydoc
    oases launch | export | generate | consolidate | schedule | config | dashboard ...

Each command is also ``python -m oases.<command>``; ``oases <command> --help`` prints its
options. An unknown command prints one line and exits with status 2.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

from oases.errors import EXIT_USER_ERROR

COMMANDS = {
    "train": ("oases.cli.train", "train a model (one process; use torchrun train.py for more)"),
    "plan": ("oases.cli.plan", "choose the parallel layout of a run"),
    "prepare": ("oases.cli.prepare", "tokenize a text into token files (data.kind=tokens)"),
    "launch": ("oases.cli.launch", "start one node's share of a multi-node job (Slurm)"),
    "export": ("oases.cli.export", "export a checkpoint as a Hugging Face model directory"),
    "generate": ("oases.cli.generate", "generate text with a checkpoint or an HF directory"),
    "consolidate": ("oases.cli.consolidate",
                    "write a checkpoint's model as one file of full tensors"),
    "schedule": ("oases.cli.schedule", "print and simulate a pipeline schedule"),
    "config": ("oases.cli.config", "check a config for a world of N processes"),
    "dashboard": ("oases.cli.dashboard", "create a W&B workspace for a project's runs"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items())
    return f"usage: oases <command> [args]\n\ncommands:\n{rows}\n"


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        return 0 if argv else EXIT_USER_ERROR
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; commands: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return EXIT_USER_ERROR
    # deferred: only the chosen command's imports (torch for some) are paid for
    command = importlib.import_module(COMMANDS[name][0])
    return command.main(rest)


if __name__ == "__main__":
    raise SystemExit(main())
