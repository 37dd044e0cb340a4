"""``python -m oases.generate`` and the tokenizer-complete export.

Greedy decoding through the KV cache must give exactly the tokens of ``transformers``'
``generate(do_sample=False)`` on the same weights, at tp = 1 and 2, for a batch of two
prompts of unequal length (left-padded; HF takes the padding from ``attention_mask``),
with an EOS that one row reaches (then it is padded) and the other does not, and with
no EOS, for GPT-2, LLaMA (GQA), Qwen2, LLaMA with Llama 3 RoPE scaling and Mistral (a
sliding window the rows outgrow). The tiny
models have their weight matrices redrawn with std 0.2: at HF's init (std 0.02) a tiny
model repeats one token, which would hide a wrong position or mask.

The walkthrough of docs/generation.md runs as written, on a tiny GPT-2 with a tiny BPE
tokenizer: prepare with the directory's tokenizer, fine-tune under torchrun, generate,
export, and transformers' greedy continuation of the export equals oases.generate's.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tokenizers.processors import TemplateProcessing  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from oases.cli import tokenizer as toks  # noqa: E402
from oases.cli.export import main as export_main  # noqa: E402
from oases.cli.generate import main as generate_main  # noqa: E402
from oases.errors import UserError  # noqa: E402
from oases.parallel.groups import ParallelContext  # noqa: E402
from oases.runtime.generate import Sampling, generate, model_from_hf  # noqa: E402
from tests.support.runs import REPO, subprocess_env  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402
from tests.support.hf_models import (ARCH_KINDS, HF_KINDS, VOCAB, make_hf_model,  # noqa: E402
                                     save_hf)

PROMPTS = [[5, 17, 33, 2, 9], [40, 41]]
NEW = 10


def varied(kind: str):
    """``make_hf_model(kind)`` with its weight matrices redrawn (module docstring)."""
    model = make_hf_model(kind, kinds={**HF_KINDS, **ARCH_KINDS})
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def hf_generate(model, prompts, eos):
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    return out[:, L:].tolist()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """kind -> (HF directory, EOS id, HF's greedy tokens with that EOS and without an EOS),
    made on first use."""
    root, made = tmp_path_factory.mktemp("gen"), {}

    def get(kind):
        if kind not in made:
            model = varied(kind)
            free = hf_generate(model, PROMPTS, None)
            eos = free[0][3]  # row 0 ends at its 4th token
            assert eos not in free[1], "pick prompts whose second row does not stop"
            made[kind] = (str(save_hf(model, root / kind)), eos, hf_generate(model, PROMPTS, eos),
                          free)
        return made[kind]
    return get


def _greedy_body(ctx, hf_dir, eos, want, free):
    model, _ = model_from_hf(hf_dir, ctx)
    out = generate(model, PROMPTS, NEW, eos_ids=[eos], pad_id=0, ctx=ctx)
    assert out.tokens.tolist() == want, (out.tokens.tolist(), want)
    assert out.lengths == [4, NEW]
    assert generate(model, PROMPTS, NEW, ctx=ctx).tokens.tolist() == free


# llama: GQA; qwen2: q/k/v biases, one kv head (replicated at tp=2); llama3: Llama 3 RoPE
# scaling (factor 8, low 1, high 4, original_max_position_embeddings 16); mistral: a
# sliding window of 8, shorter than prompt + new tokens
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2", "llama3", "mistral"])
def test_greedy_matches_transformers(cases, kind):
    hf_dir, eos, want, free = cases(kind)
    assert want[0][4:] == [0] * (NEW - 4)  # HF padded the finished row too
    _greedy_body(ParallelContext.single(), hf_dir, eos, want, free)
    run_distributed(_greedy_body, world=2, tp=2, args=(hf_dir, eos, want, free))


def test_generation_stops_at_any_eos_id(cases, tmp_path, capsys):
    hf_dir, eos, want, _ = cases("gpt2")
    other = next(i for i in range(VOCAB) if i not in want[0] + want[1])
    model, _ = model_from_hf(hf_dir, ParallelContext.single())
    out = generate(model, PROMPTS, NEW, eos_ids=[other, eos])
    assert out.lengths == [4, NEW] and out.tokens[0, 4:].tolist() == [other] * (NEW - 4)
    assert out.tokens[:, :4].tolist() == [w[:4] for w in want]
    capsys.readouterr()
    args = ["--hf", hf_dir, "--json", "--max-new-tokens", str(NEW)]
    for p in PROMPTS:
        args += ["--ids", ",".join(map(str, p))]
    assert generate_main(args + ["--eos-id", str(other), "--eos-id", str(eos)]) == 0
    rows = json.loads(capsys.readouterr().out)["outputs"]
    assert [r["ids"] for r in rows] == [want[0][:4], want[1]]
    assert [r["finished"] for r in rows] == [True, False]
    # an HF directory's list of EOS ids: generation_config.json's, else config.json's
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert toks.hf_eos(tmp_path) == [3, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert toks.hf_eos(tmp_path) == [5]


def _sampled(ctx, hf_dir):
    model, _ = model_from_hf(hf_dir, ctx)

    def run(**kw):
        return generate(model, PROMPTS, NEW, Sampling(**kw), ctx=ctx).tokens.tolist()
    return {"greedy": run(), "top1": run(temperature=1.0, top_k=1, seed=3),
            "s1": run(temperature=1.0, top_p=0.9, seed=1),
            "s1_again": run(temperature=1.0, top_p=0.9, seed=1),
            "s2": run(temperature=1.0, top_p=0.9, seed=2),
            "k5": run(temperature=0.7, top_k=5, seed=1)}


def _sampled_body(ctx, hf_dir, want):
    assert _sampled(ctx, hf_dir) == want


def test_sampling_is_seeded_and_the_same_at_tp2(cases):
    hf_dir = cases("gpt2")[0]
    got = _sampled(ParallelContext.single(), hf_dir)
    assert got["s1"] == got["s1_again"] and got["s1"] != got["s2"]
    assert got["top1"] == got["greedy"] and got["k5"] != got["greedy"]
    run_distributed(_sampled_body, world=2, tp=2, args=(hf_dir, got))


def test_bad_generate_input_is_one_line_exit_2(cases, tmp_path, capsys):
    hf_dir = cases("gpt2")[0]
    capsys.readouterr()  # what building the case printed (save_pretrained's progress)
    for argv, msg in [
        (["--hf", hf_dir, "--ids", "1,2,250"], "token id 250, outside the model's vocabulary"),
        (["--hf", hf_dir, "--ids", "1,x"], "not a comma-separated list"),
        (["--hf", hf_dir, "--ids", "1", "--max-new-tokens", "64"],
         "exceeds the model's seq_len 64"),
        (["--hf", hf_dir, "--ids", "1", "--tp", "2"], "--tp 2 must equal the world size 1"),
        (["--hf", hf_dir, "--prompt", "hi"],
         f"no tokenizer to encode --prompt: {hf_dir} has no tokenizer.json"),
        (["--hf", hf_dir, "--ids", "1", "--eos-id", "250"],
         "EOS id 250 is outside the model's vocabulary 0..249"),
        (["--hf", hf_dir, "--ids", "1", "--top-p", "0"], "--top-p 0.0 must be in"),
        ([str(tmp_path / "nope"), "--ids", "1"], "does not exist"),
        (["--ids", "1"], "give a checkpoint"),
    ]:
        assert generate_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and msg in err, err


def test_bytes_and_tiktoken_tokenizers_export_round_trip(tmp_path):
    t = toks.load("bytes", "", 0, None)
    with pytest.raises(UserError, match="has 256 tokens .* the model's vocabulary is 200"):
        toks.write_hf_files(t, tmp_path, 200, 64)
    toks.write_hf_files(t, tmp_path / "bytes", 256, 64)
    hf = AutoTokenizer.from_pretrained(tmp_path / "bytes")
    text = "Ünïcode,\ttabs  Ā 漢字\n"
    assert hf(text)["input_ids"] == list(text.encode())
    assert hf("a<|endoftext|>")["input_ids"] == [97, 0]
    assert hf.decode(list("x ü".encode()) + [0]) == "x ü<|endoftext|>"
    assert (hf.eos_token_id, hf.model_max_length) == (0, 64)
    gen_cfg = json.loads((tmp_path / "bytes" / "generation_config.json").read_text())
    assert gen_cfg["eos_token_id"] == 0
    # a tiktoken file: the 256 bytes and a few merges; <|endoftext|> after the ranks
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" t", b" the", b"in"]
    path = tmp_path / "tiny.tiktoken"
    path.write_text("".join(f"{base64.b64encode(r).decode()} {i}\n" for i, r in enumerate(ranks)))
    t = toks.from_path(str(path))
    toks.write_hf_files(t, tmp_path / "tt", 300, 64)
    hf = AutoTokenizer.from_pretrained(tmp_path / "tt")
    text = "the thing is in the theatre, ünï!\n"
    assert hf(text)["input_ids"] == t.reference(text) and hf.eos_token_id == len(ranks)
    assert len(hf(text)["input_ids"]) < len(text.encode())  # the merges were applied


def test_exported_tokenizer_adds_the_corpus_bos(tmp_path):
    """A corpus prepared with ``--bos 1`` and the bytes tokenizer (whose template adds
    nothing): AutoTokenizer of the export puts the 1 first, as the training ids have it,
    and still encodes the text of id 1's token as its bytes."""
    t = toks.load("bytes", "", 0, 1)
    toks.write_hf_files(t, tmp_path / "bos", 256, 64)
    hf = AutoTokenizer.from_pretrained(tmp_path / "bos")
    text = "hi ā Ā\x01"
    assert hf(text)["input_ids"] == t.encode(text) == [1] + list(text.encode())
    assert t.tok.encode(text).ids == list(text.encode())  # the source is left as it was
    # the other way round: a template that adds a BOS the corpus was prepared without
    t = toks.load("bytes", "", 0, None)
    t.tok.post_processor = TemplateProcessing(single="ā $A", special_tokens=[("ā", 1)])
    with pytest.raises(UserError, match="encodes text differently from the run's data"):
        toks.write_hf_files(t, tmp_path / "drop", 256, 64)


# ---------------------------------------------------------------------------
# The walkthrough of docs/generation.md


def _run(*cmd, expect=0):
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == expect, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _tiny_gpt2_dir(out: Path, texts: list[str]) -> Path:
    """A GPT-2 directory with a BPE tokenizer trained on ``texts``, the model's vocabulary
    the tokenizer's (so that every generated id decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<|endoftext|>", "<unk>"], show_progress=False))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64,
                                       vocab_size=tok.get_vocab_size(), bos_token_id=0,
                                       eos_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    save_hf(model, out)
    tok.save(str(out / "tokenizer.json"))
    return out


def test_walkthrough_hf_to_finetune_generate_export(tmp_path, run_train, capsys):
    words = "the cat dog sat on a mat and ran to big red blue house tree".split()
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=g))
             for _ in range(80)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    hf_dir = _tiny_gpt2_dir(tmp_path / "tiny-gpt2", lines)
    data, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "run-hf"
    _run("-m", "oases.prepare", "--input", tmp_path / "corpus.txt", "--split-on", r"\n",
         "--tokenizer", hf_dir, "--out", data)
    run_train(["--config", "configs/gpt-tiny.yaml", f"model.init_from=hf:{hf_dir}",
               "model.seq_len=32", f"data.train_path={data}/train.bin",
               f"data.val_path={data}/val.bin", f"out_dir={run}", "train.steps=3",
               "train.micro_batch_size=2", "wandb.mode=disabled"])
    prompt = "the cat sat on"
    gen = json.loads(_run("-m", "oases.generate", run, "--prompt", prompt,
                          "--max-new-tokens", 4, "--json").stdout)
    (row,) = gen["outputs"]
    assert len(row["ids"]) == 4 and row["full_text"].startswith(prompt) and row["text"]
    assert gen["tokens_per_s"] > 0
    _run("-m", "oases.export", run, "--to-hf", out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    enc = tok(prompt, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == row["prompt_ids"]
    hf = model.generate(**enc, do_sample=False, max_new_tokens=4)[0, enc["input_ids"].shape[1]:]
    assert hf.tolist() == row["ids"] and tok.decode(hf, skip_special_tokens=True) == row["text"]
    # the tokenizer the run recorded has changed since: refused, nothing written
    with open(hf_dir / "tokenizer.json", "a") as f:
        f.write(" ")
    assert export_main([str(run), "--to-hf", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "has changed since" in err and "pass --tokenizer" in err, err
    assert not (tmp_path / "again").exists()
