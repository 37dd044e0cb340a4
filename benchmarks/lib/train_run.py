"""One timed run on the emulated cluster: train.py (or a peer script) in fresh processes on
every node, its step times read back.

A train.py run logs every step (``train.log_interval=1``) to ``<out_dir>/metrics.jsonl``
on synthetic data, saves nothing and never evaluates; its figure is the median
``step_time_s`` after ``--warmup`` steps. A peer writes
``{"step_times_s": [...], "tokens_per_step": n}`` to its ``--out-json``. A failed run
records the most telling line of its nodes' output.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from emucluster import (ClusterError, ClusterSpec, EmulatedCluster,
                                   check_prerequisites, free_port)
from benchmarks.lib import driver

FATAL = (ClusterError, driver.SuiteError)   # a cluster suite's ``fatal``


def cluster_flags(cluster: str, model: dict, tp: int, steps: int = 10, warmup: int = 3):
    """A Suite's ``flags`` for train.py modes on one emulated cluster."""
    def flags(p) -> None:
        p.add_argument("--cluster", default=cluster, help="cluster file")
        driver.run_flags(p, steps, warmup, repeats=None)
        model_flag(p, model)
        p.add_argument("--tp", type=int, default=tp)
    return flags


def model_flag(p, model: dict, flag: str = "--model", what: str = "shape") -> None:
    """``--model KEY=VALUE ...`` over the shape ``model`` (:func:`driver.parse_shape`)."""
    p.add_argument(flag, nargs="*", default=[], metavar="KEY=VALUE",
                   help=f"{what} overrides: {', '.join(model)} (default "
                        f"{' '.join(f'{k}={v}' for k, v in model.items())})")


def cluster_setup(name: str, model: dict):
    """A Suite's ``setup``: the shape (``args.model_shape``) and the work folder decided,
    the cluster brought up for all rounds."""
    @contextlib.contextmanager
    def setup(args):
        args.model_shape = driver.parse_shape(None, args.model, model, "--model")
        args.workdir = str(driver.workdir(args, name))
        check_prerequisites()
        with EmulatedCluster(ClusterSpec.load(args.cluster)) as cluster:
            yield cluster
    return setup


def cluster_measure(modes: dict, fields: tuple = ()):
    """A Suite's ``measure``: one :func:`timed_run` of ``modes[mode]`` (train.py
    overrides) in a fresh run directory."""
    def measure(cluster: EmulatedCluster, mode: str, args) -> dict:
        rdir = Path(args.workdir) / mode.replace("+", "-")
        rdir.mkdir(parents=True, exist_ok=True)
        return timed_run(cluster, mode, modes[mode], args.model_shape, args,
                         Path(tempfile.mkdtemp(dir=rdir, prefix="r")), fields=fields)
    return measure


def error_summary(outputs: list[str], limit: int = 300) -> str:
    """The most telling line of failed runs' output (an ``error:`` line, an exception)."""
    pat = re.compile(r"(^error: |Error\b|Exception\b|Traceback|Killed|Timeout|timed out)")
    noise = re.compile(r"(ChildFailedError|torch/distributed/elastic|elastic/multiprocessing|"
                       r"^\s*(File|raise|return|\^)|^=+$|^-+$|error_file|traceback :|"
                       r"To enable traceback)")
    best = ""
    for out in outputs:
        for ln in out.splitlines():
            ln = ln.strip()
            if ln and pat.search(ln) and not noise.search(ln) and ln != "Traceback (most recent call last):":
                best = ln  # the last such line is usually the cause
        if best:
            break
    if not best:
        tails = [ln.strip() for out in outputs for ln in out.splitlines() if ln.strip()]
        best = tails[-1] if tails else "no output"
    return best[:limit]


def run_error(results: list, timeout: float) -> Optional[str]:
    """Why a cluster run failed (None: every node exited 0)."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return None
    if any(r.timed_out for r in failed):
        return f"timed out after {timeout:.0f} s"
    return error_summary([r.output for r in failed if r.returncode] + [r.output for r in results])


def metrics(out_dir: Path) -> list[dict]:
    """The records of ``<out_dir>/metrics.jsonl`` (train.py with train.log_interval=1)."""
    return [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines()
            if ln.strip()]


def gpt_overrides(model: dict, vocab: int) -> list[str]:
    """train.py's GPT of ``model`` (d_model, n_layer, n_head, seq_len; ffn = 4 d_model)."""
    d = model["d_model"]
    return ["model.name=gpt-tiny", "model.arch=gpt", f"model.d_model={d}",
            f"model.n_layer={model['n_layer']}", f"model.n_head={model['n_head']}",
            f"model.n_kv_heads={model['n_head']}", f"model.ffn_hidden={4 * d}",
            f"model.seq_len={model['seq_len']}", f"model.vocab_size={vocab}"]


