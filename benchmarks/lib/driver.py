"""The benchmarks' shared driver: modes measured in rounds, medians, the report.

* :func:`run_rounds`: for each group (a cluster, brought up once), ``repeats`` rounds,
  each round running every mode once in the same order (modes interleaved
  round-robin, so machine noise hits all modes alike); a mode that fails is not
  retried in its group; Ctrl-C keeps the runs so far.
* :func:`mode_medians`, :func:`ratio_targets`, :func:`comm_share`: a mode's figure is
  the median over its repeats of each run's median step time; targets are ratios of
  two modes' tokens/s.
* :func:`save` and :func:`rerender`: a benchmark's results are one JSON file
  (``<out>.json``) and a ``render(prefix, data)`` function that writes ``<out>.md`` and
  ``<out>.png`` from that JSON alone, so ``--from-json`` writes the same report again
  without running anything.
* the Markdown pieces every report shares (machine, command, mode rows, targets).

One timed run of train.py (or a peer) on the cluster: :mod:`benchmarks.lib.train_run`.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Iterable, Optional

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

# ---------------------------------------------------------------------------
# Rounds


def run_rounds(groups: Iterable[tuple[Callable[[], AbstractContextManager], list[str]]],
               repeats: int, run_one: Callable[..., dict],
               line: Callable[[dict, float], str], skip_failed: bool = True,
               catch_interrupt: bool = True) -> tuple[list[dict], bool, float]:
    """Run every group's modes in ``repeats`` rounds.

    ``groups``: (``open()``, modes); ``open()`` is entered once for the group's rounds
    and what it yields is handed to ``run_one(ctx, mode, round)``, which returns the
    run's record (``"ok"``: it worked; the driver adds ``"round"``). After each run
    ``line(rec, minutes since the start)`` is printed. With ``skip_failed`` a mode that
    failed is not run again in its group. Returns (records, interrupted, minutes).
    """
    t_start = time.monotonic()
    runs: list[dict] = []
    interrupted = False
    try:
        for open_group, modes in groups:
            dead: set[str] = set()
            with open_group() as ctx:
                for rnd in range(repeats):
                    for mode in modes:
                        if mode in dead:
                            continue
                        rec = run_one(ctx, mode, rnd)
                        rec["round"] = rnd
                        runs.append(rec)
                        print(line(rec, (time.monotonic() - t_start) / 60), flush=True)
                        if skip_failed and not rec["ok"]:
                            dead.add(mode)  # not retried in this group
    except KeyboardInterrupt:
        if not catch_interrupt:
            raise
        interrupted = True
        print("interrupted: writing the results so far", file=sys.stderr)
    return runs, interrupted, (time.monotonic() - t_start) / 60


def run_line(prefix: str, rec: dict, minutes: float, width: int, extra: str = "") -> str:
    """``[  1.2 min] <prefix> <mode> 0.123 s/step (4,567 tok/s<extra>, run 12 s)``, or the
    run's error."""
    head = f"[{minutes:5.1f} min] {prefix} {rec['mode']:{width}s}"
    if not rec["ok"]:
        return f"{head} FAILED: {rec['error']}"
    return (f"{head} {rec['step_time_s']:.3f} s/step "
            f"({rec['tokens_per_step'] / rec['step_time_s']:,.0f} tok/s{extra}, "
            f"run {rec['wall_s']:.0f} s)")


# ---------------------------------------------------------------------------
# Arguments


def parse_shape(p, kvs: list[str], default: dict, flag: str) -> dict:
    """``default`` with ``--model KEY=VALUE`` overrides (positive integers; ``mbs`` =
    micro_batch_size); ``p.error`` on an unknown key."""
    model = dict(default)
    for kv in kvs:
        k, _, v = kv.partition("=")
        k = k.replace("-", "_")
        if k == "mbs":
            k = "micro_batch_size"
        if k not in model or not v.isdigit():
            p.error(f"{flag} {kv}: expected one of {', '.join(model)} = a positive integer")
        model[k] = int(v)
    return model


# ---------------------------------------------------------------------------
# Medians and targets


def mode_medians(runs: list[dict], modes: list[str],
                 extra: Callable[[str, list[dict]], dict] = lambda m, ok: {},
                 failed: Callable[[str], dict] = lambda m: {}) -> dict:
    """Per mode: the median over its successful repeats of their step times, tokens/s,
    the repeats; ``extra(mode, ok_runs)`` adds a benchmark's own figures. A mode with no
    successful run: ``ok`` False and its first error (``failed(mode)`` adds fields)."""
    per = {}
    for mode in modes:
        rs = [r for r in runs if r["mode"] == mode]
        ok = [r for r in rs if r["ok"]]
        if not ok:
            errs = [r["error"] for r in rs if r.get("error")]
            per[mode] = {"ok": False, **failed(mode), "error": errs[0] if errs else "not run",
                         "repeats": 0}
            continue
        t = statistics.median(r["step_time_s"] for r in ok)
        per[mode] = {"ok": True, **failed(mode), "step_time_s": t,
                     "step_time_s_repeats": [r["step_time_s"] for r in ok],
                     "tokens_per_step": ok[0]["tokens_per_step"],
                     "tokens_per_s": ok[0]["tokens_per_step"] / t, "repeats": len(ok),
                     "failed_repeats": len(rs) - len(ok), **extra(mode, ok)}
    return per


def comm_share(per: dict, full: str, nocomm: str) -> Optional[float]:
    """(t_full - t_nocomm) / t_full: the share of ``full``'s step spent communicating."""
    a, b = per.get(full, {}), per.get(nocomm, {})
    return ((a["step_time_s"] - b["step_time_s"]) / a["step_time_s"]
            if a.get("ok") and b.get("ok") else None)


