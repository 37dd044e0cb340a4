"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes what it owns.

The directory layout, the order in which a save is made durable and published, pruning
and which checkpoint a resume takes are :mod:`oases.runtime.ckpt_files`'s. A save
writes everything into ``step_N.tmp``; rank 0 publishes it (meta.json, rename,
``latest``, pruning) once every rank's files are there.

What each rank writes and reads (keys of full tensors, chunks at global offsets, ZeRO
owned ranges, the tied embedding written once, vocabulary padding) is the sharded format
of :mod:`oases.runtime.ckpt_format`. Nothing is gathered: a save's extra memory is one
chunk at a time (DCP copies a view before writing it), a load's is one saved chunk.

**A save that fails** (disk full, an I/O error, on any rank, in any of its steps) ends
every rank with the same :class:`~oases.errors.CheckpointWriteError` (status 6): after
each step of a save that can fail on some ranks only, the ranks agree on the outcome
(one small all-gather), so none is left waiting in a collective for a rank that gave
up. ``latest`` keeps naming the last complete checkpoint.

**Async save** (:class:`AsyncSaver`, ``checkpoint.async_save=true``): DCP's
``async_save`` copies this rank's chunks to host memory (pinned on CUDA) and writes them
from a background thread over a process group of its own (with the run's
``parallel.timeout_s``), so the next steps run while the files are written. Rank 0
publishes once its write has completed, which DCP returns only after every rank's data
and the ``.metadata`` are on disk. At most one save is in flight; the next save, the end
of the run and a preemption wait for it and raise a failure on every rank alike; any
other way out of the loop (an error, Ctrl-C) still waits for it and publishes it.

The data position (a global sample counter) continues at any DP degree; the per-rank
RNG states are restored only when the world layout is the same.
"""

from __future__ import annotations

import datetime
import importlib
import sys
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from oases.config.schema import SHAPE_KEYS
from oases.dp.ownership import ZeroOwnership
from oases.errors import CheckpointError, CheckpointWriteError, first_line
from oases.parallel.groups import ParallelContext
from oases.progress import io_progress, rank
from oases.runtime import ckpt_files as files
from oases.runtime.ckpt_files import (ckpt_root, find_checkpoint, is_complete, latest_name,
                                      read_meta)
from oases.runtime.ckpt_read import full_model_state, full_shape, iter_model_tensors, model_keys

__all__ = ["first_line", "save", "load",
           "AsyncSaver", "full_model_state", "full_shape", "iter_model_tensors", "model_keys",
           "ckpt_root", "is_complete", "read_meta", "latest_name", "latest_checkpoint",
           "find_checkpoint"]

# DCP, and the format built on it, are imported at a process's first save or load:
# ``torch.distributed.checkpoint`` pulls in DTensor and sympy (~0.8 s), which a process
# that never saves or loads (an error exit, a checkpoint-free run, a CLI) need not pay.
LAZY = {"CheckpointException": "torch.distributed.checkpoint.api",
        "cause": "oases.runtime.ckpt_format", "read_metadata": "oases.runtime.ckpt_format"}


def __getattr__(name: str):
    """The names above, imported when first asked for (PEP 562)."""
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(LAZY[name]), name)


def is_dcp_failure(e: BaseException) -> bool:
    """``e`` is DCP's ``CheckpointException``, told without importing DCP: a process that
    has not imported it cannot hold one (error exits stay ~1 s cheaper)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(e, api.CheckpointException)


def dcp_format():
    """``oases.runtime.ckpt_format`` (DCP with it), imported at the first use."""
    from oases.runtime import ckpt_format  # deferred: imports DCP (DTensor, sympy)
    return ckpt_format


# ---------------------------------------------------------------------------
# Optimizer state, paths


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create zero Adam state, so a checkpoint can be loaded into it before any step."""
    for group in opt.param_groups:
        fused = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32,
                                        device=p.device if fused else "cpu"),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def latest_checkpoint(out_dir: str) -> Optional[Path]:
    """The checkpoint a resume takes (:func:`~oases.runtime.ckpt_files.find_checkpoint`),
    or None if the run has none; says on rank 0 why it is not ``latest``'s target."""
    path, note = find_checkpoint(out_dir)
    if note is not None and rank() == 0:
        print(f"resume: {note}", flush=True)
    return path


# ---------------------------------------------------------------------------
# Save


