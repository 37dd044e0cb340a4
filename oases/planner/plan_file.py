"""The Plan file: per-block TP degrees plus what they were planned for.

    degrees: [4, 4, 2, 2, 1, 1, 2, 4]     # attn, mlp of layer 0, then layer 1, ...
    tp: 4
    model: {arch: gpt, n_layer: 4, d_model: 512, ...}
    schedule: oases
    recompute: fine
    micro_batch_size: 8
    sub_batches: 2
    cluster: two-nodes-1g
    predicted: {step_time_s: 0.41, memory_gib: 1.2, blocks: [...]}

The planner writes it, the runtime consumes it (``parallel.plan=<path>``), and a
test can write one by hand: only ``degrees`` (and ``model``/``tp`` for checking)
matter to the runtime. A plan may also give a ZeRO level (``parallel.zero``) per block, the embedding
and the head counting as blocks (2 n_layer + 2 entries, whole model, also when
pipelined; a plan may give only ``zero``):

    zero: [3, 3, 3, 2, 2, 0, 0, 1, 1, 3]  # embedding, attn/mlp of each layer, head

A pipelined plan gives ``stages`` instead (then
``degrees`` may be left out), one entry per stage, each with its own layout
(see oases.parallel.layout):

    stages:
      - {layers: [0, 5], dp: 1, tp: 4}
      - {layers: [5, 8], dp: 2, tp: 2, degrees: [2, 2, 1, 1, 2, 2]}

A plan the layout search made (``python -m oases.plan --search uniap|amp``) also
records the run it was priced for: ``pp``, ``tp`` (every stage's), ``cp``, the replica's
``micro_batch_size`` and ``micro_batches`` per step (``train.grad_accum``). The
runtime then refuses a run with other values (:func:`check_run`, naming the
overrides to pass); plans without ``micro_batches`` (hand-written, or ``tp-only``)
are not checked. A run under context parallelism takes only what the search writes
for it, whoever wrote the plan (:func:`check_cp`): every block at its stage's tp, even
stages of one tp, no sequence parallelism.

Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from oases.config.heads import heads_problem
from oases.config.schema import SHAPE_KEYS
from oases.errors import UserError
from oases.parallel.layout import even_split

# a plan's blocks and their degrees do not depend on the tied head or the biases
PLAN_SHAPE_KEYS = tuple(k for k in SHAPE_KEYS if k not in ("tie_embeddings", "bias"))


@dataclass
class Plan:
    degrees: list[int]
    tp: int
    model: dict
    stages: list = field(default_factory=list)
    zero: list = field(default_factory=list)
    schedule: str = "oases"
    recompute: str = "fine"
    micro_batch_size: int = 0
    sub_batches: int = 2
    pp: int = 0               # 0: not recorded
    micro_batches: int = 0    # per step (train.grad_accum); 0: not recorded
    sequence_parallel: bool = False  # the run turns parallel.sequence_parallel on
    pp_schedule: str = ""     # the pipeline schedule it was priced for ("": not recorded)
    pp_virtual: int = 1       # chunks per rank (interleaved-1f1b)
    cp: int = 1               # context parallelism it was priced at (parallel.cp)
    zero_secondary: str = "none"  # parallel.zero_secondary it was priced with
    grad_reduce_dtype: str = ""   # parallel.grad_reduce_dtype it was priced with ("": any)
    cluster: str = ""
    predicted: dict = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(yaml.safe_dump(asdict(self), sort_keys=False))
        tmp.replace(p)


def load_plan(path: str) -> Plan:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"plan file {path} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        raise UserError(f"plan file {path} is not valid YAML") from None
    except OSError as e:
        raise UserError(f"plan file {path} cannot be read: {e.strerror or e}") from None
    if not isinstance(data, dict) or not {"degrees", "stages", "zero"} & set(data):
        raise UserError(f"plan file {path} has no 'degrees', 'stages' or 'zero' list")
    known = set(Plan.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise UserError(f"plan file {path} has unknown keys: {', '.join(unknown)}")
    degrees = data.get("degrees", [])
    if not isinstance(data.get("stages", []), list):
        raise UserError(f"plan file {path}: stages must be a list")
    if not isinstance(degrees, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                for d in degrees):
        raise UserError(f"plan file {path}: degrees must be a list of integers")
    for k, least in (("pp", 0), ("micro_batches", 0), ("micro_batch_size", 0), ("tp", 1),
                     ("sub_batches", 1), ("pp_virtual", 1), ("cp", 1)):
        v = data.get(k, least)
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise UserError(f"plan file {path}: {k} must be an integer >= {least}, got {v!r}")
    for k, kind, name in (("sequence_parallel", bool, "true or false"),
                          ("model", dict, "a mapping"), ("predicted", dict, "a mapping"),
                          ("schedule", str, "a string"), ("recompute", str, "a string"),
                          ("cluster", str, "a string")):
        if data.get(k) is not None and not isinstance(data[k], kind):
            raise UserError(f"plan file {path}: {k} must be {name}, got {data[k]!r}")
    return Plan(**{k: data[k] for k in data if k in known and k != "tp"} | {
        "degrees": degrees, "tp": data.get("tp", max(degrees) if degrees else 1),
        "model": data.get("model") or {}})


def check_model(plan: Plan, model_cfg, path: str = "plan") -> None:
    """Reject a plan made for another model shape."""
    mismatch = [f"{k}: plan {plan.model[k]} vs model {getattr(model_cfg, k)}"
                for k in PLAN_SHAPE_KEYS if k in plan.model and plan.model[k] != getattr(model_cfg, k)]
    if mismatch:
        raise UserError(f"{path} was made for another model ({'; '.join(mismatch)})")


def check_run(plan: Plan, cfg, path: str = "plan") -> None:
    """A searched plan runs only with the layout and batch it was priced for: the same
    pp, tp, micro-batch size and count (so the same global batch), and the pipeline
    schedule it chose. One line naming the overrides that run it."""
    if not plan.micro_batches:
        return
    want = {"parallel.pp": plan.pp or 1, "parallel.tp": plan.tp, "parallel.cp": plan.cp,
            "train.micro_batch_size": plan.micro_batch_size,
            "train.grad_accum": plan.micro_batches}
    have = {"parallel.pp": cfg.parallel.pp, "parallel.tp": cfg.parallel.tp,
            "parallel.cp": cfg.parallel.cp,
            "train.micro_batch_size": cfg.train.micro_batch_size,
            "train.grad_accum": cfg.train.grad_accum}
    if plan.pp_schedule and (plan.pp or 1) > 1:  # its time and memory rows are the schedule's
        want["parallel.pp_schedule"] = plan.pp_schedule
        have["parallel.pp_schedule"] = cfg.parallel.pp_schedule
        if plan.pp_virtual > 1:  # interleaved: its chunks too
            want["parallel.pp_virtual"] = plan.pp_virtual
            have["parallel.pp_virtual"] = cfg.parallel.pp_virtual
    wrong = [f"{k}={have[k]}" for k in want if want[k] != have[k]]
    if wrong:
        raise UserError(f"{path} was made for {' '.join(f'{k}={v}' for k, v in want.items())}; "
                        f"this run has {', '.join(wrong)}")


def check_cp(plan: Plan, cfg, path: str = "plan") -> None:
    """Under ``parallel.cp`` > 1, only what the layout search writes for cp runs (the
    ring runs no per-block degrees; the search prices even stages of one tp, without
    sequence parallelism): one line naming what the plan has instead."""
    cp, n_layer = cfg.parallel.cp, cfg.model.n_layer
    if cp < 2:
        return
    pair = f"parallel.cp={cp} with {path}"
    if plan.sequence_parallel:
        raise UserError(f"{pair}: it turns sequence_parallel on, which the planner does not "
                        f"price with cp")
    mixed = [f"degrees {sorted(set(d))} at tp={tp}" for d, tp in
             [(plan.degrees, plan.tp)] + [(s.get("degrees") or [], s.get("tp")) for s in
                                          plan.stages if isinstance(s, dict)]
             if set(d) - {tp}]
    if mixed:
        raise UserError(f"{pair}: per-block TP degrees ({mixed[0]}) do not run under cp")
    if plan.stages:
        got = [(list(s.get("layers") or []), s.get("tp")) if isinstance(s, dict) else s
               for s in plan.stages]
        even = [([a, b], got[0][1]) for a, b in even_split(n_layer, len(got))]
        if got != even:
            raise UserError(f"{pair}: under cp the stages are the even split at one tp, "
                            f"{even} as (layers, tp), not {got}")


def check_plan(plan: Plan, model_cfg, tp: int, path: str = "plan") -> list[int]:
    """Reject a plan that does not fit this model and TP degree; return its degrees."""
    m = model_cfg
    n_blocks = 2 * m.n_layer
    check_model(plan, m, path)
    if plan.zero:
        check_zero(plan.zero, m.n_layer, path)
    if not plan.degrees and not plan.stages and plan.zero:  # ZeRO levels only
        return [tp] * n_blocks
    if len(plan.degrees) != n_blocks:
        raise UserError(f"{path} has {len(plan.degrees)} degrees but the model has {n_blocks} "
                        f"blocks (attn and mlp of {m.n_layer} layers)")
    if plan.tp != tp:
        raise UserError(f"{path} was made for parallel.tp={plan.tp}, this run has tp={tp}")
    check_degrees(plan.degrees, tp, m, path)
    return list(plan.degrees)


def check_degrees(degrees: list[int], tp: int, m, path: str, first_block: int = 0) -> None:
    """Every degree a power of two dividing ``tp`` (the stage's TP size) and the model's
    heads, kv heads (split or replicated whole, see oases.config.heads) and ffn width;
    ``first_block`` numbers the blocks in messages."""
    for j, t in enumerate(degrees):
        i = first_block + j
        what = "attn" if i % 2 == 0 else "mlp"
        if t < 1 or tp % t or t & (t - 1):
            raise UserError(f"{path}: block {i} ({what}) has degree {t}, which is not a power "
                            f"of two dividing tp={tp}")
        heads = heads_problem(m.n_head, m.n_kv_heads, t)  # kv heads: split or replicated
        if heads:
            raise UserError(f"{path}: block {i} ({what}) has degree {t}, which {heads}")
        if m.ffn_hidden % t:
            raise UserError(f"{path}: block {i} ({what}) has degree {t}, which does not "
                            f"divide model.ffn_hidden={m.ffn_hidden}")


def check_zero(zero, n_layer: int, path: str = "plan") -> list[int]:
    """A ZeRO level 0-3 for the embedding, each block and the head."""
    n = 2 * n_layer + 2
    if not isinstance(zero, list) or not all(isinstance(z, int) and not isinstance(z, bool)
                                             and 0 <= z <= 3 for z in zero):
        raise UserError(f"{path}: zero must be a list of ZeRO levels 0-3")
    if len(zero) != n:
        raise UserError(f"{path} has {len(zero)} ZeRO levels but the model has {n} blocks "
                        f"(embedding, attn and mlp of {n_layer} layers, head)")
    return list(zero)


def batch_divisor(degrees: list[int], tp: int) -> int:
    """Blocks of degree t split each (sub-)batch into tp/t parts."""
    return max((tp // t for t in degrees), default=1)


def model_dict(model_cfg) -> dict:
    return {k: getattr(model_cfg, k) for k in SHAPE_KEYS}


def fmt_table(rows: list[dict]) -> str:
    out = [f"{'block':>5} {'kind':<5} {'degree':>6} {'time (ms)':>10} {'memory (MiB)':>13}"]
    for r in rows:
        out.append(f"{r['block']:>5} {r['kind']:<5} {r['degree']:>6} {1e3 * r['time_s']:>10.2f} "
                   f"{r['memory_bytes'] / 2**20:>13.1f}")
    return "\n".join(out)

