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

from oases.errors import ConfigError
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
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity or None, name=cfg.name or Path(out_dir).name,
            group=cfg.group or group or None, tags=list(cfg.tags) or None,
            notes=cfg.notes or None, mode=cfg.mode, dir=out_dir, config=run_config, id=run_id,
            resume="allow" if run_id else None)
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
