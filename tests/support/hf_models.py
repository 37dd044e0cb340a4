"""Tiny Hugging Face models built in code (no hub access) and what the HF interop tests
do with them: save in each format, edit a config.json, import at a TP degree against
HF's logits, train from one under torchrun and export the checkpoint back.

``vocab_size=250`` pads the vocabulary (to 256 at tp <= 4), so the padding path is
exercised; logits are compared within ``ATOL`` (fp32, eval mode, dropout 0).
Needs ``transformers`` and ``safetensors``: import this module after
``pytest.importorskip`` of both.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.testing import assert_close
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from oases.config import load_config
from oases.models import build_model
from oases.models.hf import load_hf_weights
from oases.parallel.loss import IGNORE_INDEX
from oases.parallel.sharding import shard
from tests.support.runs import REPO

VOCAB = 250          # not a multiple of 64: padded to 256
ATOL = 1e-4
B, T = 2, 32


LLAMA_SHAPE = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                   max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
# kind -> (config class, model class, changes to the LLaMA shape); tests/test_hf_archs.py
# adds Llama 3 RoPE, Qwen2 and Mistral
HF_KINDS = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama-untied": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
}


def make_hf_model(kind: str, seed: int = 0, kinds: dict = HF_KINDS):
    """A tiny, randomly initialised HF model: ``gpt2``, or one of ``kinds``
    (``llama``: GQA, tied; ``llama-untied``: GQA, separate lm_head)."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                         bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    else:
        config_cls, model_cls, changes = kinds[kind]
        model = model_cls(config_cls(**{**LLAMA_SHAPE, **changes}))
        with torch.no_grad():  # norms are ones at init: make them count
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(1.0, 0.1)
    with torch.no_grad():  # biases are zeros at init: make them count too
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.05)
    return model.eval()


def save_hf(model, out: Path, fmt: str = "safetensors") -> Path:
    """``save_pretrained`` (safetensors; ``sharded``: several files + index), or a torch
    pickle ``pytorch_model.bin`` with old-style GPT-2 names (no ``transformer.`` prefix)."""
    if fmt == "safetensors":
        model.save_pretrained(out)
    elif fmt == "sharded":
        model.save_pretrained(out, max_shard_size="40KB")
        assert (out / "model.safetensors.index.json").is_file()
    else:
        model.config.save_pretrained(out)
        sd = {k.removeprefix("transformer."): v.clone() for k, v in model.state_dict().items()}
        torch.save(sd, out / "pytorch_model.bin")
    return out


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
ARCH_KINDS = {
    "llama3": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True,
                                                   rope_scaling=LLAMA3)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True, rope_theta=1e6,
                                                  num_key_value_heads=1)),
    "qwen2-untied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False,
                                                        sliding_window=8)),
}


def edited_hf_dir(src: Path, dst: Path, **changes) -> Path:
    """A copy of HF dir ``src`` whose config.json has ``changes`` (None deletes a key)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def hf_import_body(ctx, hf_dir, ids, ref):
    cfg = load_config(None, [f"model.init_from=hf:{hf_dir}", f"parallel.tp={ctx.tp}",
                             "model.dropout=0"]).validate(ctx.world_size)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=None)
    load_hf_weights(model, hf_dir, ctx.tp_rank, ctx.tp)
    model.eval()
    assert_close(model.full_logits(ids), ref, rtol=0, atol=ATOL)
    # the loss HF computes with labels=ids (next-token, shifted)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)
    hf_loss = F.cross_entropy(ref[:, :-1].reshape(-1, ref.shape[-1]), ids[:, 1:].reshape(-1))
    with torch.no_grad():
        assert_close(model(ids, targets), hf_loss, rtol=0, atol=ATOL)
        if ctx.tp > 1 and ids.shape[1] % ctx.tp == 0:  # the same import under SP
            model.set_sequence_parallel(True)
            assert_close(model(ids, targets), hf_loss, rtol=0, atol=ATOL)
            model.set_sequence_parallel(False)
    # every shard is exactly shard(full) of the unsharded import
    full = build_model(cfg.model, cfg.padded_vocab_size, None, seed=None)
    load_hf_weights(full, hf_dir, 0, 1)
    fp = dict(full.named_parameters())
    for name, p in model.named_parameters():
        want = shard(fp[name].detach(), p.tp_spec, ctx.tp_rank, ctx.tp)
        assert torch.equal(p.detach(), want), name
    # the padded vocabulary rows are zero
    wte = fp["embed.wte.weight"]
    assert wte.shape[0] == cfg.padded_vocab_size > VOCAB and not wte[VOCAB:].any()


def train_from_hf(run_train, hf_dir: Path, out: Path, *extra: str) -> Path:
    """3 steps from ``hf_dir`` under torchrun at tp=2 (and ``extra``); checkpoints at
    steps 2 and 3."""
    run_train([f"model.init_from=hf:{hf_dir}", "parallel.tp=2", f"out_dir={out}",
               "model.seq_len=32", "train.steps=3", "train.micro_batch_size=2",
               "train.warmup_steps=0", "train.lr=1e-2", "checkpoint.interval=2",
               "wandb.mode=disabled", "data.kind=synthetic", *extra])
    return out


def oases_from_checkpoint(run_dir: Path, ck: Path):
    """The checkpoint loaded into an oases model at tp=1 (the trainer's own loader)."""
    from oases.parallel.groups import ParallelContext
    from oases.runtime import checkpoint as ckpt
    from oases.runtime.optim import build_optimizer
    from oases.runtime.trainer import model_shape

    cfg = load_config(str(run_dir / "config.yaml"), ["parallel.tp=1"]).validate(1)
    model = build_model(cfg.model, cfg.padded_vocab_size, seed=None)
    ctx = ParallelContext.single()
    meta, _ = ckpt.load(ck, model, build_optimizer(model, cfg.train, ctx.device), ctx,
                        model_shape(cfg))
    return model.eval(), meta


NO_GROUP_WARNING = "ignore:torch.distributed is disabled:UserWarning"  # ckpt.load without a group


def export_and_compare(run_dir: Path, out: Path, ids: torch.Tensor, before: torch.Tensor):
    """``python -m oases.export`` of ``run_dir``'s latest (step 3) checkpoint: HF loads it
    with the logits of the checkpoint loaded into oases, moved by training."""
    proc = subprocess.run([sys.executable, "-m", "oases.export", str(run_dir), "--to-hf",
                           str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step_000003" in proc.stdout  # a run dir exports its latest checkpoint
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    ours, meta = oases_from_checkpoint(run_dir, run_dir / "checkpoints" / "step_000003")
    assert meta["step"] == 3
    with torch.no_grad():
        theirs = hf(ids).logits
    assert_close(theirs, ours.full_logits(ids), rtol=0, atol=ATOL)
    assert (theirs - before).abs().max() > 1e-2  # training moved the weights
    return hf