@torch.no_grad()
def all_finite(model: nn.Module, ctx: ParallelContext,
               shards: Optional[ZeroOwnership] = None) -> bool:
    """Whether every parameter on every rank is finite (collective); sharded parameters
    are checked in the owned ranges, which hold them."""
    ok = torch.ones((), device=ctx.device)
    flats = shards.flats if shards is not None else []
    sharded = {id(p) for fl in flats for p in fl.params}
    masters = shards.master_of() if shards is not None else {}  # bf16 compute weights
    held = [fl.shard for fl in flats] + [masters.get(id(p), p) for p in model.parameters()
                                         if id(p) not in sharded]
    for t in held:
        if not torch.isfinite(t).all():
            ok.zero_()
            break
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


class _Target(NamedTuple):
    """Where a started save goes and what rank 0 publishes."""
    out_dir: str
    root: Path
    final: Path
    tmp: Path
    meta: dict
    keep: int


def _agree(failure: Optional[str]) -> Optional[str]:
    """The first failure any rank met (``failure``: this rank's, or None); collective
    over the world when there is one."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return failure
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, failure)
    return next((f for f in every if f), None)


def _failed(t: _Target, reason: str, is_main: bool) -> CheckpointWriteError:
    """The error every rank raises for a save that failed (all agreed on ``reason``);
    rank 0 removes the save's directory, as nothing writes to it any more."""
    if is_main:
        files.remove_tree(t.tmp)
    last = latest_name(t.out_dir)
    what = ("was published but its save did not finish" if last == str(t.final)
            else "could not be written")
    return CheckpointWriteError(
        f"checkpoint {t.final.name} {what} ({reason}); latest names "
        f"{last or 'no checkpoint'}; free space or fix the filesystem, then resume=auto "
        f"continues from it")


def _local(what: str, ctx: ParallelContext, fn) -> Optional[str]:
    """Run ``fn()``; this rank's failure as one line, or None."""
    try:
        fn()
    except Exception as e:  # a file operation: disk full, an I/O error, a lost mount
        return f"rank {ctx.rank}: {what}: {type(e).__name__}: {first_line(e)}"
    return None


def _check(t: _Target, ctx: ParallelContext, failure: Optional[str]) -> None:
    reason = _agree(failure)
    if reason is not None:
        raise _failed(t, reason, ctx.is_main)


def _dcp_failed(e: BaseException) -> tuple[Optional[BaseException], str]:
    """(what failed inside a DCP failure, one line naming the rank it failed on)."""
    from torch.distributed.checkpoint.api import CheckpointException  # deferred: DCP
    for r, v in (getattr(e, "failures", None) or {}).items():
        exc = v[0] if isinstance(v, tuple) else v
        if not isinstance(exc, CheckpointException):
            return exc, f"rank {r}: {type(exc).__name__}: {first_line(exc)}"
    return None, f"{type(e).__name__}: {first_line(e)}"


def _dcp_failure(e: BaseException) -> str:
    """One line for DCP's failure of a write (the same exception on every rank); a peer
    that died or hung is re-raised, as the collective failure it is."""
    exc, line = _dcp_failed(e)
    if not isinstance(exc, OSError):
        raise e
    return line


def _begin(out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
           ctx: ParallelContext, meta: dict, rng_state: dict, keep: int,
           shards: Optional[ZeroOwnership]) -> tuple[_Target, list]:
    """The start of a save of ``step``, synchronous or not (collective): rank 0 clears a
    crash's leftovers and makes ``tmp``; each rank writes its RNG state there. Returns
    (the target, this rank's pieces)."""
    root = ckpt_root(out_dir)
    final = root / files.step_name(step)
    tmp = final.with_name(final.name + ".tmp")
    t = _Target(out_dir, root, final, tmp, {**meta, "layout": _layout(model, ctx)}, keep)
    _check(t, ctx, _local(f"creating {tmp}", ctx, lambda: files.start_tmp(root, tmp))
           if ctx.is_main else None)
    rng_file = tmp / "rng" / f"rank{ctx.rank}.pt"
    _check(t, ctx, _local(f"writing {rng_file}", ctx,
                          lambda: files.save_tensors(rng_state, rng_file)))
    return t, dcp_format().state_pieces(model, opt, ctx, shards)


def _layout(model: nn.Module, ctx: ParallelContext) -> dict:
    layout = dcp_format().param_layout(model)
    if ctx.pp > 1:  # each stage knows only its own parameters
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, layout)
        layout = {k: v for part in parts for k, v in part.items()}
    return layout


def _publish(t: _Target, ctx: ParallelContext) -> Optional[str]:
    """Rank 0 publishes ``t`` (:func:`oases.runtime.ckpt_files.publish`); its failure as
    one line, or None."""
    return _local(f"publishing {t.final.name}", ctx,
                  lambda: files.publish(t.root, t.tmp, t.final, t.meta, t.keep))


