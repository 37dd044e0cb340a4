"""``python -m oases.prepare`` at scale: a synthetic jsonl corpus of ``--gb`` GB (nothing
downloaded), a BPE tokenizer trained here on a sample of it, prepared with ``--workers``
processes. Measures the rate, the peak resident memory of the whole process tree
(prepare and its workers, polled from /proc) and the start-up of training on the result
(opening the corpus and the first batch, in process; then ``train.py`` for 2 steps).

    python -m benchmarks.prepare_scale --gb 2 --workers 2 --dir /tmp/oases-scale

writes ``<--out>.md`` and ``.json`` (``benchmarks/results/prepare_scale``; ``--from-json``:
the report again); ``--keep`` keeps the (large) corpus and token files, which are deleted
by default.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.lib import driver
from oases.config import DataConfig
from oases.runtime.data import TrainBatches



def make_corpus(path: Path, gb: float, seed: int = 0) -> None:
    """Documents of 50-400 words drawn from a Zipf-like vocabulary of made-up words."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(20_000)]
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    target, written = int(gb * 1e9), 0
    with open(path, "w") as f:
        while written < target:
            lens = rng.integers(50, 400, 1000)
            idx = rng.choice(len(words), int(lens.sum()), p=p)
            pos = 0
            lines = []
            for n in lens:
                text = " ".join(words[i] for i in idx[pos:pos + n]) + "."
                pos += n
                lines.append(json.dumps({"id": written, "text": text}))
            block = "\n".join(lines) + "\n"
            f.write(block)
            written += len(block)


def train_tokenizer(corpus: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, show_progress=False,
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    with open(corpus) as f:
        sample = [json.loads(line)["text"] for line in itertools.islice(f, 5000)]
    tok.train_from_iterator(sample, trainer=trainer)
    tok.save(str(out))


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(d))
            rss[int(d)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def run_prepare(cmd: list[str]) -> tuple[float, int, str]:
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=driver.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(1.0)  # a /proc walk per poll: keep it cheap
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"prepare failed: {err.strip()}")
    return time.monotonic() - t0, peak, out.strip()


def render(out: Path, r: dict) -> None:
    out.with_suffix(".md").write_text(
        f"# prepare at scale\n\nMachine: {r['cpus']} CPU cores, shared with other work (the "
        f"rate is a lower bound).\n\nCommand: `{r['benchmark_command']}`, which runs\n"
        f"`python {r['command']}`\n\n| corpus | workers | time | rate | peak RSS (process "
        f"tree) | loader start-up | train.py, 2 steps |\n|---|---|---|---|---|---|---|\n"
        f"| {r['corpus_bytes'] / 1e9:.2f} GB jsonl | {r['workers']} | {r['seconds']:.0f} s | "
        f"{r['mb_per_s']:.1f} MB/s | {r['peak_rss_mib']:.0f} MiB | "
        f"{r['loader_startup_s']:.2f} s | {r['train_2_steps_wall_s']:.1f} s |\n\n"
        f"`{r['prepare_line']}`\n")


def main(argv=None) -> int:
    ap = driver.parser(__doc__)
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/oases-scale")
    ap.add_argument("--keep", action="store_true")
    driver.report_flags(ap, "prepare_scale")
    args = ap.parse_args(argv)
    if args.from_json:
        return driver.rerender(Path(args.from_json), render, out=args.out)
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    corpus, tok, out = d / "corpus.jsonl", d / "tokenizer.json", d / "prepared"
    if not corpus.is_file() or corpus.stat().st_size < args.gb * 1e9:
        make_corpus(corpus, args.gb)
    if not tok.is_file():
        train_tokenizer(corpus, tok)
    cmd = [sys.executable, "-m", "oases.prepare", "--input", str(corpus), "--tokenizer",
           str(tok), "--out", str(out), "--workers", str(args.workers), "--force"]
    seconds, peak, line = run_prepare(cmd)
    size = corpus.stat().st_size

    t0 = time.monotonic()
    tb = TrainBatches(DataConfig(kind="tokens", train_path=str(out / "train")), 1024, 8192,
                      8, 0, 1, 0)
    tb.next_batch()
    loader_s = time.monotonic() - t0
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "train.py", "--config", "configs/gpt-tiny.yaml",
                        f"data.train_path={out / 'train'}", "data.kind=tokens",
                        "model.vocab_size=8192", "parallel.tp=1", "data.val_path=",
                        "train.steps=2", f"out_dir={d / 'run'}"],
                       cwd=driver.REPO, capture_output=True, text=True)
    train_s = time.monotonic() - t0
    if r.returncode:
        raise SystemExit(f"train.py failed: {r.stderr.strip()[-500:]}")
    res = {"corpus_bytes": size, "workers": args.workers, "seconds": seconds,
           "mb_per_s": size / 1e6 / seconds, "peak_rss_mib": peak / 2**20,
           "train_windows": tb.num_windows, "loader_startup_s": loader_s,
           "train_2_steps_wall_s": train_s, "prepare_line": line, "cpus": os.cpu_count(),
           "command": " ".join(cmd[1:]),
           "benchmark_command": driver.command("benchmarks.prepare_scale", argv)}
    driver.save(driver.out_prefix(args, "prepare_scale"), res, render)
    if not args.keep:
        shutil.rmtree(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
