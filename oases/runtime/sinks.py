"""Where rank 0's metric records go besides ``metrics.jsonl``: W&B and TensorBoard.

Both take the grouped keys (:mod:`oases.runtime.metric_keys`). On W&B each group has
its own x-axis (``train/step``, ``perf/step``, ``mem/step``, ``eval/step``, declared
with ``define_metric``) and W&B's own ``_step`` is left to count calls, so a record
is never dropped for a step number W&B has passed.

Resume (``resume=auto``): the run id and the last step W&B holds of each group live
in ``<out_dir>/wandb_run.json``. A resumed run continues the same W&B run id and
skips the records W&B already has: the steps replayed after a rollback to the
checkpoint are the same steps (the replay is exact; their time figures are those of
the first attempt), and each step reaches W&B once. Offline, each attempt writes its
own ``wandb/offline-run-*`` directory under that id; ``wandb sync`` of all of them
uploads one run with each step once. TensorBoard drops its events from the resumed
step on (``purge_step``) and writes the replayed steps again.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from oases.errors import ConfigError, first_line
from oases.parallel.ranks import world_timeout
from oases.runtime.metric_keys import STEP_KEYS, SUMMARY, grouped, step_key, values


def _kind(rec: dict) -> str:
    return "eval" if "val_loss" in rec else "train"


class WandbSink:
    def __init__(self, cfg, out_dir: str, run_config: Optional[dict], resume: bool,
                 group: str = "") -> None:
        import wandb  # deferred: seconds to import; rank 0 with W&B on only

        os.environ.setdefault("WANDB_SILENT", "true")
        self.state_path = Path(out_dir) / "wandb_run.json"
        state = {}
        if resume and self.state_path.exists():
            state = json.loads(self.state_path.read_text())
        self.logged = {k: int(state.get(k, 0)) for k in ("train", "eval")}
        run_id = state.get("id")
        try:
            self.run = wandb.init(
                project=cfg.project, entity=cfg.entity or None,
                name=cfg.name or Path(out_dir).name, group=cfg.group or group or None,
                tags=list(cfg.tags) or None, notes=cfg.notes or None, mode=cfg.mode,
                dir=out_dir, config=run_config, id=run_id, resume="allow" if run_id else None,
                # the other ranks wait for the outcome (open_wandb); WANDB_SILENT (above)
                # also keeps W&B from prompting for a login at a terminal
                settings={"init_timeout": _init_timeout()})
        except Exception as e:  # noqa: BLE001 - no API key, no network, a bad entity, ...
            fix = ("log in (`wandb login`, or WANDB_API_KEY), or set wandb.mode=offline and "
                   "`wandb sync` the run later" if cfg.mode == "online" else
                   "set wandb.mode=disabled to run without it")
            raise ConfigError(f"wandb.mode={cfg.mode}: W&B did not start "
                              f"({type(e).__name__}: {first_line(e)}); {fix}") from e
        define_metrics(self.run)
        self.id = self.run.id
        self._save()

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"id": self.id, **self.logged}))
        tmp.replace(self.state_path)

    def log(self, rec: dict) -> None:
        kind = _kind(rec)
        if rec["step"] <= self.logged[kind]:
            return  # W&B holds this step from an earlier attempt (see the module doc)
        self.run.log(grouped(rec))
        self.logged[kind] = rec["step"]
        self._save()

    def close(self) -> None:
        self.run.finish()


def _init_timeout() -> float:
    """How long ``wandb.init`` may take: ``WANDB_INIT_TIMEOUT`` (W&B's default 90 s), at
    most half the world's collective timeout, so that rank 0 gives up (and says why)
    before the ranks waiting for it time out."""
    try:
        wanted = float(os.environ.get("WANDB_INIT_TIMEOUT", "90"))
    except ValueError:
        wanted = 90.0
    timeout = world_timeout() if dist.is_initialized() else None
    return wanted if timeout is None else min(wanted, timeout.total_seconds() / 2)


def open_wandb(cfg, out_dir: str, run_config: Optional[dict], resume: bool, group: str,
               is_main: bool, device: torch.device) -> Optional[WandbSink]:
    """Rank 0's :class:`WandbSink` (None on the other ranks), called by every rank: a W&B
    that does not start (no API key, no network) is a ConfigError on every rank alike, so
    rank 0 prints the one line and the others stop with it, rather than rank 0 failing
    alone and the others reporting a peer that died. One all-reduce over the world."""
    sink, error = None, None
    if is_main:
        try:
            sink = WandbSink(cfg, out_dir, run_config, resume, group)
        except ConfigError as e:
            error = e
    failed = error is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(failed)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    if failed:
        raise error or ConfigError(f"wandb.mode={cfg.mode}: W&B did not start on rank 0")
    return sink


def define_metrics(run) -> None:
    """Each group's x-axis and the summaries of :data:`SUMMARY`."""
    for group, key in STEP_KEYS.items():
        run.define_metric(key, hidden=True)
        run.define_metric(f"{group}/*", step_metric=key)
    for key, how in SUMMARY.items():
        run.define_metric(key, step_metric=step_key(key), summary=how)


def require_tensorboard() -> None:
    if importlib.util.find_spec("tensorboard") is None:  # optional: metrics.tensorboard only
        raise ConfigError("metrics.tensorboard=true needs the tensorboard package: "
                          "pip install 'oases[observe]'")


class TensorBoardSink:
    """The grouped scalars under ``<out_dir>/tensorboard`` (``torch.utils.tensorboard``)."""

    def __init__(self, out_dir: str, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # deferred: optional package

        self.writer = SummaryWriter(str(Path(out_dir) / "tensorboard"),
                                    purge_step=start_step + 1 if start_step else None)

    def log(self, rec: dict) -> None:
        for key, value in values(rec).items():
            self.writer.add_scalar(key, value, global_step=rec["step"])

    def close(self) -> None:
        self.writer.close()
