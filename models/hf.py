"""Hugging Face interop: load ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` / ``MistralForCausalLM`` weights into a TP-sharded oases model,
and export an oases model as one.

    load_hf_weights(model, "ckpt/gpt2", ctx.tp_rank, ctx.tp)   # after build_model
    export_hf(full_state, model_cfg, "out/hf")                 # config.json + model.safetensors

Name mapping (``L`` a layer; GPT-2 names under ``transformer.``, LLaMA under ``model.``;
Qwen2 and Mistral use LLaMA's names, Qwen2 with q/k/v biases):

| oases                     | GPT-2                          | LLaMA                              |
|---------------------------|--------------------------------|------------------------------------|
| embed.wte.weight          | wte.weight                     | embed_tokens.weight                |
| embed.wpe                 | wpe.weight                     | -                                  |
| layers.L.attn.norm.*      | h.L.ln_1.*                     | layers.L.input_layernorm.weight    |
| layers.L.attn.qkv.*       | h.L.attn.c_attn.* (q,k,v cols) | layers.L.self_attn.{q,k,v}_proj.*  |
| layers.L.attn.proj.*      | h.L.attn.c_proj.*              | layers.L.self_attn.o_proj.*        |
| layers.L.mlp.norm.*       | h.L.ln_2.*                     | layers.L.post_attention_layernorm  |
| layers.L.mlp.fc.*         | h.L.mlp.c_fc.*                 | layers.L.mlp.{gate,up}_proj.*      |
| layers.L.mlp.proj.*       | h.L.mlp.c_proj.*               | layers.L.mlp.down_proj.*           |
| norm.*                    | ln_f.*                         | norm.weight                        |
| head.weight (untied)      | lm_head.weight                 | lm_head.weight                     |

GPT-2's ``Conv1D`` stores weights ``[in, out]`` (transposed against ``nn.Linear``);
its fused ``c_attn`` is ``[q | k | v]`` along the output dim, which after the
transpose is exactly our fused ``qkv`` (``cat(q, k, v)`` rows). HF LLaMA's RoPE is
rotate-half, as ours: no permutation of q/k. The vocabulary rows are padded with
zeros up to the model's padded vocabulary.

Each rank reads only the rows/columns of its own shard (``safe_open().get_slice``
for safetensors, a memory-mapped ``torch.load`` for ``.bin``), part by part for
fused tensors, which gives exactly ``shard(full, p.tp_spec, tp_rank, tp)``. With more
TP ranks than kv heads, the ranks that share a kv head each read that head
(oases.config.heads); export starts from full tensors (a checkpoint's, where replicas
are saved once), so it writes every kv head once.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Optional

import torch

from oases.config.hf import GPT_UNUSED, HF_FIELDS, LLAMA_ARCHS, hf_model_fields
from oases.errors import CheckpointError, UserError
from oases.parallel.sharding import chunk_of

# model.arch -> its HF class, for the LLaMA-like architectures
_HF_NAMES = {arch: name for name, arch in LLAMA_ARCHS.items()}
LLAMA_FAMILY = tuple(_HF_NAMES)


@dataclass(frozen=True)
class _Part:
    """Where one (part of an) oases parameter lives in the HF checkpoint."""

    hf: str                        # HF tensor name
    transpose: bool = False        # stored [in, out] (GPT-2 Conv1D)
    offset: int = 0                # start along the HF axis that matches our fused axis
    length: Optional[int] = None   # length along our axis (None: the whole axis)
    logical: Optional[int] = None  # rows that hold real entries (vocab); the rest is padding


def hf_layout(f: dict) -> tuple[dict[str, list[_Part]], dict[str, tuple]]:
    """For model fields ``f`` (``ModelConfig`` names): oases parameter name -> its parts,
    and HF tensor name -> its full HF shape."""
    L, d, h, kv = f["n_layer"], f["d_model"], f["n_head"], f["n_kv_heads"]
    F, V, T, bias = f["ffn_hidden"], f["vocab_size"], f["seq_len"], f["bias"]
    hd = d // h
    m: dict[str, list[_Part]] = {}
    shapes: dict[str, tuple] = {}

    def put(ours: str, parts: list[_Part], hf_shapes: dict[str, tuple], have: bool = True):
        # GPT-2 always has biases (export writes zeros for a bias=false GPT); LLaMA has
        # projection biases only when attention_bias/mlp_bias are set
        if have or f["arch"] == "gpt":
            shapes.update(hf_shapes)
        if have:
            m[ours] = parts

    if f["arch"] == "gpt":
        t = "transformer."
        put("embed.wte.weight", [_Part(t + "wte.weight", logical=V)], {t + "wte.weight": (V, d)})
        put("embed.wpe", [_Part(t + "wpe.weight")], {t + "wpe.weight": (T, d)})
        for i in range(L):
            o, x = f"layers.{i}.", f"{t}h.{i}."
            for ours, theirs in (("attn.norm", "ln_1"), ("mlp.norm", "ln_2")):
                put(o + ours + ".weight", [_Part(x + theirs + ".weight")],
                    {x + theirs + ".weight": (d,)})
                put(o + ours + ".bias", [_Part(x + theirs + ".bias")], {x + theirs + ".bias": (d,)})
            c = x + "attn.c_attn."
            put(o + "attn.qkv.weight", [_Part(c + "weight", True, j * d, d) for j in range(3)],
                {c + "weight": (d, 3 * d)})
            put(o + "attn.qkv.bias", [_Part(c + "bias", False, j * d, d) for j in range(3)],
                {c + "bias": (3 * d,)}, bias)
            for ours, theirs, n_in, n_out in (("attn.proj", "attn.c_proj", d, d),
                                              ("mlp.fc", "mlp.c_fc", d, F),
                                              ("mlp.proj", "mlp.c_proj", F, d)):
                put(o + ours + ".weight", [_Part(x + theirs + ".weight", True)],
                    {x + theirs + ".weight": (n_in, n_out)})
                put(o + ours + ".bias", [_Part(x + theirs + ".bias")],
                    {x + theirs + ".bias": (n_out,)}, bias)
        put("norm.weight", [_Part(t + "ln_f.weight")], {t + "ln_f.weight": (d,)})
        put("norm.bias", [_Part(t + "ln_f.bias")], {t + "ln_f.bias": (d,)})
    elif f["arch"] in LLAMA_FAMILY:
        t = "model."
        put("embed.wte.weight", [_Part(t + "embed_tokens.weight", logical=V)],
            {t + "embed_tokens.weight": (V, d)})
        for i in range(L):
            o, x = f"layers.{i}.", f"{t}layers.{i}."
            put(o + "attn.norm.weight", [_Part(x + "input_layernorm.weight")],
                {x + "input_layernorm.weight": (d,)})
            put(o + "mlp.norm.weight", [_Part(x + "post_attention_layernorm.weight")],
                {x + "post_attention_layernorm.weight": (d,)})
            a = x + "self_attn."
            sizes = (("q_proj", h * hd), ("k_proj", kv * hd), ("v_proj", kv * hd))
            put(o + "attn.qkv.weight", [_Part(a + n + ".weight", length=s) for n, s in sizes],
                {a + n + ".weight": (s, d) for n, s in sizes})
            put(o + "attn.qkv.bias", [_Part(a + n + ".bias", length=s) for n, s in sizes],
                {a + n + ".bias": (s,) for n, s in sizes}, bias or f["arch"] == "qwen2")
            put(o + "attn.proj.weight", [_Part(a + "o_proj.weight")],
                {a + "o_proj.weight": (d, h * hd)})
            put(o + "attn.proj.bias", [_Part(a + "o_proj.bias")], {a + "o_proj.bias": (d,)}, bias)
            p = x + "mlp."
            gu = ("gate_proj", "up_proj")
            put(o + "mlp.fc.weight", [_Part(p + n + ".weight", length=F) for n in gu],
                {p + n + ".weight": (F, d) for n in gu})
            put(o + "mlp.fc.bias", [_Part(p + n + ".bias", length=F) for n in gu],
                {p + n + ".bias": (F,) for n in gu}, bias)
            put(o + "mlp.proj.weight", [_Part(p + "down_proj.weight")],
                {p + "down_proj.weight": (d, F)})
            put(o + "mlp.proj.bias", [_Part(p + "down_proj.bias")], {p + "down_proj.bias": (d,)},
                bias)
        put("norm.weight", [_Part(t + "norm.weight")], {t + "norm.weight": (d,)})
    else:
        raise UserError(f"model.arch={f['arch']!r} has no Hugging Face mapping")
    if not f["tie_embeddings"]:
        put("head.weight", [_Part("lm_head.weight", logical=V)], {"lm_head.weight": (V, d)})
    return m, shapes


# ---------------------------------------------------------------------------
# Reading an HF checkpoint directory, slice by slice.

def _weight_files(d: Path, index: str, weight_map, where: str) -> dict[str, Path]:
    """An index's ``weight_map`` (tensor name -> file) as paths in ``d``; a file name
    that leaves ``d`` (absolute, or with ``..``) is refused: the index is data, and must
    not make the loader read files elsewhere. Checked on the name, not the resolved path:
    a Hugging Face cache's snapshot directory holds symlinks into its blobs."""
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{where}: {index}'s weight_map is not a mapping of tensor "
                              f"names to file names")
    for name, file in weight_map.items():
        parts = PurePosixPath(file).parts
        if not parts or file.startswith("/") or ".." in parts or "\0" in file:
            raise CheckpointError(f"{where}: {index} puts {name} in {file!r}, which is "
                                  f"outside {d}; an index names files beside it")
    return {k: d / v for k, v in weight_map.items()}


