"""What every benchmark report states about where it ran: the machine, the software and
the commit (``machine_info``), and link rates as people write them (``fmt_mbit``)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def machine_info() -> dict:
    cpu = platform.processor() or "cpu"
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch
        tv = torch.__version__
    except ImportError:  # pragma: no cover
        tv = "?"
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": mem, "kernel": platform.release(),
            "python": platform.python_version(), "torch": tv,
            "git": git + ("+dirty" if dirty else ""),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def fmt_mbit(gbps: float) -> str:
    return f"{gbps:g} Gbit/s" if gbps >= 1 else f"{gbps * 1000:g} Mbit/s"
