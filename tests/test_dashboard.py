"""``python -m oases.dashboard``: the workspace is built offline (saving needs the network)
and its panels name exactly the grouped keys a run logs."""

from __future__ import annotations

import sys

import pytest

from oases.cli import dashboard
from oases.runtime.metric_keys import GROUPED, STEP_KEYS

pytest.importorskip("wandb_workspaces", reason="the observe extra")


def test_panels_name_exactly_the_logged_keys():
    ws = dashboard.build("team", "proj")
    assert (ws.entity, ws.project) == ("team", "proj")
    panels = [p for s in ws.sections for p in s.panels]
    assert {y for p in panels for y in p.y} == set(GROUPED.values())
    for p in panels:  # each against its own group's step
        assert {y.split("/")[0] for y in p.y} == {p.x.split("/")[0]} and p.x in STEP_KEYS.values()
    assert [s.name for s in ws.sections] == ["Throughput", "Hidden communication", "Loss",
                                             "Memory", "Pipeline"]
    # what W&B receives on save: every key, and runs grouped by the logged layout
    spec = ws._to_model().model_dump_json()
    assert all(f'"{k}"' in spec for k in GROUPED.values())
    assert '"grouping":[{"section":"config","name":"run.value.layout"}]' in spec


def test_dry_run_prints_the_panels(capsys):
    assert dashboard.main(["--entity", "team", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "  hidden fraction of TP communication: perf/tp_comm_hidden_frac against perf/step" in out


def test_missing_package_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb_workspaces", None)  # import fails
    assert dashboard.main(["--entity", "team"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: python -m oases.dashboard needs the wandb-workspaces package: "
                   "pip install 'oases[observe]'"]
