"""Text generation with a trained (or imported) model, at any TP degree.

    model, cfg = model_from_checkpoint(path, ctx)        # or model_from_hf(dir, ctx)
    out = generate(model, [[5, 9, 2], [7]], 32, Sampling(temperature=0.8, top_k=50),
                   eos_ids=[0], ctx=ctx)
    out.tokens                                           # (B, n) new tokens, pad after EOS

The loop over the model's KV cache (``oases.models.common.CausalLM.new_kv_cache`` and
``decode``): the prompts, left-padded to one length, go through ``decode`` once and
fill the cache; then each step feeds the one token chosen per row. Each rank holds the
cache of its own heads; ``decode`` returns logits gathered over TP, so every rank sees
the whole vocabulary:

    step:        prefill          1          2         ...
    decode ids:  (B, L) prompts   (B, 1)     (B, 1)
    cache slots: 0 .. L-1         L          L+1
    rank r:      its heads' k, v  appended   appended
    sample:      on every rank from the same seeded generator; TP rank 0's choice is
                 broadcast over the TP group, so the ranks agree even where their
                 gathered logits differed in the last bit

A row that produced one of the EOS ids is finished: from then on it receives ``pad_id``
(by default the first EOS id); the loop ends when every row is finished or after
``max_new_tokens``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import yaml

from oases.models import build_model
from oases.models.hf import load_hf_weights
from oases.config import Config, ModelConfig, load_config
from oases.config.typed_yaml import build_dataclass
from oases.errors import CheckpointError, ConfigError, UserError
from oases.parallel.groups import ParallelContext
from oases.runtime import checkpoint as ckpt
from oases.runtime.resume import model_shape

# ---------------------------------------------------------------------------
# Sampling


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy (``temperature`` 0), or drawn from the
    softmax of logits / temperature restricted to the ``top_k`` most likely tokens
    (0: all) and to the smallest set whose probability reaches ``top_p`` (1: all)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature {self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ConfigError(f"--top-k {self.top_k} must be >= 0 (0: no top-k)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p {self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, s: Sampling, gen: Optional[torch.Generator]) -> torch.Tensor:
    """(B, V) logits -> (B,) token ids."""
    if s.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]                    # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        srt, idx = logits.sort(dim=-1, descending=True)                      # (B, V)
        probs = srt.softmax(dim=-1)
        # drop a token when the more likely ones already reach top_p (the first stays)
        drop = probs.cumsum(dim=-1) - probs >= s.top_p
        logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


# ---------------------------------------------------------------------------
# The loop


@dataclass
class Generation:
    tokens: torch.Tensor          # (B, n) new tokens; pad_id after a row's EOS
    lengths: list[int]            # new tokens of each row, its EOS included
    prompt_tokens: int            # L, the padded prompt length
    seconds: float                # prefill + decoding (device synchronised)

    def rows(self) -> list[list[int]]:
        return [self.tokens[i, :n].tolist() for i, n in enumerate(self.lengths)]

    @property
    def tokens_per_s(self) -> float:
        return sum(self.lengths) / max(self.seconds, 1e-9)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids with each row right-aligned, and (B,) pad slots per row."""
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.as_tensor(p, dtype=torch.long)
    pad = torch.tensor([L - len(p) for p in prompts], dtype=torch.long)
    return ids, pad


