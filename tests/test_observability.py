"""What a run shows its watchers: grouped W&B keys (a recording stand-in for ``wandb``,
no network), interval-averaged throughput, figures maxed over ranks, resume without
duplicate W&B steps, TensorBoard scalars, profiler traces with the engine's labels,
and the exposed/hidden TP communication clock."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from oases.models import build_model
from oases.config import load_config
from oases.errors import ConfigError
from oases.overlap.megatron import MegatronEngine
from oases.runtime import metrics
from oases.runtime.metric_keys import GROUPED, STEP_KEYS
from tests.support import torchrun_procs
from tests.support.distributed import run_distributed
from tests.support.loop import train_worker

STEPS = 4
BASE = ["model.name=gpt-tiny", "model.seq_len=32", "data.kind=synthetic", f"train.steps={STEPS}",
        "train.warmup_steps=2", "train.log_interval=2", "train.micro_batch_size=4",
        "parallel.tp=2", "parallel.schedule=oases", "parallel.recompute=fine",
        "parallel.sub_batches=2",  # the trace below shows both sub-batches
        "checkpoint.save_final=false", "eval.interval=0", "seed=5",
        "wandb.mode=offline", "wandb.tags=[tiny,ci]", "wandb.entity=team"]


def fake_wandb(log_path: Path) -> types.ModuleType:
    """A ``wandb`` that appends each call to ``log_path`` (JSON lines)."""

    def note(kind, **kw):
        with open(log_path, "a") as f:
            f.write(json.dumps({"call": kind, **kw}) + "\n")

    class Run:
        def __init__(self, kw):
            self.id = kw["id"] or "run1"

        def define_metric(self, name, **kw):
            note("define_metric", name=name, **kw)

        def log(self, data, step=None):
            note("log", data=data, step=step)

        def finish(self):
            note("finish")

    def init(**kw):
        note("init", **{k: v for k, v in kw.items() if k != "config"},
             run=kw["config"]["run"])
        return Run(kw)

    return types.SimpleNamespace(init=init)


class _StepTimes:
    """Step times of 1 s and 3 s in turn, whatever the steps took (interval averaging)."""

    def __init__(self, device=None):
        self.n = 0

    def start(self):
        return 0.0

    def stop(self, t0):
        self.n += 1

    def take_each(self):
        times = [1.0 if k % 2 == 0 else 3.0 for k in range(self.n)]
        self.n = 0
        return times


def _train(rank: int, overrides: list[str], calls: str) -> None:
    """The trainer's loop in a gloo worker (:func:`train_worker`), with the recording
    ``wandb`` and the 1 s / 3 s step times."""
    from oases.runtime import run

    sys.modules["wandb"] = fake_wandb(Path(calls))
    run.IntervalTimer = _StepTimes  # the step clock Run builds
    train_worker(rank, overrides)


def _calls(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _scalars(out: Path, key: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard")).Reload()
    return {e.step: e.value for e in acc.Scalars(key)}


def test_run_logs_grouped_averaged_and_traced(tmp_path):
    out, calls = tmp_path / "run", tmp_path / "wandb_calls.jsonl"
    args = [*BASE, f"out_dir={out}", "profile.steps=[2,2]", "parallel.trace=true"]
    run_distributed(_train, world=2, tp=None, args=(args, str(calls)))

    recs = torchrun_procs.metrics(out)
    assert [r["step"] for r in recs] == [2, 4]
    tokens = 4 * 32  # global batch (dp 1) x seq_len
    for r in recs:  # the interval's mean of 1 s and 3 s, not its last step's 3 s
        assert r["step_time_s"] == pytest.approx(2.0)
        assert r["tokens_per_s"] == pytest.approx(tokens / 2.0)
        assert 0.0 <= r["tp_comm_hidden_frac"] <= 1.0
        assert 0.0 <= r["tp_comm_exposed_s"] <= r["tp_comm_s"]

    got = _calls(calls)
    init = next(c for c in got if c["call"] == "init")
    assert init["entity"] == "team" and init["tags"] == ["tiny", "ci"]
    assert init["group"] == "dp1-tp2-oases-fine" and init["mode"] == "offline"
    assert init["run"]["world"] == 2 and init["run"]["tp"] == 2 and init["run"]["params"] > 0
    assert init["run"]["flops_per_token"] > 0 and init["run"]["layout"] == init["group"]
    steps = {c["name"]: c.get("step_metric") for c in got if c["call"] == "define_metric"}
    assert steps["perf/*"] == "perf/step" and steps["train/*"] == "train/step"
    logs = [c["data"] for c in got if c["call"] == "log"]
    assert [d["train/step"] for d in logs] == [2, 4]
    for d, r in zip(logs, recs):
        assert d["perf/step_time_s"] == r["step_time_s"] and d["train/loss"] == r["loss"]
        assert d["perf/tp_comm_hidden_frac"] == r["tp_comm_hidden_frac"]
        assert set(d) - set(GROUPED.values()) <= set(STEP_KEYS.values())

    for k in (0, 1):  # one trace per rank, with the engine's own ranges
        trace = json.loads((out / "profile" / f"rank{k}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"sub-batch 0", "sub-batch 1", "launch all-reduce", "wait"} <= names, k
        assert any(n and n.startswith("Fa P") for n in names), k
        view = json.loads((out / f"trace_rank{k}.json").read_text())["traceEvents"]
        lanes: dict[str, set] = {}  # parallel.trace: the same events
        for e in view:
            lanes.setdefault(e["tid"], set()).add(e["name"])
        assert lanes.keys() == {"compute", "comm"}, k
        assert lanes["comm"] == {"gloo:all_reduce"}, k
        assert lanes["compute"] <= names - {"wait"}, k
        for seg in ("Fa P1", "Fb C1", "Ba 1", "Bb 1 in", "Fa loss"):
            assert seg in lanes["compute"], (k, seg)


def test_megatron_labels_each_block_under_a_profiler():
    """Plain autograd has no engine code between blocks: hooks label each block's
    forward (again in recompute) and backward, inside the step's own two ranges."""
    cfg = load_config(None, ["model.name=gpt-tiny", "model.n_layer=2", "model.seq_len=16",
                             "parallel.recompute=full"]).validate()
    model = build_model(cfg.model, cfg.padded_vocab_size, recompute="full").train()
    engine = MegatronEngine()
    ids = torch.randint(0, 256, (2, 16))
    engine.forward_backward(model, ids, ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.forward_backward(model, ids, ids)
    # every range closed (a recompute stopped early too); no hook left behind
    assert engine.labels._open is None
    assert not any("_oases_range" in b.__dict__ or b._forward_hooks or b._forward_pre_hooks
                   for b in model.blocks())
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
             if e.name in ("forward", "backward") or e.name[:2] in ("F ", "B ")]
    fwd = next(s for s in spans if s[0] == "forward")
    bwd = next(s for s in spans if s[0] == "backward")
    names = [n for n, _, _ in sorted(spans, key=lambda s: s[1])]
    # embedding + 2 layers x (attn, mlp); the layers' blocks run again in recompute
    assert sorted(n for n in names if n[0] == "F") == ["F 0"] + [f"F {i}" for i in
                                                                  (1, 1, 2, 2, 3, 3, 4, 4)]
    assert [n for n in names if n[0] == "B" and n != "backward"] == [
        "B 4", "B 3", "B 2", "B 1", "B 0"]
    for name, a, b in spans:
        outer = fwd if a < bwd[1] else bwd
        if name not in ("forward", "backward"):
            assert outer[1] <= a <= b <= outer[2], (name, outer)


