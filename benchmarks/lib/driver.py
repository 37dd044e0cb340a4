"""The benchmarks' shared driver: modes measured in rounds, medians, the report.

* :class:`Suite` and :func:`run_suite`: a benchmark declared as data (modes, how one run
  of a mode is measured, which figures, the results name), run in interleaved rounds
  with the standard options, its medians saved and rendered; the pieces below serve
  the benchmarks that run several clusters in one go.
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

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Callable, Iterable, Optional

from benchmarks.lib.machine import machine_info

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
# A suite: a benchmark declared as modes x rounds, run by :func:`run_suite`


@dataclasses.dataclass
class Suite:
    """A benchmark as data. ``modes``: mode -> its declaration (config overrides, a
    tuple, ...), run in every round in this order; ``measure(state, mode, args)`` runs
    one mode once and returns its figures (``{"error": why}`` when it failed);
    ``metrics``: the figures whose median over the rounds is the mode's figure.
    ``setup(args)`` is entered once around all rounds and yields ``state`` (models
    built up front, a cluster, a work folder). ``flags(parser)`` adds the suite's own
    options; ``meta(args, state)`` what the report states beyond them; ``pairs``:
    (numerator, denominator) modes whose ratio of each metric is kept, per round too."""
    name: str                                   # benchmarks/results/<name>.{json,md,png}
    module: str                                 # ``python -m <module>`` reruns it
    modes: dict
    measure: Callable[..., dict]
    render: Callable[[Path, dict], Optional[str]]
    metrics: tuple = ("step_time_s",)
    setup: Callable[..., AbstractContextManager] = lambda args: contextlib.nullcontext()
    flags: Callable = lambda parser: None
    meta: Callable[..., dict] = lambda args, state: {}
    pairs: tuple = ()
    rounds: int = 3
    min_rounds: int = 3                         # medians of >= 3 interleaved rounds
    fatal: tuple = ()                           # exceptions that end the run with status 2
    exit_code: Callable[[dict], int] = lambda data: 0   # e.g. 1 where a check failed


def suite_medians(suite: Suite, runs: list[dict], modes: list[str]) -> dict:
    """Per mode: each metric's median over its rounds and the rounds' values
    (``rounds``), or ``ok`` False and its first error; then the ``pairs``' ratios."""
    per: dict = {}
    for m in modes:
        ok = [r for r in runs if r["mode"] == m and r["ok"]]
        if not ok:
            per[m] = {"ok": False, "error": next((r["error"] for r in runs if r["mode"] == m),
                                                 "not run")}
            continue
        rounds = {k: [r.get(k) for r in ok] for k in suite.metrics}
        per[m] = {"ok": True, "rounds": rounds, **{  # a figure some runs lack: None
            k: statistics.median(v) if None not in v else None for k, v in rounds.items()}}
    for num, den in suite.pairs:
        if per.get(num, {}).get("ok") and per.get(den, {}).get("ok"):
            a, b = per[num], per[den]
            a["vs"] = den
            by = {m: {r["round"]: r for r in runs if r["mode"] == m and r["ok"]}
                  for m in (num, den)}
            for k in (k for k in suite.metrics if a[k] and b[k]):
                a[f"ratio_{k}"] = a[k] / b[k]
                a[f"ratio_{k}_rounds"] = [by[num][i][k] / by[den][i][k] for i in sorted(by[num])
                                          if i in by[den]]
    return per