def check_prompts(prompts: list[list[int]], vocab_size: int, max_new_tokens: int,
                  seq_len: int, eos_ids: Sequence[int] = ()) -> None:
    bad = [e for e in eos_ids if not 0 <= e < vocab_size]
    if bad:
        raise UserError(f"EOS id {bad[0]} is outside the model's vocabulary 0..{vocab_size - 1} "
                        f"(--eos-id ID sets the EOS ids; -1: none)")
    if not prompts:
        raise UserError("no prompt: pass --prompt TEXT or --ids 1,2,3")
    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"prompt {i} is empty (no token to start from)")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"prompt {i} holds token id {bad[0]}, outside the model's "
                            f"vocabulary 0..{vocab_size - 1}")
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    L = max(len(p) for p in prompts)
    if L + max_new_tokens > seq_len:
        raise UserError(f"prompt of {L} tokens + --max-new-tokens {max_new_tokens} = "
                        f"{L + max_new_tokens} exceeds the model's seq_len {seq_len}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int,
             sampling: Sampling = Sampling(), eos_ids: Sequence[int] = (),
             pad_id: Optional[int] = None, ctx: Optional[ParallelContext] = None,
             cache: bool = True, on_step: Optional[Callable[[], None]] = None) -> Generation:
    """Continue each prompt (token ids) by up to ``max_new_tokens`` tokens; a row stops
    at any of ``eos_ids``. ``pad_id`` (default: the first EOS id, else 0) pads the
    prompts and the finished rows. Collective over ``ctx.tp_group``: every TP rank calls
    it with the same arguments. ``cache`` False recomputes the whole sequence at each
    step (a fresh cache per step; for comparison). ``on_step`` is called after each new
    token (progress)."""
    ctx = ctx or ParallelContext.single(next(model.parameters()).device)
    model.eval()
    eos_ids = list(eos_ids)
    pad_id = pad_id if pad_id is not None else eos_ids[0] if eos_ids else 0
    check_prompts(prompts, model.vocab_size, max_new_tokens, model.cfg.seq_len, eos_ids)
    ids, pad = left_pad(prompts, pad_id)
    ids, pad = ids.to(ctx.device), pad.to(ctx.device)
    B, L = ids.shape
    gen = torch.Generator(ctx.device).manual_seed(sampling.seed)
    src = dist.get_global_rank(ctx.tp_group, 0) if ctx.tp > 1 else 0
    out = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=ctx.device)
    done = torch.zeros(B, dtype=torch.bool, device=ctx.device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=ctx.device)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=ctx.device)
    _sync(ctx.device)
    t0 = time.perf_counter()
    kv = model.new_kv_cache(B, L + max_new_tokens)
    logits = model.decode(ids, kv, pad=pad, last_only=True)[:, -1]           # (B, V)
    n = 0
    for n in range(1, max_new_tokens + 1):
        tok = sample(logits, sampling, gen)                                  # (B,)
        if ctx.tp > 1:  # one choice for all TP ranks (see the module docstring)
            dist.broadcast(tok, src, group=ctx.tp_group)
        tok = tok.masked_fill(done, pad_id)
        out[:, n - 1] = tok
        if on_step is not None:
            on_step()
        if eos_ids:
            ended = ~done & torch.isin(tok, eos)
            lengths = torch.where(ended, n, lengths)
            done |= ended
        # every rank decides alike: ``done`` is built from the broadcast tokens
        if n == max_new_tokens or bool(done.all()):
            break
        if cache:
            logits = model.decode(tok[:, None], kv)[:, -1]
        else:
            kv = model.new_kv_cache(B, L + max_new_tokens)
            logits = model.decode(torch.cat([ids, out[:, :n]], dim=1), kv, pad=pad,
                                  last_only=True)[:, -1]
    _sync(ctx.device)
    return Generation(out[:, :n].cpu(), lengths.clamp(max=n).tolist(), L,
                      time.perf_counter() - t0)


# ---------------------------------------------------------------------------
# Where the weights come from


def checkpoint_model_config(ck: Path, meta: dict) -> ModelConfig:
    """The checkpoint's own ModelConfig: the model section its meta.json records; a
    checkpoint written before that was recorded takes its shape from meta.json and the
    other fields (norm eps, rope theta, ...) from the run's config.yaml (the parent of
    ``checkpoints/``)."""
    data = meta.get("model") if isinstance(meta.get("model"), dict) else None
    if data is None:
        data = _run_model_section(ck)
        data.update(meta.get("model_shape") or {})
    data = {**data, "init_from": ""}  # the weights come from the checkpoint, not from HF
    try:
        mc = build_dataclass(ModelConfig, data, "model.")
        mc.resolve()
        mc.validate()
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {ck} records an invalid model section ({e})") from None
    return mc


def _run_model_section(ck: Path) -> dict:
    run_cfg = ck.parent.parent / "config.yaml"
    if not run_cfg.is_file():
        raise CheckpointError(f"no config.yaml of the run next to {ck.parent} (needed for "
                              f"norm_eps and rope_theta)")
    try:
        return dict((yaml.safe_load(run_cfg.read_text()) or {}).get("model") or {})
    except (yaml.YAMLError, AttributeError, TypeError, ValueError):
        raise CheckpointError(f"{run_cfg} is not a valid run config") from None


def _config(model: ModelConfig, ctx: ParallelContext) -> Config:
    """A config around ``model`` for ``ctx``'s TP degree, checked (heads % tp, ...)."""
    cfg = Config(model=model)
    cfg.model.dropout = 0.0
    cfg.parallel.tp = ctx.tp
    cfg.parallel.schedule = "megatron"
    return cfg.validate(ctx.tp)


def model_from_checkpoint(path: str | Path, ctx: ParallelContext):
    """(model in eval mode, its config, the checkpoint) for this rank's TP shard of an
    oases checkpoint (``path``: a checkpoint or a run directory), from any layout it was
    saved with. Collective over the world when a process group is up."""
    ck = ckpt.resolve_checkpoint(path)
    meta = ckpt.read_meta(ck)
    cfg = _config(checkpoint_model_config(ck, meta), ctx)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=None,
                        device=ctx.device)
    ckpt.load(ck, model, None, ctx, model_shape(cfg), alone=ctx.world_size == 1, rng=False)
    return model.eval(), cfg, ck


def model_from_hf(hf_dir: str | Path, ctx: ParallelContext):
    """(model in eval mode, its config) for this rank's TP shard of a Hugging Face
    directory."""
    cfg = load_config(None, [f"model.init_from=hf:{hf_dir}", f"parallel.tp={ctx.tp}",
                             "model.dropout=0", "parallel.schedule=megatron"])
    cfg.validate(ctx.tp)
    model = build_model(cfg.model, cfg.padded_vocab_size, ctx.tp_group, seed=None,
                        device=ctx.device)
    load_hf_weights(model, hf_dir, ctx.tp_rank, ctx.tp)
    return model.eval(), cfg
