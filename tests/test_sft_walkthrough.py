"""docs/sft.md's walkthrough, run as written: the commands of its ``sft-walkthrough``
block (in a fresh directory holding a link to ``configs/``; ``python`` is this
interpreter, ``oases`` its ``python -m oases.cli``), then its ``sft-transformers``
Python block. Checked: the loss falls (the toy conversations' answers are learnt), the
replies of ``generate --chat`` end at the template's ``<|eot_id|>``, and transformers'
``apply_chat_template`` + greedy ``generate`` on the export give the same tokens and
print the same reply.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from tests.support.runs import REPO, describe, subprocess_env  # noqa: E402
from tests.support.torchrun_procs import metrics  # noqa: E402

DOC = REPO / "docs" / "sft.md"
EOT = 260  # <|eot_id|> of python -m oases.cli.tiny_hf's tokenizer


def example(name: str, lang: str) -> str:
    m = re.search(rf"<!-- example:{name} -->\s*```{lang}\n(.*?)```", DOC.read_text(), re.S)
    assert m, f"docs/sft.md lost its {name} example"
    return m.group(1)


def commands(script: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, and the
    leading ``python``/``oases`` made this interpreter."""
    out = []
    for line in re.sub(r"\\\n\s*", " ", script).splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        head = {"python": [sys.executable], "oases": [sys.executable, "-m", "oases.cli"]}
        assert argv[0] in head, f"docs/sft.md runs {argv[0]!r}: only python and oases are run"
        out.append(head[argv[0]] + argv[1:])
    return out


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=cwd, env=subprocess_env(), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, describe(proc)
    return proc


@pytest.mark.slow
def test_the_sft_walkthrough_runs_as_written(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (tmp_path / "configs").symlink_to(REPO / "configs")
    steps = commands(example("sft-walkthrough", "bash"))
    assert [s[2] for s in steps] == ["oases.cli.tiny_hf", "oases.prepare", "oases.cli",
                                     "oases.generate", "oases.export"]
    done = [run(s, tmp_path) for s in steps]

    meta = json.loads((tmp_path / "data/sft/meta.json").read_text())
    assert meta["chat"]["seq_len"] == 256 and meta["chat"]["masking"] == "prefixes"
    recs = metrics(tmp_path / "runs/sft-llama-tiny")
    losses = [r["loss"] for r in recs if "loss" in r]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(losses) == 20 and losses[-1] < losses[0] / 4, losses
    assert len(vals) == 4 and vals[-1] < vals[0] / 2, vals

    # step 4: one reply per prompt; again with --json for the ids
    replies = done[3].stdout[:-1].split("\n---\n")
    rec = json.loads(run(steps[3] + ["--json"], tmp_path).stdout)
    rows = rec["outputs"]
    assert [r["text"] for r in rows] == replies and len(replies) == 2
    assert all(r["finished"] and r["ids"][-1] == EOT for r in rows), rows
    assert rows[1]["text"].startswith("lamp backwards is ")  # the form of the answers

    out = tmp_path / "out/sft-llama-tiny-hf"
    tok, model = AutoTokenizer.from_pretrained(out), AutoModelForCausalLM.from_pretrained(out)
    for row in rows:
        enc = tok.apply_chat_template(row["messages"], add_generation_prompt=True,
                                      return_tensors="pt")
        assert enc["input_ids"][0].tolist() == row["prompt_ids"]
        hf = model.generate(**enc, do_sample=False, max_new_tokens=64)[0]
        assert hf[enc["input_ids"].shape[1]:].tolist() == row["ids"]

    # step 6, the Python block: transformers prints step 4's first reply
    shown = run([sys.executable, "-c", example("sft-transformers", "python")], tmp_path)
    assert shown.stdout == replies[0] + "\n"

    # the template the corpus was prepared with has changed since: refused, one line
    template = tmp_path / "data/tiny-llama-chat/chat_template.jinja"
    template.write_text(template.read_text().replace("| trim", ""))
    proc = subprocess.run(steps[3], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "has changed since data/sft/train.bin was prepared" in \
        proc.stderr and "--chat-template FILE" in proc.stderr, describe(proc)