class _Weights:
    """The tensors of an HF model directory: single-file or sharded (``*.index.json``),
    safetensors or torch pickle (``.bin``)."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.dir = Path(hf_dir)
        self.where = f"init_from hf:{hf_dir}"
        self._stack = contextlib.ExitStack()
        self._open: dict[Path, object] = {}
        d = self.dir
        for index, kind in (("model.safetensors.index.json", "st"),
                            ("pytorch_model.bin.index.json", "bin")):
            if (d / index).is_file():
                try:
                    wm = json.loads((d / index).read_text())["weight_map"]
                except (OSError, ValueError, KeyError, TypeError) as e:
                    raise CheckpointError(f"{self.where}: {index} is not a valid index "
                                          f"({type(e).__name__}: {e})") from None
                self.kind, self.files = kind, _weight_files(d, index, wm, self.where)
                return
        for single, kind in (("model.safetensors", "st"), ("pytorch_model.bin", "bin")):
            if (d / single).is_file():
                self.kind = kind
                self.files = {k: d / single for k in self._handle(d / single).keys()}
                return
        raise CheckpointError(f"{self.where}: no weights found (model.safetensors, "
                              f"pytorch_model.bin or a sharded *.index.json)")

    def __enter__(self) -> "_Weights":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._open.clear()

    def _handle(self, path: Path):
        h = self._open.get(path)
        if h is None:
            if not path.is_file():
                raise CheckpointError(f"{self.where}: weight file {path.name} (named by the "
                                      f"index) does not exist")
            try:
                if self.kind == "st":
                    from safetensors import safe_open  # deferred: optional (oases[hf])

                    h = self._stack.enter_context(safe_open(str(path), framework="pt"))
                else:
                    try:
                        h = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                    except RuntimeError:  # legacy (non-zip) pickle: no mmap
                        h = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any reader failure is a bad file
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise CheckpointError(f"{self.where}: cannot read {path.name}: {first}") from None
            self._open[path] = h
        return h

    def key(self, name: str) -> Optional[str]:
        """The stored key of HF tensor ``name`` (also found without the ``transformer.`` /
        ``model.`` prefix, as old GPT-2 checkpoints store it)."""
        if name in self.files:
            return name
        head, _, rest = name.partition(".")
        if head in ("transformer", "model") and rest in self.files:
            return rest
        return None

    def shape(self, key: str) -> tuple:
        h = self._handle(self.files[key])
        if self.kind == "st":
            return tuple(h.get_slice(key).get_shape())
        return tuple(h[key].shape)

    def read(self, key: str, axis: int, lo: int, hi: int) -> torch.Tensor:
        """Rows (axis 0) or columns (axis 1) ``[lo, hi)`` of tensor ``key``; only they are read."""
        h = self._handle(self.files[key])
        if self.kind == "st":
            sl = h.get_slice(key)
            return sl[lo:hi] if axis == 0 else sl[:, lo:hi]
        return h[key].narrow(axis, lo, hi - lo)


def _fmt(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _read_param(w: _Weights, p: torch.Tensor, parts: list[_Part], tp_rank: int, tp: int
                ) -> torch.Tensor:
    """This rank's shard of one parameter, read part by part."""
    spec = getattr(p, "tp_spec", None)
    axis = spec.dim if spec is not None else 0
    full = tuple(spec.full_shape) if spec is not None else tuple(p.shape)
    lens = [q.length if q.length is not None else full[axis] for q in parts]
    if spec is not None and spec.parts and tuple(lens) != tuple(spec.parts):
        raise UserError(f"HF parts {lens} do not match the model's fused parts {spec.parts}")
    sharded = spec is not None and tp > 1
    pieces = []
    for i, (q, n) in enumerate(zip(parts, lens)):
        # this rank's chunk of the part; kv heads replicated over ranks read the same one
        c, k = chunk_of(spec, i, tp_rank, tp) if sharded else (0, 1)
        a, b = c * n // k, (c + 1) * n // k
        shape = list(full)
        shape[axis] = b - a
        out = torch.zeros(shape, dtype=p.dtype)
        valid = min(b, q.logical) if q.logical is not None else b  # vocab padding stays zero
        if valid > a:
            hf_axis = 1 - axis if q.transpose else axis
            t = w.read(w.key(q.hf), hf_axis, q.offset + a, q.offset + valid)
            if q.transpose:
                t = t.t()
            out.narrow(axis, 0, valid - a).copy_(t)
        pieces.append(out)
    return torch.cat(pieces, dim=axis) if len(pieces) > 1 else pieces[0]


