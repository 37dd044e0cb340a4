"""Hugging Face interop: load ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` / ``MistralForCausalLM`` weights (any architecture whose spec has
``hf_weights``, oases/config/archs/) into a TP-sharded oases model, and export an oases
model as one.

    load_hf_weights(model, "ckpt/gpt2", ctx.tp_rank, ctx.tp)   # after build_model
    export_hf(full_state, model_cfg, "out/hf")                 # config.json + model.safetensors

Name mapping, as the built-in specs' ``hf_weights`` give it (``L`` a layer; GPT-2 names
under ``transformer.``, LLaMA under ``model.``; Qwen2 and Mistral use LLaMA's names,
Qwen2 with q/k/v biases):

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

from oases.config.archs import get_arch
from oases.config.hf import HF_FIELDS, hf_config_dict, hf_model_fields
from oases.errors import CheckpointError, UserError
from oases.parallel.sharding import chunk_of


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
    and HF tensor name -> its full HF shape; from the architecture's ``hf_weights``."""
    spec = get_arch(f["arch"])
    w = spec.hf_weights
    if w is None:
        raise UserError(f"model.arch={f['arch']!r} has no Hugging Face mapping")
    L, d, h, kv = f["n_layer"], f["d_model"], f["n_head"], f["n_kv_heads"]
    F, V, T, bias = f["ffn_hidden"], f["vocab_size"], f["seq_len"], f["bias"]
    hd = d // h
    m: dict[str, list[_Part]] = {}
    shapes: dict[str, tuple] = {}

    def put(ours: str, parts: list[_Part], hf_shapes: dict[str, tuple], have: bool = True):
        # a checkpoint with always_bias (GPT-2) has every bias (export writes zeros for
        # bias=false); others have the projection biases the model has
        if have or w.always_bias:
            shapes.update(hf_shapes)
        if have:
            m[ours] = parts

    def norm(ours: str, theirs: str):
        for kind in ("weight", "bias") if spec.norm == "layernorm" else ("weight",):
            put(f"{ours}.{kind}", [_Part(f"{theirs}.{kind}")], {f"{theirs}.{kind}": (d,)})

    def linear(ours: str, theirs: tuple[str, ...], n_in: int, outs: tuple[int, ...],
               has_bias: bool):
        """oases ``ours`` (its output rows the parts ``outs``) from HF ``theirs``: one
        name per part, or one fused name holding all parts along its output axis."""
        fused = len(theirs) == 1 and len(outs) > 1
        names = theirs * len(outs) if fused else theirs
        offsets = [sum(outs[:j]) if fused else 0 for j in range(len(outs))]
        lengths = [n if len(outs) > 1 else None for n in outs]
        full = {n: sum(outs) if fused else o for n, o in zip(names, outs)}
        wshape = {n: (n_in, o) if w.conv1d else (o, n_in) for n, o in full.items()}
        put(ours + ".weight", [_Part(n + ".weight", w.conv1d, a, ln)
                               for n, a, ln in zip(names, offsets, lengths)],
            {n + ".weight": s for n, s in wshape.items()})
        put(ours + ".bias", [_Part(n + ".bias", False, a, ln)
                             for n, a, ln in zip(names, offsets, lengths)],
            {n + ".bias": (o,) for n, o in full.items()}, has_bias)

    t = w.prefix
    put("embed.wte.weight", [_Part(t + w.embed, logical=V)], {t + w.embed: (V, d)})
    if w.positions:
        put("embed.wpe", [_Part(t + w.positions)], {t + w.positions: (T, d)})
    for i in range(L):
        o, x = f"layers.{i}.", t + w.layer.format(i=i)
        norm(o + "attn.norm", x + w.attn_norm)
        norm(o + "mlp.norm", x + w.mlp_norm)
        linear(o + "attn.qkv", tuple(x + n for n in w.qkv), d, (h * hd, kv * hd, kv * hd),
               bias or spec.qkv_bias)
        linear(o + "attn.proj", (x + w.attn_out,), h * hd, (d,), bias)
        mlp_in = tuple(x + n for n in w.mlp_in)
        linear(o + "mlp.fc", mlp_in, d, (F,) * len(mlp_in), bias)
        linear(o + "mlp.proj", (x + w.mlp_out,), F, (d,), bias)
    norm("norm", t + w.final_norm)
    if not f["tie_embeddings"]:
        put("head.weight", [_Part(w.head, logical=V)], {w.head: (V, d)})
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
    unused = get_arch(f["arch"]).unused_fields()
    for k, v in f.items():
        if k in unused:
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
