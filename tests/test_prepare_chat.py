"""``python -m oases.prepare --chat``: conversations rendered by a tokenizer's chat
template, packed into rows of ``--seq-len`` tokens with per-token flags.

The tokenizers are tiny byte-level BPEs built here with a Llama-3-like and a
Qwen2-like template (and a Qwen2 one marking the assistant's tokens with
``{% generation %}``); what prepare writes is checked token for token against
transformers' ``apply_chat_template`` of each conversation. The command runs in this
process (``main``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from oases.cli.prepare import main
from oases.runtime.tokens import FLAG_COUNTS, FLAG_PAD, FLAG_START

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.support.chat import (FAMILIES, LLAMA3, QWEN2, QWEN2_GEN, conversations,  # noqa: E402
                                load, make_tokenizer, write_jsonl)

T = 384


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tok")
    return {f: make_tokenizer(root / f, f) for f in FAMILIES}


def prep(*args) -> int:
    return main(["--chat", *map(str, args)])


def split_arrays(out: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    meta = json.loads((out / "meta.json").read_text())
    dt = np.dtype(meta["dtype"])
    shards = meta["shards"][split]
    ids = np.concatenate([np.fromfile(out / e["file"], dtype=dt) for e in shards])
    flags = np.concatenate([np.fromfile(out / e["flags"], dtype=np.uint8) for e in shards])
    return ids.astype(np.int64), flags


def documents(out: Path, split: str) -> list[tuple[tuple, np.ndarray]]:
    """The split's conversations as written: (ids, counts) per document that is not
    padding; the rows' layout checked on the way (N rows of T, one final pad)."""
    ids, flags = split_arrays(out, split)
    assert len(ids) % T == 1 and len(flags) == len(ids)
    assert flags[-1] == FLAG_START | FLAG_PAD
    assert all(flags[r * T] & FLAG_START for r in range(len(ids) // T))  # rows start docs
    starts = list(np.flatnonzero(flags[:-1] & FLAG_START)) + [len(ids) - 1]
    docs = []
    for a, b in zip(starts, starts[1:]):
        assert b - a <= T and a // T == (b - 1) // T  # inside one row
        f = flags[a:b]
        if f[0] & FLAG_PAD:
            assert (f & FLAG_PAD).all() and not (f & FLAG_COUNTS).any()
            assert b % T == 0  # padding runs to the row's end
            continue
        assert not (f & FLAG_PAD).any()
        docs.append((tuple(ids[a:b]), (f & FLAG_COUNTS).astype(bool)))
    return docs


def expected(tok, template: str, conv: list[dict], gen: bool) -> tuple[tuple, np.ndarray]:
    out = tok.apply_chat_template(conv, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=gen)
    mask = np.asarray(out["assistant_masks"], bool) if gen else None
    return tuple(out["input_ids"]), mask


def masked_runs(tok, ids: tuple, mask: np.ndarray) -> list[str]:
    """The texts of the runs of counted tokens."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    runs += [cur] if cur else []
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_match_the_template_token_for_token(tmp_path, toks, family):
    """Every conversation is in train or val exactly once, as transformers renders and
    tokenizes it; the tokens that count are each assistant message's content and its
    end-of-turn token (not the header, not the newline after <|im_end|>), and with
    {% generation %} exactly transformers' assistant mask."""
    convs = conversations(40)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    assert prep("--input", src, "--tokenizer", toks[family], "--seq-len", T,
                "--out", tmp_path / "out") == 0
    tok, (template, _, _, _, eot) = load(toks[family]), FAMILIES[family]
    got = {}
    for split in ("train", "val"):
        for ids, counts in documents(tmp_path / "out", split):
            assert ids not in got
            got[ids] = (split, counts)
    assert len(got) == len(convs)
    n_val = 0
    for conv in convs:
        ids, gen_mask = expected(tok, template, conv, family.endswith("-gen"))
        split, counts = got[ids]
        n_val += split == "val"
        if gen_mask is not None:
            np.testing.assert_array_equal(counts, gen_mask)
        assert masked_runs(tok, ids, counts) == [
            (m["content"].strip() if family == "llama3" else m["content"]) + eot
            for m in conv if m["role"] == "assistant"]
    assert n_val == 4  # --val-fraction 0.1: every tenth conversation
    meta = json.loads((tmp_path / "out/meta.json").read_text())
    c = meta["chat"]
    assert (c["conversations"], c["packed"], c["truncated"], c["dropped"]) == (40, 40, 0, 0)
    assert c["masking"] == ("generation" if family.endswith("-gen") else "prefixes")
    assert c["template_sha256"] == __import__("hashlib").sha256(template.encode()).hexdigest()
    assert c["train_counted"] == sum(int(m[1][1:].sum()) for m in got.values()
                                     if m[0] == "train")
    assert meta["eos_id"] == tok.convert_tokens_to_ids(FAMILIES[family][1])


def test_prefix_masks_equal_generation_masks(tmp_path, toks):
    """The Qwen2 template without {% generation %} marks (rendered prefix by prefix)
    gives the very masks transformers gives with them; --chat-template FILE overrides
    the directory's template and meta.json names the file."""
    convs = conversations(12, seed=3)
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
    (tmp_path / "plain.jinja").write_text(QWEN2)
    assert prep("--input", src, "--tokenizer", toks["qwen2-gen"], "--chat-template",
                tmp_path / "plain.jinja", "--seq-len", T, "--val-fraction", 0,
                "--out", tmp_path / "out") == 0
    meta = json.loads((tmp_path / "out/meta.json").read_text())
    assert meta["chat"]["template_source"] == str((tmp_path / "plain.jinja").resolve())
    assert meta["chat"]["masking"] == "prefixes" and meta["val_tokens"] == 0
    got = dict(documents(tmp_path / "out", "train"))
    tok = load(toks["qwen2-gen"])
    for conv in convs:
        ids, mask = expected(tok, QWEN2_GEN, conv, True)
        np.testing.assert_array_equal(got[ids], mask)


def test_prompt_completion_parquet_and_hf_dir(tmp_path, toks):
    """prompt/completion rows (text, and TRL's lists of messages) from parquet and from a
    saved HF datasets directory write the corpus that the same conversations as
    messages in jsonl do."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"question {i}", "completion": f"answer {i}"} for i in range(10)]
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in rows],
                             "completion": [r["completion"] for r in rows]}),
                   tmp_path / "pc.parquet", row_group_size=4)
    datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                                 "completion": [{"role": "assistant", "content": r["completion"]}]}
                                for r in rows]).save_to_disk(str(tmp_path / "hf"))
    write_jsonl(tmp_path / "m.jsonl", [{"messages": [
        {"role": "user", "content": r["prompt"]},
        {"role": "assistant", "content": r["completion"]}]} for r in rows])
    arrays = []
    for name, src in (("pq", tmp_path / "pc.parquet"), ("hf", tmp_path / "hf"),
                      ("js", tmp_path / "m.jsonl")):
        assert prep("--input", src, "--tokenizer", toks["llama3"], "--seq-len", T,
                    "--out", tmp_path / name) == 0
        arrays.append([split_arrays(tmp_path / name, s) for s in ("train", "val")])
    for other in arrays[:2]:
        for (a, fa), (b, fb) in zip(other, arrays[2]):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(fa, fb)


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_overlong_conversations(tmp_path, toks, overlong):
    """A conversation longer than --seq-len is cut to its first T tokens, or dropped;
    one whose assistant tokens all lie past T is dropped either way; meta.json and the
    closing line count them."""
    short = conversations(9, seed=5)
    long_answer = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "x" * (2 * T)}]
    long_question = [{"role": "user", "content": "y" * (2 * T)},
                     {"role": "assistant", "content": "ok"}]
    src = write_jsonl(tmp_path / "c.jsonl",
                      [{"messages": c} for c in [long_answer, *short, long_question]])
    assert prep("--input", src, "--tokenizer", toks["llama3"], "--seq-len", T,
                "--overlong", overlong, "--val-fraction", 0, "--out", tmp_path / "out") == 0
    c = json.loads((tmp_path / "out/meta.json").read_text())["chat"]
    got = dict(documents(tmp_path / "out", "train"))
    tok = load(toks["llama3"])
    cut = expected(tok, LLAMA3, long_answer, False)[0][:T]
    if overlong == "truncate":
        assert (c["truncated"], c["dropped"], c["packed"]) == (1, 1, 10)
        head = len(tok.apply_chat_template(long_answer[:1], chat_template=LLAMA3,
                                           add_generation_prompt=True)["input_ids"])
        assert cut in got and not got[cut][:head].any() and got[cut][head:].all()
    else:
        assert (c["truncated"], c["dropped"], c["packed"]) == (0, 2, 9)
        assert cut not in got
    assert len(got) == c["packed"]


BAD = [
    ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     "messages[1] has the role 'robot', not one of system, user, assistant, tool"),
    ({"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]},
     "the conversation has no assistant message"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ["b"]}]},
     "messages[1] (assistant) has a list content, not text"),
    ({"prompt": "a", "completion": None}, "the row has neither 'messages' nor 'prompt' and "
                                           "'completion'"),
]


@pytest.mark.parametrize("row,message", BAD)
def test_bad_rows_are_one_line_naming_file_and_line(tmp_path, toks, capsys, row, message):
    """A bad row at line 3: exit status 2, one line on stderr naming c.jsonl:3 and what is
    wrong, no --out and no staging directory left, nothing on stdout."""
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    src = write_jsonl(tmp_path / "c.jsonl", [good, good, row, good])
    capsys.readouterr()
    assert prep("--input", src, "--tokenizer", toks["qwen2"], "--seq-len", T,
                "--out", tmp_path / "out") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"error: {src}:3: ") and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_bad_parquet_row_names_the_row_and_keeps_the_old_corpus(tmp_path, toks, capsys):
    """A non-text content in parquet row 5 under --force: one line naming the row, and
    the corpus already in --out stays as it was."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    good = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "p", "completion": "c"}] * 10)
    assert prep("--input", good, "--tokenizer", toks["llama3"], "--seq-len", T,
                "--out", tmp_path / "out") == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    pq.write_table(pa.table({"prompt": ["p"] * 8, "completion": ["c"] * 5 + [None] + ["c"] * 2}),
                   tmp_path / "bad.parquet", row_group_size=3)
    capsys.readouterr()
    assert prep("--input", tmp_path / "bad.parquet", "--tokenizer", toks["llama3"],
                "--seq-len", T, "--out", tmp_path / "out", "--force") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'bad.parquet'}: row 5: " in err
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.parquet", "c.jsonl", "out"]


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, toks, capsys):
    """A template whose rendering of messages[:i] is not the start of the whole (it
    renders the last message differently) cannot be masked by prefixes: one line."""
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['role'] }}: "
        "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}])
    assert prep("--input", src, "--tokenizer", toks["llama3"], "--chat-template",
                tmp_path / "t.jinja", "--seq-len", T, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{src}:1: the chat template" in err
    assert "{% generation %}" in err and not (tmp_path / "out").exists()
