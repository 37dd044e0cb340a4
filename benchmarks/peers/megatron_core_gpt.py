"""Peer: oases' GPT shape, tensor-parallel with megatron-core's tensor_parallel layers.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.peers.megatron_core_gpt \
        --d-model 128 --n-layer 2 --n-head 4 --seq-len 64 --micro-batch-size 4 \
        --steps 5 --warmup 1 --out-json /tmp/mcore.json

The GPT stack is written here from megatron-core's TP building blocks, wired the way
megatron-core's own GPTModel wires them (activations in [seq, batch, hidden] layout):

    wte        tensor_parallel.VocabParallelEmbedding            (forward all-reduce)
    wpe        torch.nn.Embedding, replicated                    (as LanguageModelEmbedding)
    attn.qkv   tensor_parallel.ColumnParallelLinear d -> 3d      head-major (head,{q,k,v},hd)
                                                                 rows, as megatron's linear_qkv
    attn.proj  tensor_parallel.RowParallelLinear, input_is_parallel
    mlp.fc     tensor_parallel.ColumnParallelLinear d -> ffn
    mlp.proj   tensor_parallel.RowParallelLinear
    head       tensor_parallel.ColumnParallelLinear(skip_weight_param_allocation=True) fed
               wte.weight at call time: tied embeddings, as GPTModel's output_layer
    loss       tensor_parallel.vocab_parallel_cross_entropy

Process groups come from parallel_state.initialize_model_parallel(tensor_model_parallel_size
= world) over a gloo default group. The ModelParallelConfig that runs on CPU is:

    use_cpu_initialization=True      (the default False allocates weights on
                                      torch.cuda.current_device() and forks the CUDA RNG
                                      tracker to initialise them)
    gradient_accumulation_fusion=False  (True needs APEX's fused_weight_gradient_mlp_cuda)
    sequence_parallel=False          (its buffers are allocated on torch.cuda.current_device())
    everything else at its default, including async_tensor_model_parallel_allreduce=True:
    the column layers' input-gradient all-reduce is launched async_op=True and overlaps the
    weight-gradient matmul, which gloo supports.

No monkeypatch of megatron-core is needed. Two pieces of megatron-core are *not* used
because they hard-code CUDA, and are replaced by the same math here:

  * megatron.core.optimizer.clip_grads.get_grad_norm_fp32 / clip_grad_by_total_norm_fp32
    allocate ``torch.zeros(1, device='cuda')`` overflow buffers (and assert
    ``torch.cuda.FloatTensor`` grads): clip_() below computes the same TP-aware norm
    (megatron's param_is_not_tensor_parallel_duplicate filter + all-reduce over the
    model-parallel group).
  * megatron.core.optimizer.get_megatron_optimizer needs megatron's DistributedDataParallel
    grad buffers (main_grad); with dp=1 it would reduce to torch.optim.AdamW, which is what
    megatron-core itself falls back to without Apex/Transformer Engine. Used directly.

Initialisation is deterministic across tp: with use_cpu_initialization megatron-core builds
each full ("master") weight from the global CPU generator and keeps this rank's slice, so the
model is the same function at every tp for one seed.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.peers.common import (adamw_groups, batch, init_gloo, padded_vocab, parse_args,
                                      train_loop, write_json)

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed" x4
    warnings.simplefilter("ignore")
    import megatron.core  # noqa: E402
    from megatron.core import parallel_state, tensor_parallel  # noqa: E402
    from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402
    from megatron.core.tensor_parallel.layers import \
        param_is_not_tensor_parallel_duplicate  # noqa: E402
    from megatron.core.utils import init_method_normal, scaled_init_method_normal  # noqa: E402


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelParallelConfig, d: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        tp = parallel_state.get_tensor_model_parallel_world_size()
        assert n_head % tp == 0, f"tp={tp} does not divide n_head={n_head}"
        self.n_local, self.head_dim = n_head // tp, d // n_head
        self.norm = torch.nn.LayerNorm(d, eps=1e-5)
        self.qkv = tensor_parallel.ColumnParallelLinear(
            d, 3 * d, config=cfg, init_method=init_method_normal(0.02), bias=True,
            gather_output=False)
        self.proj = tensor_parallel.RowParallelLinear(
            d, d, config=cfg, init_method=scaled_init_method_normal(0.02, n_layer), bias=True,
            input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:       # x: [s, b, h]
        s, b, _ = x.shape
        qkv, _ = self.qkv(self.norm(x))                       # [s, b, 3h/tp]
        qkv = qkv.view(s, b, self.n_local, 3, self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(3))  # [b, nh/tp, s, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.permute(2, 0, 1, 3).reshape(s, b, self.n_local * self.head_dim)
        out, _ = self.proj(y)                                 # all-reduced, + bias
        return x + out


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelParallelConfig, d: int, ffn: int, n_layer: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d, eps=1e-5)
        self.fc = tensor_parallel.ColumnParallelLinear(
            d, ffn, config=cfg, init_method=init_method_normal(0.02), bias=True,
            gather_output=False)
        self.proj = tensor_parallel.RowParallelLinear(
            ffn, d, config=cfg, init_method=scaled_init_method_normal(0.02, n_layer), bias=True,
            input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc(self.norm(x))
        out, _ = self.proj(F.gelu(h, approximate="tanh"))
        return x + out


class Block(torch.nn.Module):
    def __init__(self, cfg, d, n_head, ffn, n_layer) -> None:
        super().__init__()
        self.attn = Attention(cfg, d, n_head, n_layer)
        self.mlp = MLP(cfg, d, ffn, n_layer)

    def forward(self, x):
        return self.mlp(self.attn(x))


class GPT(torch.nn.Module):
    def __init__(self, cfg: ModelParallelConfig, vocab_padded: int, vocab: int, d: int,
                 n_layer: int, n_head: int, ffn: int, seq_len: int) -> None:
        super().__init__()
        self.wte = tensor_parallel.VocabParallelEmbedding(
            vocab_padded, d, init_method=init_method_normal(0.02), config=cfg)
        self.wpe = torch.nn.Embedding(seq_len, d)
        init_method_normal(0.02)(self.wpe.weight)
        self.layers = torch.nn.ModuleList(Block(cfg, d, n_head, ffn, n_layer)
                                          for _ in range(n_layer))
        self.norm = torch.nn.LayerNorm(d, eps=1e-5)
        self.head = tensor_parallel.ColumnParallelLinear(
            d, vocab_padded, config=cfg, init_method=init_method_normal(0.02), bias=False,
            gather_output=False, skip_weight_param_allocation=True)
        # padded vocabulary entries of this rank's slice, masked out of the loss
        lo, hi = self.wte.vocab_start_index, self.wte.vocab_end_index
        self.pad_cols = torch.arange(lo, hi) >= vocab if hi > vocab else None

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        x = self.wte(ids) + self.wpe.weight[:T]               # [b, s, h]
        x = x.transpose(0, 1).contiguous()                    # [s, b, h], megatron's layout
        for layer in self.layers:
            x = layer(x)
        logits, _ = self.head(self.norm(x), weight=self.wte.weight)  # [s, b, V/tp]
        if self.pad_cols is not None:
            logits = logits.masked_fill(self.pad_cols, float("-inf"))
        losses = tensor_parallel.vocab_parallel_cross_entropy(logits, targets.t().contiguous())
        return losses.mean()


@torch.no_grad()
def clip_(params: list, max_norm: float) -> torch.Tensor:
    """megatron-core's get_grad_norm_fp32 + clip_grad_by_total_norm_fp32, on CPU: sum of
    squares of the grads that are not TP duplicates, all-reduced over the model-parallel
    group, then one scale of every grad."""
    mine = [p.grad for p in params
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)]
    sq = torch.stack([g.pow(2).sum() for g in mine]).sum() if mine else torch.zeros(())
    dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    total = sq.sqrt()
    if max_norm > 0:
        coef = max_norm / (float(total) + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_([p.grad for p in params if p.grad is not None], coef)
    return total


def full_state(model: torch.nn.Module) -> dict:
    """Unsharded copy of every parameter, gathered along megatron's partition_dim
    (collective: every rank must call it)."""
    out, group = {}, parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for k, p in model.named_parameters():
        t = p.detach()
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts, dim=p.partition_dim)
        out[k] = t.clone()
    return out


def main() -> None:
    args = parse_args(__doc__)
    rank, world = init_gloo()
    torch.use_deterministic_algorithms(True, warn_only=True)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                              perform_initialization=True, params_dtype=torch.float32,
                              gradient_accumulation_fusion=False, sequence_parallel=False)
    vp = padded_vocab(args.vocab, args.vocab_pad_to, world)

    torch.manual_seed(args.seed)  # master weights drawn in the same order at every tp
    model = GPT(cfg, vp, args.vocab, args.d_model, args.n_layer, args.n_head, args.ffn,
                args.seq_len)
    params = list(model.parameters())
    n_params = sum(p.numel() * (world if getattr(p, "tensor_model_parallel", False) else 1)
                   for p in params)
    if args.dump_init:
        full = full_state(model)
        if rank == 0:
            torch.save(full, args.dump_init)
    groups = adamw_groups(model.named_parameters())
    groups[0]["weight_decay"] = args.weight_decay
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def step_fn(step: int):
        x, y = batch(step, args, args.seed)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        norm = clip_(params, args.grad_clip)
        opt.step()
        return loss.detach(), norm

    with warnings.catch_warnings():  # CUDA_DEVICE_MAX_CONNECTIONS advice, irrelevant on CPU
        warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
        times, losses, norms = train_loop(args, rank, step_fn)
    write_json(args, rank, world, "megatron-core-tp", times, losses,
               {"megatron-core": megatron.core.__version__},
               {"padded_vocab": vp,
                # True at tp > 1: column layers all-reduce dgrad async, overlapping wgrad
                "async_dgrad_allreduce": bool(model.layers[0].attn.qkv.allreduce_dgrad),
                "config": "ModelParallelConfig(use_cpu_initialization=True, "
                          "gradient_accumulation_fusion=False, sequence_parallel=False, "
                          "async_tensor_model_parallel_allreduce=True)"},
               n_params=n_params, grad_norms=norms)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