def run_suite(suite: Suite, doc: str, argv: Optional[list[str]] = None) -> int:
    """Parse the standard options (``--modes``, ``--rounds``, ``--out``,
    ``--from-json``) and the suite's, run the rounds (modes interleaved), write
    ``{"meta", "modes", "runs"}`` to ``<out>.json`` and render it."""
    p = parser(doc)
    p.add_argument("--modes", nargs="+", default=list(suite.modes), choices=list(suite.modes))
    p.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=suite.rounds,
                   help=f"rounds, every mode once each, interleaved (default {suite.rounds})")
    report_flags(p, suite.name)
    suite.flags(p)
    args = p.parse_args(argv)
    if args.from_json:
        return rerender(Path(args.from_json), suite.render, out=args.out)
    if args.rounds < suite.min_rounds:
        p.error(f"--rounds {args.rounds}: at least {suite.min_rounds} "
                "(medians of interleaved rounds)")

    def one(state, mode, rnd):
        rec = {"mode": mode, "loadavg_1min_before": round(os.getloadavg()[0], 2),
               **suite.measure(state, mode, args)}
        rec["ok"] = not rec.get("error")
        return rec

    def line(rec, minutes):
        figs = (", ".join(f"{k} {rec[k]:.4g}" for k in suite.metrics
                          if rec.get(k) is not None) if rec["ok"]
                else f"FAILED: {str(rec['error'])[-300:]}")
        return f"[{minutes:5.1f} min] round {rec['round']} {rec['mode']:16s} {figs}"

    try:
        with suite.setup(args) as state:
            runs, interrupted, minutes = run_rounds(
                [(lambda: contextlib.nullcontext(state), args.modes)], args.rounds, one, line,
                skip_failed=False)
            skip = {"modes", "rounds", "out", "from_json"}
            meta = {"machine": machine_info(), "command": command(suite.module, argv),
                    "elapsed_min": minutes, "interrupted": interrupted, "rounds": args.rounds,
                    "modes": args.modes,
                    **{k: v for k, v in vars(args).items() if k not in skip},
                    **suite.meta(args, state)}
    except suite.fatal as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    data = {"meta": meta, "modes": suite_medians(suite, runs, args.modes), "runs": runs}
    save(out_prefix(args, suite.name), data, suite.render)
    return 130 if interrupted else suite.exit_code(data)


# ---------------------------------------------------------------------------
# Arguments


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser, its module docstring as the description."""
    return argparse.ArgumentParser(description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def report_flags(p, name: str) -> None:
    """Every benchmark's ``--out`` (no default here: :func:`out_prefix` decides, so that
    ``--from-json`` writes beside the JSON unless told otherwise) and ``--from-json``."""
    p.add_argument("--out", help=f"output prefix (default benchmarks/results/{name}; with "
                   "--from-json: beside the .json)")
    p.add_argument("--from-json", metavar="JSON",
                   help="re-write the report from a saved .json; run nothing (no root)")


def out_prefix(args, name: str) -> Path:
    """Where a run writes: ``--out``, else ``benchmarks/results/<name>`` (``<name>-quick``
    for a ``--quick`` run)."""
    return Path(args.out) if args.out else RESULTS / (
        f"{name}-quick" if getattr(args, "quick", False) else name)


def run_flags(p, steps: int, warmup: int, repeats: Optional[int] = 3,
              vocab: bool = True) -> None:
    """The options of a benchmark that times train.py runs in fresh processes:
    ``--repeats`` (``--rounds``; None: :func:`run_suite` adds it), ``--steps``,
    ``--warmup``, ``--vocab-size`` (unless not ``vocab``), ``--run-timeout`` and
    ``--workdir`` (``--work``);
    :func:`check_run_flags` checks them."""
    if repeats is not None:
        p.add_argument("--repeats", "--rounds", dest="repeats", type=int, default=repeats,
                       help=f"rounds, every mode once each, interleaved (default {repeats})")
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=warmup, help="steps left out of the median")
    if vocab:
        p.add_argument("--vocab-size", type=int, default=256,
                       help="train.py vocabulary (peers choose their own)")
    p.add_argument("--run-timeout", type=float, default=300.0,
                   help="seconds before a run is killed")
    p.add_argument("--workdir", "--work", dest="workdir",
                   help="run directories (default runs/bench-<benchmark>/<time>)")


def check_run_flags(p, args) -> None:
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be smaller than --steps {args.steps}")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: at least 1")


def workdir(args, name: str) -> Path:
    """``--workdir``, else ``runs/bench-<name>/<time>``."""
    return Path(args.workdir) if args.workdir else (
        REPO / "runs" / f"bench-{name}" / time.strftime("%Y%m%d-%H%M%S"))


class SuiteError(Exception):
    """A benchmark's options do not make a run (a suite's ``fatal``: status 2)."""


def parse_shape(p, kvs: list[str], default: dict, flag: str) -> dict:
    """``default`` with ``--model KEY=VALUE`` overrides (positive integers; ``mbs`` =
    micro_batch_size); ``p.error`` on an unknown key (SuiteError without ``p``)."""
    model = dict(default)
    for kv in kvs:
        k, _, v = kv.partition("=")
        k = k.replace("-", "_")
        if k == "mbs":
            k = "micro_batch_size"
        if k not in model or not v.isdigit():
            msg = f"{flag} {kv}: expected one of {', '.join(model)} = a positive integer"
            if p is None:
                raise SuiteError(msg)
            p.error(msg)
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


def failed_runs(data: dict) -> list[str]:
    """A report's lines on the runs that failed (none: no lines)."""
    failed = [r for r in data["runs"] if not r["ok"]]
    if not failed:
        return []
    return ["", "Failed runs:"] + [f"- {r['mode']} r{r['round']}: {r['error']}" for r in failed]