def model_fields(model_cfg) -> dict:
    """The shape fields of a ``ModelConfig`` as a dict (as ``hf_model_fields`` returns)."""
    return {k: getattr(model_cfg, k) for k in HF_FIELDS}


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str | Path, tp_rank: int, tp: int) -> None:
    """Overwrite every parameter of the (TP-sharded) ``model`` with this rank's shard of the
    HF checkpoint in ``hf_dir`` (a parameter's own ``tp_coords``, set by layers built on a
    sub-group, win over ``tp_rank``/``tp``). Missing tensors and tensors whose shape
    disagrees with ``config.json`` are :class:`~oases.errors.CheckpointError` (a one-line
    user error)."""
    where = f"init_from hf:{hf_dir}"
    f = hf_model_fields(hf_dir)
    ours = model_fields(model.cfg)
    for k, v in f.items():
        if k in GPT_UNUSED and f["arch"] == "gpt":
            continue
        if ours[k] != v and not (k == "seq_len" and ours[k] <= v):
            raise UserError(f"{where}: the model has {k}={ours[k]} but config.json says {v}")
    layout, shapes = hf_layout(f)
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in layout]
    if missing:
        raise UserError(f"{where}: no Hugging Face tensor maps to parameter {missing[0]}")
    with _Weights(hf_dir) as w:
        needed = sorted({q.hf for n in params for q in layout[n]})
        for name in needed:  # check everything before copying anything
            key = w.key(name)
            if key is None:
                raise CheckpointError(f"{where}: tensor {name} is missing from the weights")
            have = w.shape(key)
            if have != shapes[name]:
                raise CheckpointError(f"{where}: tensor {key} has shape {_fmt(have)} in the "
                                      f"weights but config.json implies {_fmt(shapes[name])}")
        for name, p in params.items():
            rank, size = getattr(p, "tp_coords", (tp_rank, tp))  # per-block TP degrees
            t = _read_param(w, p, layout[name], rank, size)
            if tuple(t.shape) != tuple(p.shape):  # pragma: no cover - a mapping bug
                raise RuntimeError(f"{name}: read {tuple(t.shape)} for a shard of {tuple(p.shape)}")
            p.copy_(t)


