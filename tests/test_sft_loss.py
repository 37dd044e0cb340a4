"""The SFT loss, end to end: conversations prepared with a chat template
(``oases prepare --chat``: packed rows, assistant-only loss mask, document starts), a
tiny Llama and a tiny Qwen2 imported from HF weights (``model.init_from``), trained at
pp=2 x tp=2 (one engine each), give as the first step's loss exactly what transformers
computes by hand: each conversation run alone, cross-entropy on its assistant tokens
only, the mean over every counted token of the global batch.

Tolerance: rtol 1e-4. Both sides are fp32; oases sums the vocab-parallel loss and the
TP matmuls in another order than HF (the HF import tests' ATOL is 1e-4 on logits), a
relative ~1e-6 effect on a mean of a few hundred terms. A row whose conversations saw
each other, positions not restarted, or the user's tokens counted moves the loss by
percents.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tests.support.chat import make_tokenizer, write_jsonl  # noqa: E402
from tests.support.distributed import run_distributed  # noqa: E402
from tests.support.hf_models import make_hf_model, save_hf  # noqa: E402

SEQ = 96
VOCAB = 264  # the tiny tokenizers': 256 bytes and 8 specials
KINDS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=False)),
}
FAMILY = {"llama": "llama3", "qwen2": "qwen2"}


def short_conversations(n: int) -> list[dict]:
    """Conversations of about 40 tokens (either template; their own system turn keeps
    Qwen2's default one out): two share a row of 96, with the padding."""
    return [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": f"a{i}!"}]} for i in range(n)]


def prepared(tmp: Path, kind: str) -> tuple[Path, Path]:
    """(the HF model directory, the prepared chat corpus)."""
    from oases.cli.prepare import main

    hf_dir = save_hf(make_hf_model(kind, seed=3, kinds=KINDS), tmp / "hf")
    tok = make_tokenizer(tmp / "tok", FAMILY[kind])
    src = write_jsonl(tmp / "chats.jsonl", short_conversations(48))
    assert main(["--chat", "--input", str(src), "--tokenizer", str(tok), "--seq-len", str(SEQ),
                 "--out", str(tmp / "data"), "--val-fraction", "0.1"]) == 0
    return hf_dir, tmp / "data"


def by_hand(hf_dir: Path, batches: list) -> tuple[float, int, int]:
    """(the mean loss over counted targets with each conversation run alone in HF, the
    conversations seen, the rows holding more than one)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    total, count, convs, packed = 0.0, 0, 0, 0
    with torch.no_grad():
        for b in batches:
            x, y = b
            for row in range(x.shape[0]):
                doc = b.docs.doc[row]
                bounds = torch.nonzero(torch.diff(doc, prepend=doc[:1] - 1)).flatten().tolist()
                packed += len(bounds) > 2  # two conversations and the padding, at least
                for a, e in zip(bounds, bounds[1:] + [SEQ]):
                    keep = y[row, a:e] != -100
                    if not keep.any():  # padding
                        continue
                    convs += 1
                    logits = model(x[row:row + 1, a:e]).logits[0]
                    total += F.cross_entropy(logits[keep], y[row, a:e][keep],
                                             reduction="sum").item()
                    count += int(keep.sum())
    return total / count, convs, packed


def _body(rank: int, kind: str, schedule: str, hf_dir: Path, data: Path) -> None:
    from oases.config import load_config
    from oases.parallel.layout import uniform_layout
    from oases.runtime.data import TrainBatches
    from oases.runtime.resume import load_init_from
    from oases.runtime.step import train_step
    from tests.support.parity import stage

    cfg = load_config(None, [
        f"model.init_from=hf:{hf_dir}", "model.dropout=0", f"model.seq_len={SEQ}",
        "parallel.pp=2", "parallel.tp=2", f"parallel.schedule={schedule}",
        "parallel.recompute=" + ("fine" if schedule == "oases" else "none"),
        "train.micro_batch_size=4", "train.grad_accum=2", "train.warmup_steps=0",
        "data.kind=tokens", f"data.train_path={data / 'train'}", "data.val_path=",
        "data.reset_position_ids=true", "data.loss_on=assistant",
        "wandb.mode=disabled"]).validate(4)
    ctx, model, ts, batches = stage(cfg, uniform_layout(4, 2, 2, cfg.model.n_layer))
    load_init_from(cfg, ctx, model)
    loss, _ = train_step(ts, batches, 0.0)
    ref = TrainBatches(cfg.data, SEQ, cfg.model.vocab_size, cfg.pipeline_batch, 0, 1, cfg.seed)
    want, convs, packed = by_hand(hf_dir, [ref.next_batch() for _ in range(2)])
    assert convs >= 12 and packed >= 4, (convs, packed)  # packed rows, several conversations
    assert abs(loss - want) <= 1e-4 * want, f"{kind} {schedule}: {loss} vs by hand {want}"


@pytest.mark.parametrize("kind,schedule", [("llama", "oases"), ("qwen2", "megatron")])
def test_packed_chat_loss_is_each_conversation_alone(tmp_path, kind, schedule):
    hf_dir, data = prepared(tmp_path, kind)
    run_distributed(_body, world=4, tp=None, args=(kind, schedule, hf_dir, data))


@pytest.mark.slow  # two whole runs
def test_resume_over_chat_data_is_exact(tmp_path):
    """Four steps at pp=2 over chat data (validation on the held-out conversations),
    and the same run resumed from its step-2 checkpoint: steps 3 and 4 are bit for
    bit the uninterrupted run's, and the validation loss is the assistant tokens'."""
    from tests.support.loop import records, train_workers
    from tests.support.runs import resume_copy

    hf_dir, data = prepared(tmp_path, "llama")
    args = [f"model.init_from=hf:{hf_dir}", "model.dropout=0.1", f"model.seq_len={SEQ}",
            "parallel.pp=2", "parallel.tp=1", "parallel.schedule=oases",
            "parallel.recompute=fine", "train.micro_batch_size=2", "train.grad_accum=2",
            "train.steps=4", "train.warmup_steps=0", "train.lr=1e-3", "data.kind=tokens",
            f"data.train_path={data / 'train'}", f"data.val_path={data / 'val'}",
            "data.reset_position_ids=true", "eval.interval=2", "checkpoint.interval=2",
            "wandb.mode=disabled", "resume=auto"]
    a = tmp_path / "a"
    train_workers(a, 2, args)
    b = resume_copy(a, tmp_path / "b")
    train_workers(b, 2, args)
    ra, rb = records(a), records(b)
    for step in (3, 4):
        assert rb[step]["loss"] == ra[step]["loss"], (step, ra[step], rb[step])
    val = [json.loads(ln) for ln in (a / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in val), val