def ratio_targets(per: dict, targets: list[tuple], runs: Optional[list[dict]] = None) -> list:
    """Each (description, numerator mode, denominator mode, minimum ratio or None) whose
    modes both ran: tokens/s ratio, PASS/FAIL (``info`` without a minimum); with
    ``runs`` also the ratio within each round."""
    out = []
    for desc, num, den, need in targets:
        a, b = per.get(num), per.get(den)
        if a is None or b is None:
            continue
        if not (a["ok"] and b["ok"]):
            missing = [m for m, x in ((num, a), (den, b)) if not x["ok"]]
            out.append({"target": desc, "ratio": None, "need": need, "status": "N/A",
                        "figures": f"{', '.join(missing)} failed"})
            continue
        ratio = a["tokens_per_s"] / b["tokens_per_s"]
        t = {"target": desc, "ratio": ratio, "need": need,
             "status": ("PASS" if ratio >= need else "FAIL") if need else "info"}
        if runs is not None:  # the same ratio within each round (the runs were minutes apart)
            by_round: dict = {}
            for r in runs:
                if r["ok"] and r["mode"] in (num, den):
                    by_round.setdefault(r["round"], {})[r["mode"]] = r["step_time_s"]
            t["per_round"] = [v[den] / v[num] for _, v in sorted(by_round.items())
                              if num in v and den in v]
        t["figures"] = f"{a['tokens_per_s']:,.0f} vs {b['tokens_per_s']:,.0f} tok/s"
        out.append(t)
    return out


# ---------------------------------------------------------------------------
# The report


def command(module: str, argv: Optional[list[str]] = None) -> str:
    """How this run was started: ``<python> -m <module> <args>`` (python relative to the
    repository when it lives there)."""
    exe = sys.executable
    if Path(exe).resolve().is_relative_to(REPO) or exe.startswith(str(REPO)):
        exe = os.path.relpath(exe, REPO)
    return shlex.join([exe, "-m", module, *(sys.argv[1:] if argv is None else argv)])


def machine_line(mi: dict) -> str:
    return (f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['mem_gib']} GiB, Linux {mi['kernel']}, "
            f"Python {mi['python']}, torch {mi['torch']}, oases {mi['git']}, {mi['date']}.")


def command_line(meta: dict) -> str:
    """``Command: `...` (12.3 min).``; no duration where ``elapsed_min`` is None (a result
    that did not record it)."""
    took = f" ({meta['elapsed_min']:.1f} min)" if meta.get("elapsed_min") is not None else ""
    return (f"Command: `{meta['command']}`{took}"
            + (" -- **interrupted**: partial results." if meta.get("interrupted") else "."))


def report_head(title: str, meta: dict) -> list[str]:
    """A report's first lines: its title, the machine line and the command line."""
    return [title, "", machine_line(meta["machine"]), "", command_line(meta), ""]


def mode_row(mode: str, r: dict, last: Callable[[dict], str]) -> str:
    """``| mode | step | repeats | tokens/s | ratio | <last(r)> |``, or the mode's error."""
    if not r["ok"]:
        return f"| {mode} | failed | | | | {r['error'].replace('|', '/')} |"
    reps = ", ".join(f"{t:.3f}" for t in r["step_time_s_repeats"])
    rv = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] else "n/a"
    return (f"| {mode} | {r['step_time_s']:.3f} | {reps} | {r['tokens_per_s']:,.0f} | "
            f"{rv} | {last(r)} |")


def target_rows(targets: list[dict], per_round: bool = False) -> list[str]:
    """The targets table: measured ratio (with the figures), [each round,] result."""
    rows = (["| target | measured (medians) | each round | result |", "|---|---|---|---|"]
            if per_round else ["| target | measured | result |", "|---|---|---|"])
    for t in targets:
        got = f"{t['ratio']:.3f}x ({t['figures']})" if t["ratio"] else t["figures"]
        rounds = (", ".join(f"{v:.2f}x" for v in t.get("per_round") or []) + " | "
                  if per_round else "")
        rows.append(f"| {t['target']} | {got} | {rounds}**{t['status']}** |")
    return rows


def load_line(loads: list[float], text: str) -> list[str]:
    """``<text> min x, median y, max z.`` over 1-min load averages (nothing without any)."""
    if not loads:
        return []
    return [f"{text} min {min(loads):.1f}, median {statistics.median(loads):.1f}, "
            f"max {max(loads):.1f}"]


def save(out: Path, data: dict, render: Callable[[Path, dict], Optional[str]],
         show: bool = True) -> None:
    """``<out>.json`` = ``data``, then ``render(out, data)`` writes the .md (and .png);
    a warning it returns (no matplotlib) is printed; with ``show`` the .md too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    warn = render(out, data)
    if warn:
        print(f"warning: {warn}", file=sys.stderr)
    if show:
        print(out.with_suffix(".md").read_text())


def rerender(path: Path, render: Callable[[Path, dict], Optional[str]],
             refresh: Optional[Callable[[dict], dict]] = None) -> int:
    """Write the .md (and .png) of a saved results JSON again, no runs; ``refresh(data)``
    may recompute derived figures first (then the JSON is rewritten too)."""
    path = Path(path)
    data = json.loads(path.read_text())
    if refresh is not None:
        data = refresh(data)
        path.write_text(json.dumps(data, indent=1))
    warn = render(path.with_suffix(""), data)
    if warn:
        print(f"warning: {warn}", file=sys.stderr)
    png = " and .png" if path.with_suffix(".png").exists() else ""
    print(f"re-wrote {path.with_suffix('.md')}{png} from {path}")
    return 0


def matplotlib_pyplot():
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