# ---------------------------------------------------------------------------
# Export.

def hf_config_dict(model_cfg) -> dict:
    """``config.json`` contents for an oases ``ModelConfig``."""
    c = model_cfg
    if c.arch == "gpt":
        special = 50256 if c.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, if present
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "vocab_size": c.vocab_size, "n_positions": c.seq_len, "n_embd": c.d_model,
            "n_layer": c.n_layer, "n_head": c.n_head, "n_inner": c.ffn_hidden,
            "activation_function": "gelu_new", "layer_norm_epsilon": c.norm_eps,
            "resid_pdrop": c.dropout, "embd_pdrop": c.dropout, "attn_pdrop": c.dropout,
            "initializer_range": c.init_std, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": bool(c.tie_embeddings), "use_cache": True,
            "bos_token_id": special, "eos_token_id": special, "dtype": "float32",
        }
    if c.arch in LLAMA_FAMILY:
        return _llama_config_dict(c)
    raise UserError(f"model.arch={c.arch!r} has no Hugging Face export")


def _rope_json(c) -> dict:
    """RoPE as both spellings: ``rope_theta`` + ``rope_scaling`` (transformers < 5,
    published Llama 3.x) and ``rope_parameters`` (transformers >= 5)."""
    rp = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type != "default":
        rp["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rp.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
                  original_max_position_embeddings=c.rope_original_max_len)
    scaling = None if c.rope_type == "default" else {k: v for k, v in rp.items()
                                                      if k != "rope_theta"}
    return {"rope_theta": c.rope_theta, "rope_scaling": scaling, "rope_parameters": rp}


