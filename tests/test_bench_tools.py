"""The benchmarks' tools. The suite driver (``benchmarks.lib.driver.run_suite``) on a
fake measure: modes interleaved round by round, each figure's median over the rounds,
per-round ratios of declared pairs, at least 3 rounds, and ``--from-json`` writing the
same report. The emulated cluster (``emucluster``) imports nothing from the
benchmarks."""

from __future__ import annotations

import ast
import importlib
import json
import re

import pytest

from benchmarks.lib import driver

# mode -> its step time in each round
TIMES = {"slow": [3.0, 1.0, 2.0], "fast": [1.5, 0.5, 2.0]}


def _suite(calls: list) -> driver.Suite:
    def measure(state, mode, args):
        calls.append(mode)
        rnd = sum(1 for c in calls if c == mode) - 1
        if mode == "fast" and rnd == 2 and args.fail_last:
            return {"error": "fast failed in round 2"}
        return {"step_time_s": TIMES[mode][rnd], "wait_s": None, "state": state}

    def render(out, data):
        rows = [f"{m} {r['step_time_s']}" for m, r in data["modes"].items() if r["ok"]]
        out.with_suffix(".md").write_text("\n".join(rows) + "\n")

    return driver.Suite("fake", "benchmarks.fake", dict.fromkeys(TIMES), measure, render,
                        metrics=("step_time_s", "wait_s"), pairs=(("fast", "slow"),),
                        flags=lambda p: p.add_argument("--fail-last", action="store_true"),
                        meta=lambda args, state: {"shape": "tiny"})


def test_rounds_interleave_and_medians(tmp_path):
    calls: list = []
    out = tmp_path / "fake"
    assert driver.run_suite(_suite(calls), "doc", ["--out", str(out)]) == 0
    assert calls == ["slow", "fast"] * 3
    data = json.loads(out.with_suffix(".json").read_text())
    slow, fast = data["modes"]["slow"], data["modes"]["fast"]
    assert slow["step_time_s"] == 2.0 and fast["step_time_s"] == 1.5
    assert slow["rounds"]["step_time_s"] == [3.0, 1.0, 2.0]
    assert fast["wait_s"] is None   # a figure the runs lack stays None
    assert fast["vs"] == "slow" and fast["ratio_step_time_s"] == 0.75
    assert fast["ratio_step_time_s_rounds"] == [0.5, 0.5, 1.0]
    assert data["meta"]["shape"] == "tiny" and data["meta"]["rounds"] == 3
    assert data["meta"]["command"].endswith(f"-m benchmarks.fake --out {out}")
    assert out.with_suffix(".md").read_text() == "slow 2.0\nfast 1.5\n"
    out.with_suffix(".md").unlink()
    assert driver.run_suite(_suite([]), "doc", ["--from-json", str(out.with_suffix(".json"))]) == 0
    assert out.with_suffix(".md").read_text() == "slow 2.0\nfast 1.5\n"
    other = tmp_path / "elsewhere" / "fake"   # --out with --from-json: written there
    assert driver.run_suite(_suite([]), "doc", ["--from-json", str(out.with_suffix(".json")),
                                                "--out", str(other)]) == 0
    assert other.with_suffix(".md").read_text() == "slow 2.0\nfast 1.5\n"
    assert not other.with_suffix(".json").exists()


def _module(name: str) -> str:
    """The module the command written in a committed report runs."""
    found = re.search(r"python -m (benchmarks\.\w+)", (driver.RESULTS / f"{name}.md").read_text())
    assert found, f"{name}.md names no python -m benchmarks.<module> command"
    return found.group(1)


@pytest.mark.parametrize("name", sorted(p.stem for p in driver.RESULTS.glob("*.json")))
def test_a_committed_report_is_written_again_from_its_json(name, tmp_path, monkeypatch):
    """Every committed result: ``--from-json`` of the module its report names writes
    the committed .md again, byte for byte (hand-written notes in ``<name>-analysis.md``
    included), to ``--out``, and touches nothing beside the committed JSON."""
    mod = importlib.import_module(_module(name))
    results = driver.RESULTS / name
    before = {p: p.stat().st_mtime_ns for p in driver.RESULTS.iterdir()}
    monkeypatch.setattr("sys.argv", [name, "--from-json", str(results.with_suffix(".json")),
                                     "--out", str(tmp_path / name)])
    rc = mod.main() if hasattr(mod, "main") else driver.run_suite(mod.SUITE, mod.__doc__)
    assert rc == 0
    assert (tmp_path / name).with_suffix(".md").read_text() == results.with_suffix(".md").read_text()
    assert {p: p.stat().st_mtime_ns for p in driver.RESULTS.iterdir()} == before


def test_a_failed_round_is_left_out_of_the_median_and_the_round_ratios(tmp_path):
    out = tmp_path / "fake"
    assert driver.run_suite(_suite([]), "doc", ["--out", str(out), "--fail-last"]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    fast = data["modes"]["fast"]
    assert fast["rounds"]["step_time_s"] == [1.5, 0.5] and fast["step_time_s"] == 1.0
    assert fast["ratio_step_time_s_rounds"] == [0.5, 0.5]
    assert [r["ok"] for r in data["runs"] if r["mode"] == "fast"] == [True, True, False]


def test_fewer_than_three_rounds_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        driver.run_suite(_suite([]), "doc", ["--rounds", "2", "--out", str(tmp_path / "x")])
    assert e.value.code == 2
    assert "--rounds 2: at least 3" in capsys.readouterr().err


def test_the_emulated_cluster_imports_nothing_from_the_benchmarks():
    pkg = driver.REPO / "emucluster"
    found = []
    for f in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(f.name, n) for n in names]
    ours = [n for _, n in found if n.split(".")[0] in ("emucluster", "oases", "benchmarks", "tests")]
    assert ours and all(n.split(".")[0] in ("emucluster", "oases") for n in ours), ours
