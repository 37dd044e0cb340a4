"""``parallel.plan=auto`` with ``parallel.plan_search=uniap``: a live 4-process job
searches the whole layout on a cluster file before its groups exist (ZeRO levels
included: ``zero_search``), times its two best plans for a few steps
(``plan_trials=2``), runs the faster and trains."""

from __future__ import annotations

import math

import pytest
import yaml

from oases.config import load_config
from oases.errors import ConfigError
from oases.planner.plan_file import load_plan

COMMON = ["--config", "configs/gpt-tiny.yaml", "model.d_model=64", "model.n_head=4",
          "model.n_kv_heads=4", "model.ffn_hidden=128", "model.seq_len=32",
          "train.micro_batch_size=4", "train.grad_accum=2", "train.steps=2",
          "train.log_interval=1", "data.kind=synthetic", "data.val_path=", "eval.interval=0",
          "wandb.mode=disabled", "checkpoint.interval=0", "checkpoint.save_final=false"]


def test_plan_auto_searches_tries_and_runs_a_layout(tmp_path, run_train):
    out = tmp_path / "run"
    proc = run_train(COMMON + ["parallel.plan=auto", "parallel.plan_search=uniap",
                               "parallel.plan_trials=2", "parallel.zero_search=true",
                               "parallel.cluster=configs/cluster/hetero-4.yaml",
                               # tight: the whole model does not fit one device's share
                               "parallel.memory_limit_gib=0.0015", f"out_dir={out}"],
                     nproc=4, env={"HOME": str(tmp_path)})  # the profile DB goes there
    text = proc.stdout
    assert "plan=auto: trial 1/2" in text and "plan=auto: trial 2/2" in text, text
    assert "is the fastest" in text
    plan = load_plan(str(out / "plan.yaml"))
    # searched again with sequence parallelism; the plan records the faster
    on = "plan=auto: sequence_parallel on" in text
    assert on or "plan=auto: sequence_parallel off" in text, text
    assert plan.sequence_parallel == on
    # the run is the plan's layout: a pipeline prints its stages, pp=1 its degrees
    if (plan.pp or 1) > 1:
        line = next(ln for ln in text.splitlines() if ln.startswith("pipeline: "))
        for p, s in enumerate(plan.stages):
            assert f"stage {p}: layers " in line and f"dp {s['dp']} x tp {s['tp']}" in line, line
        if plan.pp_virtual == 1:  # interleaved: each stage's chunks are listed instead
            stages = " | ".join(f"stage {p}: layers {s['layers'][0]}-{s['layers'][1] - 1} "
                                f"dp {s['dp']} x tp {s['tp']}"
                                for p, s in enumerate(plan.stages))
            assert line.startswith(f"pipeline: {stages}"), line
    # the global batch of the config is kept: micro-batch 4 x 2 micro-batches x dp 2
    # (configs/gpt-tiny.yaml: tp 2 on 4 processes)
    dp = 4 // ((plan.pp or 1) * plan.tp)
    assert plan.micro_batch_size * plan.micro_batches * dp == 16, plan
    run = f"parallel.pp={plan.pp or 1} parallel.tp={plan.tp}"
    assert f"running it: {run}" in text, text
    # with zero_search the plan carries the ZeRO level it was priced at, and the run takes it
    zero = max(plan.zero or [0])
    assert f"parallel.zero={zero} parallel.zero_secondary={plan.zero_secondary}" in text, text
    recs = [yaml.safe_load(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.plan_trials=2"], "plan_trials times searched layouts"),
    (["parallel.plan=auto", "parallel.plan_trials=2"], "plan_trials times searched layouts"),
    (["parallel.plan=auto", "parallel.plan_search=greedy"], "parallel.plan_search"),
    (["parallel.plan=auto", "parallel.pp=2"], "search the layout"),
])
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.name=gpt-tiny", "train.grad_accum=2"] + overrides).validate(4)


def test_plan_search_allows_a_pipelined_config():
    cfg = load_config(None, ["model.name=gpt-tiny", "train.grad_accum=2", "parallel.pp=2",
                             "parallel.plan=auto", "parallel.plan_search=amp"]).validate(4)
    assert cfg.parallel.plan_search == "amp"


def test_a_searched_plan_with_sequence_parallelism_runs_it(tmp_path):
    from oases.planner.auto_layout import pointed_at

    cfg = load_config(None, ["model.name=gpt-tiny", "parallel.schedule=oases",
                             "train.grad_accum=2"]).validate(4)
    stage = {"layers": [0, 1], "dp": 1, "tp": 2, "degrees": [2, 2]}
    for degrees, n in (([2, 2], 4), ([2, 1], 2)):  # a degree-1 block halves the rows: 4 x 2 > 4
        path = tmp_path / f"plan-{n}.yaml"
        path.write_text(yaml.safe_dump({
            "tp": 2, "pp": 2, "micro_batch_size": 4, "micro_batches": 2,
            "sequence_parallel": True, "stages": [stage, dict(stage, degrees=degrees)]}))
        run = pointed_at(cfg, path, 4)
        assert run.parallel.sequence_parallel and run.sub_batches == n
    assert not cfg.parallel.sequence_parallel  # the config itself is left as it is


def test_a_searched_interleaved_plan_runs_its_chunks(tmp_path):
    """plan=auto's pick of interleaved-1f1b: the run takes the plan's schedule and its
    pp_virtual; a plan of another schedule leaves pp_virtual at 1."""
    from oases.planner.auto_layout import pointed_at

    cfg = load_config(None, ["model.name=gpt-tiny", "train.grad_accum=2"]).validate(4)
    stages = [{"layers": [0, 2], "dp": 1, "tp": 2}, {"layers": [2, 4], "dp": 1, "tp": 2}]
    for kind, virtual in (("interleaved-1f1b", 2), ("zb-h1", 1)):
        path = tmp_path / f"plan-{kind}.yaml"
        path.write_text(yaml.safe_dump({
            "tp": 2, "pp": 2, "micro_batch_size": 4, "micro_batches": 2, "stages": stages,
            "pp_schedule": kind, "pp_virtual": virtual}))
        run = pointed_at(cfg, path, 4)
        assert (run.parallel.pp_schedule, run.parallel.pp_virtual) == (kind, virtual)
