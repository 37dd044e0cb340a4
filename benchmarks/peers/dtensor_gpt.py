"""Peer: oases' GPT shape, tensor-parallel with PyTorch's own DTensor TP API.

    torchrun --standalone --nproc_per_node=2 -m benchmarks.peers.dtensor_gpt \
        --d-model 128 --n-layer 2 --n-head 4 --seq-len 64 --micro-batch-size 4 \
        --steps 5 --warmup 1 --out-json /tmp/dtensor.json

The model is plain ``nn.Module``s (``nn.Embedding``, ``nn.LayerNorm``, ``nn.Linear``) with
no parallelism in it; ``torch.distributed.tensor.parallel.parallelize_module`` then shards
it over a 1-D ``DeviceMesh("cpu", (tp,))`` (gloo) with the torchtitan-style plan:

    wte        RowwiseParallel(input=Replicate, output=Replicate)     vocab-parallel embedding
    attn.qkv   ColwiseParallel                                        (or wq/wk/wv, --qkv separate)
    attn.proj  RowwiseParallel
    mlp.fc     ColwiseParallel
    mlp.proj   RowwiseParallel
    head       ColwiseParallel(input=Replicate, output=Shard(-1), use_local_output=False)
    loss       F.cross_entropy inside loss_parallel(): vocab-parallel cross entropy

``head.weight`` is re-tied to ``wte.weight`` after sharding (both are Shard(0) over the
vocabulary, so one DTensor serves both). After sharding each attention module's head count
is set to the local one, ``n_head // tp`` (torchtitan does the same in its llama
``parallelize``: the module keeps computing with its own head count, which must be the
per-rank one once q/k/v are column-sharded).

The fused qkv weight is laid out head-major, rows ordered (head, {q,k,v}, head_dim) -- the
layout Megatron uses for ``linear_qkv`` -- so that ColwiseParallel's contiguous row split
hands every rank whole heads with their own q, k and v. ``--qkv separate`` uses three
``nn.Linear`` as torchtitan does instead.

Parameters are initialised on the full (unsharded) model from one seed on every rank, then
sharded, so the initial model is the same function at every tp. Every other parameter
(LayerNorms, positions, the row-parallel biases' replicas) stays a plain replicated tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)

from benchmarks.peers.common import (adamw_groups, batch, init_gloo, padded_vocab, parse_args,
                                      train_loop, write_json)


class Attention(nn.Module):
    def __init__(self, d: int, n_head: int, n_layer: int, separate_qkv: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, eps=1e-5)
        self.n_head = n_head            # set to the local count by parallelize()
        self.head_dim = d // n_head
        self.separate = separate_qkv
        if separate_qkv:
            self.wq, self.wk, self.wv = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        else:
            self.qkv = nn.Linear(d, 3 * d)  # rows: (head, {q,k,v}, head_dim)
        self.proj = nn.Linear(d, d)
        self.proj.scaled_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        B, T, _ = h.shape
        if self.separate:
            q, k, v = (w(h).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                       for w in (self.wq, self.wk, self.wv))
        else:
            qkv = self.qkv(h).view(B, T, self.n_head, 3, self.head_dim)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))     # (B, nh, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        return x + self.proj(y)


class MLP(nn.Module):
    def __init__(self, d: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, eps=1e-5)
        self.fc = nn.Linear(d, ffn)
        self.proj = nn.Linear(ffn, d)
        self.proj.scaled_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x)), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d, n_head, ffn, n_layer, separate_qkv) -> None:
        super().__init__()
        self.attn = Attention(d, n_head, n_layer, separate_qkv)
        self.mlp = MLP(d, ffn)

    def forward(self, x):
        return self.mlp(self.attn(x))


class GPT(nn.Module):
    """Pre-LN GPT-2: learned positions, tied embeddings, tanh-GELU MLP, biases."""

    def __init__(self, vocab_padded: int, vocab: int, d: int, n_layer: int, n_head: int,
                 ffn: int, seq_len: int, separate_qkv: bool = False) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte = nn.Embedding(vocab_padded, d)
        self.wpe = nn.Parameter(torch.empty(seq_len, d))
        self.layers = nn.ModuleList(Block(d, n_head, ffn, n_layer, separate_qkv)
                                    for _ in range(n_layer))
        self.norm = nn.LayerNorm(d, eps=1e-5)
        self.head = nn.Linear(d, vocab_padded, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.pad_mask = None  # (V_pad,) additive mask of the padded logits, set if V_pad > V
        self._init(n_layer)

    @torch.no_grad()
    def _init(self, n_layer: int, std: float = 0.02) -> None:
        """oases' init: N(0, 0.02), output projections N(0, 0.02/sqrt(2L)), zero biases,
        LayerNorm ones/zeros; in module order from the global generator."""
        nn.init.normal_(self.wte.weight, 0.0, std)
        nn.init.normal_(self.wpe, 0.0, std)
        for m in self.modules():
            if isinstance(m, nn.Linear) and m is not self.head:
                s = std / math.sqrt(2 * n_layer) if getattr(m, "scaled_init", False) else std
                nn.init.normal_(m.weight, 0.0, s)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))  # DTensor, Shard(-1) over the vocabulary
        if self.pad_mask is not None:
            logits = logits + self.pad_mask
        return logits


def parallelize(model: GPT, mesh, n_head: int, vocab: int) -> GPT:
    tp = mesh.size()
    layer_plan = {"attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(),
                  "mlp.proj": RowwiseParallel()}
    if model.layers[0].attn.separate:
        layer_plan.update({"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                           "attn.wv": ColwiseParallel()})
    else:
        layer_plan["attn.qkv"] = ColwiseParallel()
    for layer in model.layers:
        parallelize_module(layer, mesh, layer_plan)
        assert n_head % tp == 0, f"tp={tp} does not divide n_head={n_head}"
        layer.attn.n_head = n_head // tp  # local heads (torchtitan: n_heads // tp)
    parallelize_module(model, mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                use_local_output=False),
    })
    model.head.weight = model.wte.weight  # re-tie: each module got its own DTensor copy
    assert isinstance(model.wte.weight, DTensor) and model.wte.weight.placements == (Shard(0),)
    vp = model.wte.weight.shape[0]
    if vp > vocab:
        mask = torch.zeros(vp)
        mask[vocab:] = float("-inf")
        model.pad_mask = distribute_tensor(mask, mesh, [Shard(0)])
    return model


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """oases' decay split, each further split into DTensor and plain parameters so that a
    foreach kernel never sees the two kinds in one list."""
    out = []
    for g in adamw_groups(model.named_parameters()):
        wd = g.get("weight_decay", weight_decay)
        for want in (True, False):
            ps = [p for p in g["params"] if isinstance(p, DTensor) == want]
            if ps:
                out.append({"params": ps, "weight_decay": wd})
    return out


@torch.no_grad()
def clip_(params: list, max_norm: float) -> torch.Tensor:
    """Global-norm clipping over DTensor (sharded) and plain (replicated) gradients with
    torch's own helpers: get_total_norm reduces the DTensor shards itself."""
    gd = [p.grad for p in params if p.grad is not None and isinstance(p.grad, DTensor)]
    gp = [p.grad for p in params if p.grad is not None and not isinstance(p.grad, DTensor)]
    sq = torch.zeros(())
    if gd:
        nd = torch.nn.utils.get_total_norm(gd)
        sq = sq + (nd.full_tensor() if isinstance(nd, DTensor) else nd) ** 2
    if gp:
        sq = sq + torch.nn.utils.get_total_norm(gp) ** 2
    total = sq.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if gd:
            torch._foreach_mul_([g.to_local() for g in gd], coef)
        if gp:
            torch._foreach_mul_(gp, coef)
    return total