def save(out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
         ctx: ParallelContext, meta: dict, rng_state: dict, keep: int = 2,
         shards: Optional[ZeroOwnership] = None) -> Path:
    """Write this rank's owned state (``shards``: the run's ZeRO ownership) as step
    ``step``'s checkpoint and publish it (collective). A failure on any rank raises
    CheckpointWriteError on every rank."""
    import torch.distributed.checkpoint as dcp  # deferred: DCP, at the first save
    from torch.distributed.checkpoint.api import CheckpointException  # deferred: DCP

    t, pieces = _begin(out_dir, step, model, opt, ctx, meta, rng_state, keep, shards)
    failure = None
    try:
        with io_progress(f"saving {t.final.name}", kind="write"):  # bytes written by this rank
            with warnings.catch_warnings():  # "torch.distributed is ... uninitialized"
                warnings.simplefilter("ignore", UserWarning)
                dcp.save({p.name: p.local for p in pieces}, checkpoint_id=str(t.tmp),
                         planner=dcp_format().ChunkSavePlanner(pieces))
    except CheckpointException as e:  # the same on every rank: DCP gathers the failures
        failure = _dcp_failure(e)
    if failure is not None:
        raise _failed(t, failure, ctx.is_main)
    _check(t, ctx, _publish(t, ctx) if ctx.is_main else None)
    return t.final


class _Pending(NamedTuple):
    fut: Future
    stager: object