def _llama_config_dict(c) -> dict:
    if c.arch == "llama" and c.sliding_window:  # pragma: no cover - the config refuses it
        raise UserError("export: LlamaForCausalLM has no sliding window")
    out = {
        "architectures": [_HF_NAMES[c.arch]], "model_type": c.arch,
        "vocab_size": c.vocab_size, "hidden_size": c.d_model,
        "intermediate_size": c.ffn_hidden, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.d_model // c.n_head, "hidden_act": "silu",
        # dynamic RoPE rescales past max_position_embeddings: it is the original length
        "max_position_embeddings": (c.rope_original_max_len if c.rope_type == "dynamic"
                                    else c.seq_len),
        "rms_norm_eps": c.norm_eps, **_rope_json(c),
        "attention_dropout": c.dropout, "initializer_range": c.init_std,
        "tie_word_embeddings": bool(c.tie_embeddings), "use_cache": True, "dtype": "float32",
    }
    if c.arch == "llama":
        out.update(attention_bias=bool(c.bias), mlp_bias=bool(c.bias), pretraining_tp=1)
    elif c.arch == "qwen2":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=c.n_layer)
    else:
        out.update(sliding_window=c.sliding_window or None)
    return out


def hf_tensors(name: str, t: torch.Tensor, parts) -> dict[str, torch.Tensor]:
    """The Hugging Face tensors made from the full oases tensor ``name`` (``parts``: its
    entry of :func:`hf_layout`; each HF tensor comes from one oases tensor, a fused one's
    parts or a slice of it). One tensor at a time, so an export can stream."""
    lens = [q.length if q.length is not None else t.shape[0] for q in parts]
    if sum(lens) != t.shape[0]:
        raise UserError(f"export: tensor {name} has shape {_fmt(t.shape)}, expected "
                        f"{sum(lens)} rows for parts {lens}")
    got: dict[str, list] = {}
    for q, piece in zip(parts, t.split(lens, dim=0)):
        if q.logical is not None:
            piece = piece[: q.logical]  # the vocabulary padding is not exported
        if q.transpose:
            piece = piece.t()
        got.setdefault(q.hf, []).append((q.offset, 1 if q.transpose else 0, piece))
    # one piece stays a view (no copy: an export streams at about the largest tensor)
    return {hf: gs[0][2] if len(gs) == 1 else
            torch.cat([g[2] for g in sorted(gs, key=lambda g: g[0])], dim=gs[0][1])
            for hf, gs in got.items()}


def hf_state_dict(model_state_full: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """Full oases tensors (fused parts concatenated, vocab padded or not) -> HF tensors."""
    f = model_fields(model_cfg)
    layout, shapes = hf_layout(f)
    extra = sorted(set(model_state_full) - set(layout))
    if extra:
        raise UserError(f"export: tensor {extra[0]} has no Hugging Face name "
                        f"(tie_embeddings={f['tie_embeddings']}, bias={f['bias']})")
    made: dict[str, torch.Tensor] = {}
    for name, parts in layout.items():
        if name not in model_state_full:
            raise UserError(f"export: the checkpoint has no tensor {name}")
        made.update(hf_tensors(name, model_state_full[name].detach().cpu(), parts))
    out = {}
    for hf_name, shape in shapes.items():
        if hf_name not in made:  # a GPT exported with bias=false: HF GPT-2 always has biases
            out[hf_name] = torch.zeros(shape)
            continue
        t = made[hf_name]
        if tuple(t.shape) != tuple(shape):
            raise UserError(f"export: {hf_name} would have shape {_fmt(t.shape)}, expected "
                            f"{_fmt(shape)}")
        out[hf_name] = t.contiguous().clone()
    return out


def export_hf(model_state_full: dict[str, torch.Tensor], model_cfg, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` loadable by
    ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / ... ``.from_pretrained(out_dir)``."""
    from safetensors.torch import save_file  # deferred: optional (oases[hf])

    cfg_json = hf_config_dict(model_cfg)
    tensors = hf_state_dict(model_state_full, model_cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    return out


__all__ = ["load_hf_weights", "export_hf", "hf_state_dict", "hf_config_dict", "hf_layout"]