def _logger(out: Path, resume: bool = False, start: int = 0) -> metrics.MetricsLogger:
    cfg = load_config(None, ["wandb.mode=offline"]).validate()
    return metrics.MetricsLogger(str(out), True, 6, 1e6, 1, torch.device("cpu"), cfg.wandb,
                                 {"run": {}}, resume=resume, tensorboard=True,
                                 start_step=start, group="dp1-tp1-megatron-none")


def test_resume_logs_each_step_once(tmp_path, monkeypatch):
    """A run logs steps 1-4 (and an eval at 4), is rolled back to its step-2 checkpoint
    and runs 3-6 again: W&B (same run id) holds each step once, TensorBoard the
    second attempt's 3 and 4."""
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(calls))
    first = _logger(tmp_path)
    for step in range(1, 5):
        first.log(step, loss=10.0 - step, lr=1e-3, grad_norm=1.0, step_time=0.5, tokens=100)
    first.log_eval(4, 3.0)
    first.close()
    again = _logger(tmp_path, resume=True, start=2)
    for step in range(3, 7):
        again.log(step, loss=20.0 - step, lr=1e-3, grad_norm=1.0, step_time=0.5, tokens=100)
    again.log_eval(4, 3.0)
    again.log_eval(6, 2.0)
    again.close()
    got = _calls(calls)
    inits = [c for c in got if c["call"] == "init"]
    assert [c["id"] for c in inits] == [None, "run1"] and inits[1]["resume"] == "allow"
    logs = [c["data"] for c in got if c["call"] == "log"]
    assert [d["train/step"] for d in logs if "train/step" in d] == [1, 2, 3, 4, 5, 6]
    assert [d["eval/step"] for d in logs if "eval/step" in d] == [4, 6]
    assert [d["train/loss"] for d in logs if "train/loss" in d] == [9, 8, 7, 6, 15, 14]
    assert all(c["step"] is None for c in got if c["call"] == "log")  # W&B's _step counts
    assert _scalars(tmp_path, "train/loss") == {1: 9, 2: 8, 3: 17, 4: 16, 5: 15, 6: 14}