class AsyncSaver:
    """Saves with DCP's ``async_save``: the chunks are staged to host memory, then written
    in the background over a process group of the saver's own (the training's groups
    keep their collective order; ``timeout_s``: its collectives' timeout and the longest
    wait for a write); see the module docstring."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.group = None
        self.ctx: Optional[ParallelContext] = None
        self.target: Optional[_Target] = None  # the last save started
        self.pending: Optional[_Pending] = None
        self.failure: Optional[str] = None  # this rank's, not yet agreed on

    def save(self, out_dir: str, step: int, model: nn.Module, opt: torch.optim.Optimizer,
             ctx: ParallelContext, meta: dict, rng_state: dict, keep: int = 2,
             shards: Optional[ZeroOwnership] = None) -> Path:
        """Start the save of step ``step`` (collective); returns the path it will have.
        The save in flight is finished first, and its failure raised on every rank."""
        import torch.distributed.checkpoint as dcp  # deferred: DCP, at the first save
        from torch.distributed.checkpoint.staging import (  # deferred: async saves only
            DefaultStager, StagingOptions)

        self.wait()
        self.ctx = ctx
        distributed = dist.is_initialized()
        if self.group is None and distributed:  # every rank saves at the same steps
            self.group = dist.new_group(backend="gloo",
                                        timeout=datetime.timedelta(seconds=self.timeout_s))
        t, pieces = _begin(out_dir, step, model, opt, ctx, meta, rng_state, keep, shards)
        self.target = t
        stager = DefaultStager(StagingOptions(ctx.device.type == "cuda", False, False, False))
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized"
            warnings.simplefilter("ignore", UserWarning)
            fut = dcp.async_save({p.name: p.local for p in pieces}, checkpoint_id=str(t.tmp),
                                 planner=dcp_format().ChunkSavePlanner(pieces),
                                 process_group=self.group,
                                 async_stager=stager, no_dist=not distributed)
        self.pending = _Pending(fut, stager)
        return t.final

    def poll(self) -> None:
        """Publish the save in flight if its write has completed (no collective); a
        failure is kept for the next :meth:`wait`."""
        if self.pending is not None and self.pending.fut.done():
            self._finish()

    def _finish(self) -> None:
        """Wait for the write in flight (at most ``timeout_s``) and, on rank 0, publish
        it; a failure is kept in ``failure`` (no collective)."""
        from torch.distributed.checkpoint.api import CheckpointException  # deferred: DCP

        (fut, stager), self.pending = self.pending, None
        me = self.ctx.rank
        try:
            fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            self.failure = (f"rank {me}: the background write did not complete within "
                            f"parallel.timeout_s={self.timeout_s:g}")
            return  # the write thread still reads the staged copy: the stager stays open
        except CheckpointException as e:  # DCP's, alike on every rank
            self.failure = _dcp_failed(e)[1]
        except Exception as e:
            self.failure = f"rank {me}: {type(e).__name__}: {first_line(e)}"
        stager.close()
        if self.failure is None and self.ctx.is_main:
            self.failure = _publish(self.target, self.ctx)

    def wait(self) -> None:
        """Finish the save in flight (publish it), then raise the failure of any rank's
        last background save on every rank (collective; nothing to do before the first
        save)."""
        if self.pending is not None:
            self._finish()
        failure, self.failure = self.failure, None
        if self.ctx is None:
            return
        reason = _agree(failure)
        if reason is not None:
            raise _failed(self.target, reason, self.ctx.is_main)

    def close(self) -> None:
        """On the way out of a run that is failing anyway: wait for the save in flight
        and publish it where this rank can (no collective); its failure is dropped, and
        ``latest`` names what was published."""
        if self.pending is not None:
            self._finish()
        self.failure = None


# ---------------------------------------------------------------------------
# Load


def load(path: Path, model: nn.Module, opt: Optional[torch.optim.Optimizer],
         ctx: ParallelContext, model_shape: dict, layout: Optional[dict] = None,
         shards: Optional[ZeroOwnership] = None, alone: bool = False, rng: bool = True
         ) -> tuple[dict, Optional[dict]]:
    """Load model + optimizer state (``opt`` None: the model alone) in place into what
    this rank owns (``shards``: the run's ZeRO ownership), resharding from whatever level
    and (pp, dp, tp) layout the checkpoint was written with; returns (meta, this rank's
    RNG state or None if ``rng`` is False or the checkpoint was written by a different
    layout: the entries of ``layout``, default world size and tp, must all match its
    meta). ``model_shape``: the model's architecture fields, each of which must equal the
    checkpoint's. Collective, unless ``alone`` (one process reading by itself)."""
    meta = read_meta(path)
    check_model(path, meta, model_shape)
    fmt = dcp_format()
    reader = fmt.reader_for(path)  # reads .metadata once, for the check and the load
    saved = fmt.read_metadata(path, reader)
    if opt is not None:
        ensure_optimizer_state(opt)
    if shards is not None:
        shards.release()  # nothing gathered, no all-gather in flight into the parameters
    pieces = fmt.state_pieces(model, opt, ctx, shards, load=True)
    with torch.no_grad():
        fmt.load_windows(path, fmt.windows_for(path, pieces, saved), reader, alone=alone)
    if shards is not None:
        shards.after_load()  # bf16 compute weights: the parameters follow the masters
    layout = layout or {"world_size": ctx.world_size, "tp": ctx.tp}
    # pp, pp_virtual and cp were not always recorded: 1 then
    same_layout = all(meta.get(k, 1 if k in ("pp", "pp_virtual", "cp") else None) == v
                      for k, v in layout.items())
    rng_file = path / "rng" / f"rank{ctx.rank}.pt"
    if not (rng and same_layout and rng_file.is_file()):
        return meta, None
    try:  # tensors, ints and None only: nothing in the file may run code
        return meta, torch.load(rng_file, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {rng_file.name} "
                              f"({fmt.dcp_error(e)})") from None


def check_model(path: Path, meta: dict, model: dict) -> None:
    """Refuse a model whose architecture differs from the checkpoint's, naming each
    field: the shape fields always, the others (RoPE, norm eps, window, ...) where the
    checkpoint records its model section (``model``)."""
    shape = meta.get("model_shape") or {}
    section = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    saved = {**shape, **section}
    keys = [*SHAPE_KEYS, *(k for k in model if k not in SHAPE_KEYS and k in section)]
    diff = [f"{k}: {saved.get(k)} -> {model.get(k)}" for k in keys if saved.get(k) != model.get(k)]
    if diff:
        raise CheckpointError(f"checkpoint {path} was saved for another model shape or "
                              f"architecture ({'; '.join(diff)}); resume it with its own "
                              f"model section, or start a new out_dir")


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory; or a run's out_dir, or its checkpoints/ directory: the
    checkpoint a resume would take there (``latest``'s target, else the newest complete
    one, which rank 0 says on stderr)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist")
    if (p / ".metadata").exists() or (p / "meta.json").exists():
        if not is_complete(p):
            raise CheckpointError(f"checkpoint {p} is partial (no meta.json or .metadata)")
        return p
    for out_dir in (p, p.parent):
        root = ckpt_root(str(out_dir))
        if root in (p / "checkpoints", p) and root.is_dir():
            found, note = find_checkpoint(out_dir)
            if found is None:
                break
            if note is not None and rank() == 0:
                print(f"note: {note}", file=sys.stderr, flush=True)
            return found
    raise CheckpointError(f"{p} is neither a checkpoint nor a run directory with one")
