"""Typed run configuration: the single source of truth.

A config is built from a YAML file, then ``a.b=value`` overrides, then checked:

    cfg = load_config("configs/gpt-tiny.yaml", ["train.steps=50", "parallel.tp=2"])
    cfg.validate(world_size=2)

Unknown keys, wrong types and impossible values raise :class:`ConfigError` with
a one-line message that names the key (and the near miss for a typo).
This module imports no ``torch.distributed``: it is testable anywhere.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from oases.config.blend_spec import check_blend
from oases.config.heads import heads_problem
from oases.config.layout_checks import cp_needs, interleaving_needs, overlap_fb_needs
from oases.config.model import SHAPE_KEYS, ModelConfig
from oases.config.observe import MetricsConfig, ProfileConfig, WandbConfig
from oases.config.section import choice, positive, Section
from oases.config.typed_yaml import build_dataclass, set_dotted
from oases.errors import ConfigError

PRECISIONS = ("auto", "fp32", "bf16", "bf16-autocast")
BF16_PRECISIONS = ("bf16", "bf16-autocast")  # both compute in bf16 under autocast
# The longest parallel.timeout_s: torch turns it into a timedelta (inf overflows) and
# gloo and NCCL into int64 nanoseconds added to a clock (past ~9e9 s they wrap).
MAX_TIMEOUT_S = 1e8


def resolve_precision(precision: str, device_type: str) -> str:
    """``train.precision`` as a run on a ``device_type`` device ("cuda", "cpu") uses it:
    ``auto`` is bf16 on CUDA (bf16 weights over fp32 masters; tensor cores) and fp32
    elsewhere (bf16 on a CPU is slower than fp32); the others stay."""
    if precision != "auto":
        return precision
    return "bf16" if device_type == "cuda" else "fp32"


@dataclass
class ParallelConfig(Section):
    tp: int = 1
    # Pipeline stages: the layers are split into pp stages on consecutive blocks of
    # world/pp ranks; each stage is dp x tp (dp = world / (pp x tp)), or its own layout
    # from a plan file's ``stages``.
    pp: int = 1
    # "1f1b" (Megatron's), "eager-1f1b" (more warm-up forwards, so each send overlaps the
    # next forward: paper 002 section 4), "gpipe" (all forwards, then all backwards),
    # "zb-h1" (1f1b with each backward's weight gradients moved into the bubble: Qi et
    # al. 2024), "eager-zb-h1" (both) or "interleaved-1f1b" (pp_virtual stages per rank:
    # Megatron's virtual pipeline); docs/pipelines.md says when to choose which
    pp_schedule: str = "1f1b"
    # interleaved-1f1b only: stages (chunks of layers) per rank, v >= 2; rank r holds
    # virtual stages r, r + pp, ..., so the bubble shrinks about v-fold for v times the
    # transfers
    pp_virtual: int = 1
    # Context parallelism: each sequence split over cp ranks (two head-tail chunks each,
    # attention through a ring of kv blocks; docs/context-parallel.md). world = pp x dp x
    # cp x tp; the cp ranks of a replica read the same rows and sum gradients with dp.
    cp: int = 1
    # cp > 1: post each ring step's receive before its attention and wait after (false:
    # wait at once; the benchmark's exposed baseline)
    cp_overlap: bool = True
    # How activations cross a stage boundary (oases.pipeline.cross_mesh): "broadcast"
    # (each slice crosses once, from load-balanced senders, then fans out inside the
    # receiving replica), "send" (one send per receiver) or "allgather" (Megatron's
    # scatter-gather)
    pp_transfer: str = "broadcast"
    # "megatron": ordinary autograd, blocking all-reduce after every row-parallel layer
    #   (the backward all-reduce of the column input gradient overlaps the weight gradient);
    # "oases": two sub-batches interleaved so every TP collective overlaps compute.
    schedule: str = "megatron"
    # "none": save everything; "selective": everything but the attention core's
    # activations (recomputed, as Megatron's selective); "full": recompute each
    # transformer layer (forward all-reduces included); "fine" (oases only): save each
    # forward all-reduce's output and recompute from there, never re-issuing a forward
    # collective.
    recompute: str = "none"
    # oases schedule only: sub-batches per micro-batch (split along the batch; 1: no
    # split). "auto": chosen at start-up by timing the counts the micro-batch takes (1, 2,
    # and 4 under sequence_parallel, whose turns are then staggered so that both of a
    # block's collectives hide) on the run's own devices (oases.runtime.sub_batches)
    sub_batches: Union[int, str] = "auto"
    # oases only: run each micro-batch's backward interleaved with the next one's forward
    # (pp=1 with grad_accum >= 2; a pipeline's eager-1f1b steady state), so the forward's
    # all-reduces hide behind the backward's compute. sub_batches may then be 1.
    overlap_fb: bool = False
    # Sequence parallelism: outside the matmuls (norms, dropout, residual stream, what
    # recompute keeps) each TP rank holds 1/tp of the sequence; each all-reduce becomes an
    # all-gather and a reduce-scatter (docs/sequence-parallel.md). Both engines.
    sequence_parallel: bool = False
    backend: str = "auto"           # "auto" (nccl on CUDA, gloo on CPU) | "gloo" | "nccl"
    device: str = "auto"            # "auto" (cuda if available) | "cpu" | "cuda"
    timeout_s: float = 600.0        # collective timeout: a dead peer raises instead of hanging
    # NCCL only: the TP groups' collectives on high-priority CUDA streams, so that they
    # start ahead of DP/ZeRO traffic queued on the GPU (docs/overlap.md)
    nccl_high_priority_tp: bool = False
    dp_bucket_mb: float = 25.0      # DP gradient all-reduce bucket size
    # the dtype DP/ZeRO gradients are summed in on the wire; they accumulate in fp32
    # either way (bf16: half the bytes, a coarser sum; auto: the layout search's choice;
    # docs/zero.md)
    grad_reduce_dtype: str = "fp32"
    # Sharded data parallelism over the dp ranks (and the replicas of a block below the
    # full TP degree): 0 replicated; 1 Adam state sharded; 2 + gradients (reduce-scatter
    # instead of all-reduce); 3 + parameters (all-gathered before each block, freed
    # after). A plan file's per-block ``zero`` list overrides it block by block.
    zero: int = 0
    # ZeRO-3: start the all-gather of the next block's parameters while this block runs
    # (false: gather each block when it is needed; the benchmark's exposed baseline)
    zero_prefetch: bool = True
    # ZeRO-3: "node" keeps a second shard of the parameters over each DP group's ranks on a
    # node (ZeRO++'s hpZ), so that forward and backward gather inside the node and only the
    # first gather after each step crosses nodes; costs 1/L of the parameters per rank,
    # L = the group's ranks per node (docs/zero.md). "none": every gather over the group
    zero_secondary: str = "none"
    # plan_search=uniap|amp prices every ZeRO level (and, at 3, the secondary shard) for
    # each layout and runs the fastest that fits (docs/zero.md)
    zero_search: bool = False
    # Timing only: replace every TP collective by a no-op of the same shape (results are
    # wrong). Gives the no-communication upper bound in benchmarks.
    tp_comm_noop: bool = False
    trace: bool = False             # trace_rank{r}.json: a profiler view of one step
    # torch.compile each block's partial and combine (oases.parallel.compile): false | true
    # | "strict" (a segment that does not compile is an error, not an eager fallback)
    compile: Union[bool, str] = False
    # Per-block TP degrees: a Plan YAML path (python -m oases.plan), or "auto": profile
    # this cluster, solve on rank 0 and broadcast. Empty: every block at degree tp.
    plan: str = ""
    cluster: str = ""               # cluster file for plan=auto (memory limit, names)
    memory_limit_gib: float = 0.0   # plan=auto memory limit per device (0: cluster file / device)
    # plan=auto: time this many real training steps at degree tp (after 2 warm-up steps,
    # on a throwaway model) and fit the cost model's host cost of communication to them
    # before solving. 0: solve on the profile alone.
    plan_calibration_steps: int = 5
    # plan=auto: "tp-only" (per-block degrees for the config's pp=1 x tp), or "uniap" / "amp":
    # the whole layout (pp, stages, dp x tp, degrees, micro-batches) searched on the
    # parallel.cluster file before the run's groups exist (oases.planner.auto_layout)
    plan_search: str = "tp-only"
    plan_trials: int = 1            # uniap/amp: time the k best plans live, run the fastest

    @property
    def searches_layout(self) -> bool:
        """plan=auto with plan_search uniap or amp: the whole layout is searched."""
        return self.plan == "auto" and self.plan_search != "tp-only"

    def validate(self) -> None:
        positive("parallel.tp", self.tp)
        positive("parallel.pp", self.pp)
        positive("parallel.cp", self.cp)
        choice("parallel.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        if isinstance(self.pp_virtual, bool) or not isinstance(self.pp_virtual, int):
            raise ConfigError(f"parallel.pp_virtual={self.pp_virtual!r} is not an integer")
        positive("parallel.pp_virtual", self.pp_virtual)
        if self.pp_schedule == "interleaved-1f1b" and self.pp_virtual < 2:
            raise ConfigError("parallel.pp_schedule=interleaved-1f1b needs parallel.pp_virtual "
                              ">= 2 stages per rank (at 1 its lists are eager-1f1b's)")
        if self.pp_virtual > 1 and self.pp_schedule != "interleaved-1f1b":
            raise ConfigError(f"parallel.pp_virtual={self.pp_virtual} needs parallel."
                              f"pp_schedule=interleaved-1f1b, not {self.pp_schedule}")
        choice("parallel.pp_transfer", self.pp_transfer, ("broadcast", "send", "allgather"))
        choice("parallel.schedule", self.schedule, ("megatron", "oases"))
        choice("parallel.recompute", self.recompute, ("none", "selective", "full", "fine"))
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        choice("parallel.zero_secondary", self.zero_secondary, ("none", "node"))
        if self.zero_secondary == "node" and self.zero != 3:
            raise ConfigError(f"parallel.zero_secondary=node shards ZeRO-3's parameters a "
                              f"second time: it needs parallel.zero=3, got {self.zero}")
        if self.recompute == "fine" and self.schedule != "oases":
            raise ConfigError("parallel.recompute=fine needs parallel.schedule=oases")
        if self.overlap_fb and self.schedule != "oases":
            raise ConfigError("parallel.overlap_fb needs parallel.schedule=oases")
        if isinstance(self.sub_batches, str):
            if self.sub_batches != "auto":
                raise ConfigError(f"parallel.sub_batches={self.sub_batches!r} is not an "
                                  f"integer or auto")
        elif isinstance(self.sub_batches, bool) or self.sub_batches < 1:
            raise ConfigError(f"parallel.sub_batches={self.sub_batches!r} must be >= 1 "
                              f"(or auto)")
        if self.compile not in (False, True, "strict"):
            raise ConfigError(f"parallel.compile={self.compile!r} is not one of false, true, "
                              f"strict")
        choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))
        choice("parallel.device", self.device, ("auto", "cpu", "cuda"))
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # inf and NaN too
            raise ConfigError(f"parallel.timeout_s={self.timeout_s} must be a number of "
                              f"seconds in (0, {MAX_TIMEOUT_S:.0e}] (about three years)")
        if self.nccl_high_priority_tp and (self.backend == "gloo" or self.device == "cpu"):
            raise ConfigError("parallel.nccl_high_priority_tp needs NCCL on CUDA (parallel."
                              f"backend={self.backend}, parallel.device={self.device})")
        positive("parallel.dp_bucket_mb", self.dp_bucket_mb)
        choice("parallel.grad_reduce_dtype", self.grad_reduce_dtype, ("fp32", "bf16", "auto"))
        searched = self.plan == "auto" and self.plan_search != "tp-only"
        if (self.zero_search or self.grad_reduce_dtype == "auto") and not searched:
            raise ConfigError("parallel.zero_search and grad_reduce_dtype=auto are the layout "
                              "search's: they need parallel.plan=auto, plan_search=uniap|amp")
        positive("parallel.plan_calibration_steps", self.plan_calibration_steps, allow_zero=True)
        choice("parallel.plan_search", self.plan_search, ("tp-only", "uniap", "amp"))
        positive("parallel.plan_trials", self.plan_trials)
        if self.plan_trials > 1 and (self.plan != "auto" or self.plan_search == "tp-only"):
            raise ConfigError("parallel.plan_trials times searched layouts: it needs "
                              "parallel.plan=auto and parallel.plan_search=uniap or amp")


@dataclass
class TrainConfig(Section):
    steps: int = 100
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0          # 0 disables clipping
    # "auto" (resolve_precision) | "fp32" | "bf16" (bf16 weights, fp32 master and
    # main-grad) | "bf16-autocast" (fp32 weights under autocast)
    precision: str = "auto"
    log_interval: int = 1
    on_nonfinite: str = "stop"      # non-finite loss/grads: "stop" (a clear message) | "skip"

    def validate(self) -> None:
        choice("train.on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        for k in ("steps", "micro_batch_size", "grad_accum", "log_interval"):
            positive(f"train.{k}", getattr(self, k))
        positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        positive("train.lr", self.lr)
        positive("train.min_lr", self.min_lr, allow_zero=True)
        if not self.min_lr <= self.lr:
            raise ConfigError(f"train.min_lr={self.min_lr} is larger than train.lr={self.lr}")
        positive("train.weight_decay", self.weight_decay, allow_zero=True)
        positive("train.grad_clip", self.grad_clip, allow_zero=True)
        for k in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, k) < 1.0:
                raise ConfigError(f"train.{k}={getattr(self, k)} must be in [0, 1)")
        choice("train.precision", self.precision, PRECISIONS)


@dataclass
class DataConfig(Section):
    kind: str = "synthetic"         # "synthetic" | "tokens"
    train_path: str = ""            # token file, DIR/train, Megatron prefix, glob (docs/data.md)
    # Or a blend of token files: a list of {path: FILE, weight: W}; weights > 0 are
    # normalised to sum 1 (oases.runtime.blend). Exclusive with train_path.
    train_paths: Optional[list] = None
    val_path: str = ""              # optional; enables eval.interval
    dtype: str = "uint16"           # token file dtype: "uint16" | "uint32"
    eos_id: int = -1                # the id ending each document (-1: meta.json's eos_id)
    reset_attention_at_eos: bool = False  # attention within documents (mask cut at each EOS)
    reset_position_ids: bool = False  # positions restart at each document (needs documents)
    loss_on: str = "assistant"      # chat data: "assistant" (assistant tokens) | "all" (not pads)

    def blend(self, check_files: bool = True) -> list[tuple[str, float]]:
        """``train_paths`` checked, as ``[(path, weight), ...]`` with the weights
        normalised to sum 1 (:func:`oases.config.blend_spec.check_blend`)."""
        return check_blend(self.train_paths, check_files)

    def validate(self) -> None:
        choice("data.kind", self.kind, ("synthetic", "tokens"))
        choice("data.dtype", self.dtype, ("uint16", "uint32"))
        choice("data.loss_on", self.loss_on, ("assistant", "all"))
        if self.reset_position_ids and self.kind == "synthetic":
            raise ConfigError("data.reset_position_ids restarts positions at each document: "
                              "synthetic data has none (use data.kind=tokens)")
        if self.train_paths is not None:
            if self.train_path:
                raise ConfigError("data.train_path and data.train_paths are both set; keep one "
                                  "(the override data.train_path= clears the file)")
            self.blend(check_files=self.kind == "tokens")
        elif self.kind == "tokens" and not self.train_path:
            raise ConfigError("data.kind=tokens needs data.train_path (or data.train_paths)")


@dataclass
class EvalConfig(Section):
    interval: int = 0               # run validation every N steps (0: never); also at the end
    max_batches: int = 8            # val windows used: max_batches x micro_batch_size x dp
    only: bool = False              # evaluate (init_from or resume) and exit, no training

    def validate(self) -> None:
        positive("eval.interval", self.interval, allow_zero=True)
        positive("eval.max_batches", self.max_batches)


@dataclass
class CheckpointConfig(Section):
    interval: int = 0               # save every N steps (0: only at the end)
    keep: int = 2                   # complete checkpoints kept on disk (newest first)
    save_final: bool = True
    async_save: bool = False        # write in the background (DCP async_save), see checkpoints.md

    def validate(self) -> None:
        positive("checkpoint.interval", self.interval, allow_zero=True)
        positive("checkpoint.keep", self.keep)
        if self.async_save and self.keep == 1:  # torchtitan refuses keep_latest_k == 1 alike
            raise ConfigError("checkpoint.keep=1 with checkpoint.async_save=true: keep at least "
                              "2, so a complete checkpoint stays on disk while the next one is "
                              "written and published in the background")


@dataclass
class Config(Section):
    out_dir: str = "runs/default"
    seed: int = 1234
    resume: str = "none"            # "none" | "auto" (latest complete checkpoint in out_dir)
    debug: bool = False             # show tracebacks for bad-input errors
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    _world_size = 1  # not a field: set by validate()

    # ---- derived values (set by validate) ----
    @property
    def dp(self) -> int:
        """Data-parallel degree of the default layout (replicas reading their own rows):
        world / (pp x cp x tp)."""
        par = self.parallel
        return self._world_size // (par.tp * par.pp * par.cp)

    @property
    def pipeline_batch(self) -> int:
        """Sequences in one micro-batch of the whole pipeline (all DP replicas): a stage
        with its own layout (dp_s, tp_s) gives each replica pipeline_batch / dp_s."""
        return self.train.micro_batch_size * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.train.micro_batch_size * self.train.grad_accum * self.dp

    @property
    def sub_batches(self) -> int:
        """Sub-batches per micro-batch under the oases engine: ``parallel.sub_batches``,
        or for "auto" the count to assume before a run decides (4 under sequence
        parallelism when the micro-batch splits in four, else 2 where it splits in two,
        else 1). A run decides "auto" at start-up (:mod:`oases.runtime.sub_batches`)
        and carries the integer on from there."""
        n = self.parallel.sub_batches
        if n != "auto":
            return n
        mbs = self.train.micro_batch_size
        sp = self.parallel.sequence_parallel and self.parallel.schedule == "oases"
        return 4 if sp and mbs % 4 == 0 else 2 if mbs % 2 == 0 else 1

    @property
    def padded_vocab_size(self) -> int:
        return self.padded_vocab(self.parallel.tp)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of vocab_pad_to x tp (a stage's tp)."""
        m = self.model.vocab_pad_to * tp
        return math.ceil(self.model.vocab_size / m) * m

    def validate(self, world_size: int = 1) -> "Config":
        """Resolve the named model size and check every section; returns self."""
        self.model.resolve()
        for sec in (self.model, self.parallel, self.train, self.data, self.eval,
                    self.checkpoint, self.wandb, self.metrics):
            sec.validate()
        self.profile.validate(self.train.steps)
        choice("resume", self.resume, ("none", "auto"))
        if self.eval.only and not self.data.val_path:
            raise ConfigError("eval.only=true needs data.val_path (the token file to evaluate)")
        if not self.out_dir:
            raise ConfigError("out_dir must not be empty")
        tp, pp, m = self.parallel.tp, self.parallel.pp, self.model
        if world_size % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide the world size {world_size}")
        if world_size % (pp * tp):
            raise ConfigError(f"parallel.pp={pp} x parallel.tp={tp} does not divide the world "
                              f"size {world_size}")
        if world_size % (pp * tp * self.parallel.cp):
            raise ConfigError(f"parallel.pp={pp} x parallel.cp={self.parallel.cp} x "
                              f"parallel.tp={tp} does not divide the world size {world_size}")
        if self.parallel.cp > 1:
            cp_needs(self)
        if pp > m.n_layer:
            raise ConfigError(f"parallel.pp={pp} is more stages than model.n_layer={m.n_layer} "
                              f"layers")
        n_mb = self.train.grad_accum
        if pp > 1 and self.parallel.pp_schedule != "gpipe" and n_mb < pp:
            raise ConfigError(f"train.grad_accum={n_mb} micro-batches is fewer than "
                              f"parallel.pp={pp} stages: {self.parallel.pp_schedule} needs "
                              f"at least pp micro-batches per step")
        if self.parallel.pp_virtual > 1:
            interleaving_needs(pp, self.parallel.pp_virtual, m.n_layer, n_mb)
        if self.parallel.overlap_fb:
            overlap_fb_needs(pp, n_mb, self.parallel.pp_schedule)
        if pp > 1 and self.parallel.plan == "auto" and self.parallel.plan_search == "tp-only":
            raise ConfigError("parallel.plan=auto with plan_search=tp-only chooses per-block TP "
                              "degrees for pp=1 only; with parallel.pp > 1 search the layout "
                              "(plan_search=uniap) or give a plan file")
        cp = self.parallel.cp  # a cp rank holds seq_len / cp tokens of each row
        if self.parallel.sequence_parallel and (m.seq_len // cp) % tp:
            what = f"model.seq_len={m.seq_len}" + (f" / parallel.cp={cp}" if cp > 1 else "")
            raise ConfigError(f"parallel.sequence_parallel splits the sequence over the TP "
                              f"ranks: {what} does not divide by parallel.tp={tp}")
        heads = heads_problem(m.n_head, m.n_kv_heads, tp)  # kv heads: split or replicated
        if heads:
            raise ConfigError(f"parallel.tp={tp} {heads}")
        if m.ffn_hidden % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide model.ffn_hidden={m.ffn_hidden}")
        if self.parallel.schedule == "oases":
            mbs, n = self.train.micro_batch_size, self.sub_batches
            if mbs < n or mbs % n:
                raise ConfigError(f"train.micro_batch_size={mbs} cannot be split into "
                                  f"parallel.sub_batches={n} equal sub-batches")
        self._world_size = world_size
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def freeze(self) -> "Config":
        """Make this config (every section) read-only; returns self."""
        self._set_frozen(True)
        return self

    @property
    def frozen(self) -> bool:
        return bool(self.__dict__.get("_frozen"))

    def with_changes(self, changes: dict[str, Any]) -> "Config":
        """A copy with the dotted keys of ``changes`` set to their values, validated for
        the same world size and frozen if this one is; this config is left as it is."""
        new = copy.deepcopy(self)
        new._set_frozen(False)
        for key, value in changes.items():
            *path, name = key.split(".")
            sec = new
            for part in path:
                sec = getattr(sec, part)
            if name not in {f.name for f in dataclasses.fields(sec)}:
                raise ConfigError(f"unknown config key {key!r}")
            setattr(sec, name, value)
        new.validate(self._world_size)
        return new.freeze() if self.frozen else new


PP_SCHEDULES = ("1f1b", "eager-1f1b", "gpipe", "zb-h1", "eager-zb-h1", "interleaved-1f1b")

# ---------------------------------------------------------------------------
# Loading: YAML -> dataclasses, strict (oases.config.typed_yaml); dotted overrides.

def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Build a Config from a YAML file (optional) and ``a.b=value`` overrides."""
    data: dict = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {path} "
                              f"{'is not a file' if p.exists() else 'does not exist'}")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except OSError as e:
            raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte "
                              f"0x{e.object[e.start]:02x} at offset {e.start})") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {path} is not valid YAML{where}") from None
    cfg = build_dataclass(Config, data)
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value")
        k, v = ov.split("=", 1)
        set_dotted(cfg, k.strip(), v.strip())
    return cfg


def save_config(cfg: Config, path: Path) -> None:
    data = cfg.to_dict()
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(path)


__all__ = ["SHAPE_KEYS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
           "ModelConfig", "ParallelConfig", "TrainConfig", "WandbConfig", "load_config",
           "resolve_precision", "save_config", "BF16_PRECISIONS"]