def _ranks_max_body(ctx):
    # rank 0: more exposed, less hidden; rank 1: more memory (stand-in figures)
    mem = {"peak_mem_gib": 1.0 + ctx.rank, "reserved_mem_gib": 4.0 - ctx.rank}
    comm = (0.3, 1.0) if ctx.rank == 0 else (0.1, 2.0)
    got = metrics.ranks_max(mem, comm, torch.device("cpu"))
    assert got == pytest.approx({"peak_mem_gib": 2.0, "reserved_mem_gib": 4.0,
                                 "tp_comm_exposed_s": 0.3, "tp_comm_s": 2.0,
                                 "tp_comm_hidden_frac": 0.7}), got
    # a rank without TP collectives (a tp 1 stage) joins the same reduction
    got = metrics.ranks_max({}, (0.2, 0.4) if ctx.rank else None, torch.device("cpu"))
    assert got == pytest.approx({"tp_comm_exposed_s": 0.2, "tp_comm_s": 0.4,
                                 "tp_comm_hidden_frac": 0.5}), got


def test_memory_and_communication_are_maxima_over_ranks():
    run_distributed(_ranks_max_body, world=2, tp=1)


def _clock_body(ctx):
    from oases.overlap.comm_clock import CommClock
    from oases.parallel.comm import all_reduce

    clock = CommClock(ctx.device, [ctx.tp_group])
    other = CommClock(ctx.device, [ctx.dp_group])  # another group: sees nothing
    t = torch.ones(4)
    with clock, other:
        for hide in (True, False):
            if ctx.rank == 1:
                time.sleep(0.3)  # rank 1 is late: the all-reduce ends ~0.3 s after launch
            work = all_reduce(t, ctx.tp_group, async_op=True)
            if ctx.rank == 0 and hide:
                time.sleep(0.6)  # compute long enough to hide it
            work.wait()
            dist.barrier()
            exposed, total, n = clock.take()
            if ctx.rank == 0:
                assert n == 1 and total > 0.2, (hide, total)
                if hide:
                    assert exposed < 0.1 < 0.2 < total, (exposed, total)
                else:
                    assert exposed > 0.2 and exposed == pytest.approx(total, abs=0.1)
    assert other.take() == (0.0, 0.0, 0)


def test_comm_clock_counts_only_the_wait_as_exposed():
    run_distributed(_clock_body, world=2, tp=2)


def test_watch_settings_and_bad_input():
    cfg = load_config(None, ["wandb.group=g", "wandb.notes=n", "profile.steps=[2,3]",
                             "train.steps=3"]).validate()
    assert cfg.profile.window() == (2, 3) and cfg.wandb.group == "g"
    for bad, why in ((["wandb.mode=onlin"], "wandb.mode='onlin'"),
                     (["profile.steps=[2,9]", "train.steps=5"], "ends after the run's last"),
                     (["profile.steps=[0,1]"], "1 <= a <= b"),
                     (["profile.memory_snapshot=true"], "needs profile.steps"),
                     (["wandb.tags=ci"], "list of strings")):
        with pytest.raises(ConfigError, match=why.replace("(", r"\(")):
            load_config(None, bad).validate()


def test_missing_tensorboard_names_the_extra(monkeypatch, tmp_path):
    from oases.runtime import sinks

    monkeypatch.setattr(sinks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pip install 'oases\[observe\]'"):
        metrics.MetricsLogger(str(tmp_path), True, 10, 1e9, 1, torch.device("cpu"),
                              tensorboard=True)