def timed_run_overrides(steps: int, micro_batch_size: int, grad_accum: int,
                        out_dir: Path) -> list[str]:
    """A timing run of train.py: every step logged, synthetic data, nothing saved."""
    return [f"train.steps={steps}", f"train.micro_batch_size={micro_batch_size}",
            f"train.grad_accum={grad_accum}", "train.log_interval=1", "wandb.mode=disabled",
            "data.kind=synthetic", "checkpoint.save_final=false", "checkpoint.interval=0",
            "eval.interval=0", f"out_dir={out_dir}"]


def train_overrides(overrides: list[str], model: dict, args, out_dir: Path, tp: int) -> list[str]:
    """train.py at tp ``tp`` on CPU (gloo), GPT ``model``, with a mode's ``overrides``."""
    return [*gpt_overrides(model, args.vocab_size),
            f"parallel.tp={tp}", "parallel.device=cpu", "parallel.backend=gloo",
            f"parallel.timeout_s={args.run_timeout}", *overrides,
            *timed_run_overrides(args.steps, model["micro_batch_size"], model["grad_accum"],
                                 out_dir)]


def peer_args(model: dict, args, out_json: Path, *extra: str) -> list[str]:
    """A peer script's command line (benchmarks.peers): the shape, the steps, where its
    JSON goes, then the peer's own ``extra`` options."""
    return ["--d-model", str(model["d_model"]), "--n-layer", str(model["n_layer"]),
            "--n-head", str(model["n_head"]), "--seq-len", str(model["seq_len"]),
            "--micro-batch-size", str(model["micro_batch_size"]), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--out-json", str(out_json), *extra]


def timed_run(cluster: EmulatedCluster, mode: str, overrides: Optional[list[str]], model: dict,
              args, out_dir: Path, peer: Optional[str] = None, fields: tuple = ()) -> dict:
    """Run ``mode`` once (train.py with ``overrides``, or the ``peer`` module) at tp
    ``args.tp`` with ``args.steps`` steps; its record: ``ok``, ``error``, step times,
    tokens per step, wall time, the load before it and node 0's command. Each of
    ``fields`` (a ``metrics.jsonl`` field) adds the median of its values over the timed
    steps, None where none has it (always for a peer)."""
    spec = cluster.spec
    world = spec.nodes * spec.devices_per_node
    dp = world // args.tp
    rec: dict = {"cluster": spec.name, "mode": mode, "ok": False, "error": None}
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if peer and model["grad_accum"] != 1:
        rec["error"] = "the peer scripts run one micro-batch per step (grad_accum=1)"
        rec["skip_retries"] = True
        return rec
    if peer:
        out_json = out_dir / "peer.json"
        script_args = peer_args(model, args, out_json)
        cmd = lambda i: cluster.torchrun_command(i, script_args, peer, port,  # noqa: E731
                                                 module=True)
    else:
        script_args = train_overrides(overrides, model, args, out_dir, args.tp)
        cmd = lambda i: cluster.torchrun_command(i, script_args, "train.py", port)  # noqa: E731
    rec["command_node0"] = shlex.join(cmd(0))
    rec["loadavg_1min_before"] = round(os.getloadavg()[0], 2)  # other tenants skew timings
    t0 = time.monotonic()
    results = cluster.run(cmd, timeout=args.run_timeout)
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    (out_dir / "node0.log").write_text(results[0].output)
    if len(results) > 1:
        (out_dir / "node1.log").write_text(results[1].output)
    rec["error"] = run_error(results, args.run_timeout)
    if rec["error"]:
        return rec
    extra = dict.fromkeys(fields)
    try:
        if peer:
            data = json.loads(out_json.read_text())
            times = [float(t) for t in data["step_times_s"]]
            tokens = int(data["tokens_per_step"])
            # a peer reports every step, or only the timed ones (after its --warmup)
            times = times[args.warmup:] if len(times) >= args.steps else times
        else:
            recs = [r for r in metrics(out_dir) if "step_time_s" in r and r["step"] > args.warmup]
            times = [r["step_time_s"] for r in recs]
            tokens = model["micro_batch_size"] * model["grad_accum"] * model["seq_len"] * dp
            for k in fields:
                vals = [r[k] for r in recs if k in r]
                extra[k] = statistics.median(vals) if vals else None
    except READ_ERRORS as e:
        return unreadable(rec, e)
    return timed(rec, times, tokens, **extra)


# what reading a finished run's step times can raise (a missing or malformed file)
READ_ERRORS = (OSError, ValueError, KeyError, TypeError)


def unreadable(rec: dict, e: BaseException) -> dict:
    """``rec`` of a run whose step times could not be read."""
    rec["error"] = f"could not read the step times: {type(e).__name__}: {e}"
    return rec


def timed(rec: dict, times: list[float], tokens: int, **extra) -> dict:
    """``rec`` of a run with its timed steps (their median is the run's step time), or
    an error when it has none."""
    if not times:
        rec["error"] = "no timed steps (is --steps larger than --warmup?)"
        return rec
    rec.update(ok=True, step_times_s=times, step_time_s=statistics.median(times),
               tokens_per_step=tokens, **extra)
    return rec
