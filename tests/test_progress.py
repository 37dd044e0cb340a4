"""Progress: a bar only on rank 0 at a terminal outside torchrun; else sparse lines.

The terminal is faked with a text stream whose ``isatty`` says True (tqdm draws on
whatever stream it is given), so the bar's output can be read back.
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oases import progress as P

ROOT = Path(__file__).resolve().parents[1]
TEXT = ("Progress bars are for people; logs are for grep.\n"
        "Ünïcödé lines keep the byte tokenizer honest ✓\n") * 200


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def fake_tty(monkeypatch) -> FakeTTY:
    """stderr is a terminal, this process is rank 0 of no torchrun job. (Called in the
    test body: pytest's capture sets sys.stderr again between a fixture and the test.)"""
    for var in ("RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    stream = FakeTTY()
    monkeypatch.setattr(sys, "stderr", stream)
    return stream


def test_bar_at_a_terminal(monkeypatch):
    tty = fake_tty(monkeypatch)
    bar = P.progress(range(5), desc="work", unit="item")
    assert type(bar).__name__ == "tqdm"
    assert list(bar) == list(range(5))
    out = tty.getvalue()
    assert "work:" in out and "%|" in out and "\r" in out  # drawn (then cleared: leave=False)


def test_no_bar_when_not_a_terminal(monkeypatch):
    fake_tty(monkeypatch)
    piped = io.StringIO()  # isatty() is False
    monkeypatch.setattr(sys, "stderr", piped)
    bar = P.progress(range(5), desc="work")
    assert isinstance(bar, P.Lines)
    assert list(bar) == list(range(5))
    assert piped.getvalue() == ""  # short work: not a line


@pytest.mark.parametrize("env", [{"RANK": "1"}, {"TORCHELASTIC_RUN_ID": "job-7", "RANK": "0"}])
def test_no_bar_off_rank_0_or_under_torchrun(monkeypatch, env):
    tty = fake_tty(monkeypatch)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    bar = P.progress(range(3), desc="work")
    assert isinstance(bar, P.Lines)
    assert list(bar) == [0, 1, 2]
    assert tty.getvalue() == ""


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_lines_are_few_and_plain(monkeypatch):
    """Off a terminal a long job gets lines at 5, 15, 35, 75 s ... and one at the end;
    rank 1 writes none."""
    monkeypatch.delenv("RANK", raising=False)
    clock = Clock()
    monkeypatch.setattr(P.time, "monotonic", clock)
    out = io.StringIO()
    lines = P.Lines(total=100 * 2**20, desc="saving step_000100", unit="B", stream=out)
    for _ in range(100):  # 100 s, 1 MiB a second
        clock.t += 1.0
        lines.update(2**20)
    lines.close()
    text = out.getvalue()
    assert "\r" not in text
    rows = text.splitlines()
    assert [r.split(" after ")[-1] for r in rows[:-1]] == ["5s", "15s", "35s", "75s"]
    assert rows[0] == "saving step_000100: 5.0 MiB of 100.0 MiB (5%) after 5s"
    assert rows[-1] == "saving step_000100: 100.0 MiB of 100.0 MiB (100%), done in 100s"

    monkeypatch.setenv("RANK", "1")
    quiet = io.StringIO()
    other = P.Lines(total=10, desc="x", stream=quiet)
    clock.t += 100
    other.update(5)
    other.close()
    assert quiet.getvalue() == ""


def test_io_progress_counts_written_bytes(monkeypatch, tmp_path):
    tty = fake_tty(monkeypatch)
    data = b"x" * (3 << 20)
    with P.io_progress("writing", total=len(data), kind="write", interval_s=0.01) as bar:
        (tmp_path / "f.bin").write_bytes(data)
    assert bar.n == len(data)
    assert "writing" in tty.getvalue()


def _tokenizer(path: Path) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines(keepends=True), trainer=trainer)
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_prepare_same_files_with_and_without_bars(monkeypatch, tmp_path, tokenizer):
    """Bars only draw: the token files are the same as a piped run's, also when the text
    is read, tokenized and written in many pieces."""
    tty = fake_tty(monkeypatch)
    from oases.cli import prepare as prep
    from oases.cli import prepare_sources

    tok = "bytes" if tokenizer == "bytes" else _tokenizer(tmp_path / "tok.json")
    src = tmp_path / "in.txt"
    src.write_text(TEXT, encoding="utf-8")
    monkeypatch.setattr(prepare_sources, "CHUNK_BYTES", 2000)  # ~40 pieces, many chunks
    args = ["--input", str(src), "--tokenizer", tok, "--eos-id", "0", "--workers", "1",
            "--shard-tokens", "1000"]                             # written in shards
    assert prep.main([*args, "--out", str(tmp_path / "bar")]) == 0
    assert "\r" in tty.getvalue()  # a bar was drawn

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert prep.main([*args, "--out", str(tmp_path / "plain")]) == 0
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert len(names) > 4 and names == sorted(p.name for p in (tmp_path / "bar").iterdir())
    for name in names:
        assert (tmp_path / "bar" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    got = np.concatenate([np.fromfile(tmp_path / "bar" / n, dtype=np.uint16)
                          for n in names if n.startswith("train")] +
                         [np.fromfile(tmp_path / "bar" / n, dtype=np.uint16)
                          for n in names if n.startswith("val")])
    assert got[-1] == 0 and 0 not in got[:-1]  # the one document's EOS, at its end
    if tokenizer == "hf":  # pieces cut after newlines decode to the text
        from tokenizers import Tokenizer

        assert Tokenizer.from_file(tok).decode(got[:-1].tolist()) == TEXT
    else:
        assert bytes(got[:-1].astype(np.uint8)) == TEXT.encode()


def test_prepare_piped_output_has_no_bar(tmp_path):
    """``python -m oases.prepare ... | cat``: one summary line on stdout, nothing on
    stderr, no carriage return or bar glyph anywhere."""
    src = tmp_path / "in.txt"
    src.write_text(TEXT, encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "oases.prepare", "--input", str(src),
                        "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert len(r.stdout.splitlines()) == 1 and r.stdout.startswith("prepared ")
    assert "\r" not in r.stdout and "█" not in r.stdout and "%|" not in r.stdout