def full_state(model: nn.Module) -> dict:
    """Unsharded copy of every parameter (collective: every rank must call it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}


def main() -> None:
    args = parse_args(__doc__, lambda p: p.add_argument(
        "--qkv", choices=["fused", "separate"], default="fused",
        help="fused: one head-major qkv Linear; separate: wq/wk/wv as torchtitan"))
    separate = args.qkv == "separate"
    rank, world = init_gloo()
    torch.use_deterministic_algorithms(True, warn_only=True)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    vp = padded_vocab(args.vocab, args.vocab_pad_to, world)

    torch.manual_seed(args.seed)  # same full init on every rank and at every tp
    model = GPT(vp, args.vocab, args.d_model, args.n_layer, args.n_head, args.ffn, args.seq_len,
                separate_qkv=separate)
    model = parallelize(model, mesh, args.n_head, args.vocab)
    params = list(model.parameters())  # the tied weight once
    n_params = sum(p.numel() for p in params)  # DTensor.numel() is the global size
    if args.dump_init:
        full = full_state(model)
        if rank == 0:
            torch.save(full, args.dump_init)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)

    def step_fn(step: int):
        x, y = batch(step, args, args.seed)
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        norm = clip_(params, args.grad_clip)
        opt.step()
        loss = loss.detach()
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss), norm

    times, losses, norms = train_loop(args, rank, step_fn)
    write_json(args, rank, world, "pytorch-dtensor-tp", times, losses, {},
               {"qkv": "separate" if separate else "fused-head-major",
                "padded_vocab": vp,
                "plan": "wte Rowwise, qkv/fc Colwise, proj Rowwise, tied head Colwise + loss_parallel"},
               n_params=n_params, grad_norms=norms)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