def machine_line(mi) -> str:
    """The machine of :func:`machine_info`, or as a result before it wrote it (a str)."""
    if isinstance(mi, str):
        return f"Machine: {mi}."
    return (f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['mem_gib']} GiB, Linux {mi['kernel']}, "
            f"Python {mi['python']}, torch {mi['torch']}, oases {mi['git']}, {mi['date']}.")


def command_line(meta: dict) -> str:
    """``Command: `...` (12.3 min).``; no duration where ``elapsed_min`` is None (a result
    that did not record it)."""
    took = f" ({meta['elapsed_min']:.1f} min)" if meta.get("elapsed_min") is not None else ""
    return (f"Command: `{meta['command']}`{took}"
            + (" -- **interrupted**: partial results." if meta.get("interrupted") else "."))


def report_head(title: str, meta: dict) -> list[str]:
    """A report's first lines: its title, the machine line (where the result has one),
    the command line and the result's ``note`` (how it was converted, ...)."""
    return [title, "", *([machine_line(meta["machine"]), ""] if meta.get("machine") else []),
            command_line(meta), "", *([meta["note"], ""] if meta.get("note") else [])]


def per_round_line(data: dict, what: str, second: Callable[[dict], str]) -> list[str]:
    """A report's per-round line: each good run's step time and ``second(run)`` (``what``
    says what that is), in run order."""
    return ["", f"Per round (s/step, {what}): " + "; ".join(
        f"{r['mode']} r{r['round']} {r['step_time_s']:.3f}, {second(r)}"
        for r in data["runs"] if r["ok"]) + "."]


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


def analysis(meta: dict) -> str:
    """The hand-written notes on a result, ``<stem>-analysis.md`` beside the JSON its run
    wrote (``meta["json"]``), appended to its report as they are ("" where none)."""
    if not meta.get("json"):
        return ""
    parts = Path(meta["json"]).parts  # an absolute path of another checkout: from benchmarks/
    if "benchmarks" in parts:
        parts = parts[len(parts) - 1 - parts[::-1].index("benchmarks"):]
    notes = REPO.joinpath(*parts).with_name(Path(meta["json"]).stem + "-analysis.md")
    return notes.read_text() if notes.is_file() else ""


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
             refresh: Optional[Callable[[dict], dict]] = None,
             out: Optional[str] = None) -> int:
    """Write the .md (and .png) of a saved results JSON again, no runs, to the ``out``
    prefix (default: beside the JSON); ``refresh(data)`` may recompute derived figures
    first (then the JSON is written there too)."""
    path = Path(path)
    prefix = Path(out) if out else path.with_suffix("")
    prefix.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text())
    if refresh is not None:
        data = refresh(data)
        prefix.with_suffix(".json").write_text(json.dumps(data, indent=1))
    warn = render(prefix, data)
    if warn:
        print(f"warning: {warn}", file=sys.stderr)
    png = " and .png" if prefix.with_suffix(".png").exists() else ""
    print(f"re-wrote {prefix.with_suffix('.md')}{png} from {path}")
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
