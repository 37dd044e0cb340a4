"""``python -m oases.dashboard --entity E --project P``: a W&B workspace for a project's
oases runs, built with the wandb-workspaces library (``pip install 'oases[observe]'``).

    python -m oases.dashboard --entity my-team --project oases            # save it
    python -m oases.dashboard --entity my-team --project oases --dry-run  # print the panels

Sections (the panels name exactly the grouped keys a run logs,
:mod:`oases.runtime.metric_keys`; docs/observability.md describes them):

    Throughput            tokens/s, tokens/s per device, TFLOP/s per device, MFU, step time
    Hidden communication  hidden fraction of the TP communication; its exposed and whole
                          seconds per step; ZeRO-3 gather wait
    Loss                  train and eval loss, eval perplexity, lr, gradient norm, skipped steps
    Memory                peak allocated and reserved memory, maxima over ranks
    Pipeline              the bubble

Each chart's x-axis is its group's step key (``perf/step``, ...). Runs are grouped by
their layout (``run.layout`` in the logged config, e.g. ``dp2-tp4-oases-fine``).
Saving needs the network and a W&B API key (``wandb login`` or ``WANDB_API_KEY``);
``--dry-run`` builds the workspace offline and prints its panels.
"""

from __future__ import annotations

import argparse
import sys

from oases.errors import EXIT_USER_ERROR
from oases.runtime.metric_keys import step_key

# section -> [(panel title, [keys])]; every chart's x-axis is its keys' group step key
SECTIONS = {
    "Throughput": [
        ("tokens/s", ["perf/tokens_per_s"]),
        ("tokens/s per device", ["perf/tokens_per_s_per_device"]),
        ("TFLOP/s per device", ["perf/tflops_per_device"]),
        ("MFU", ["perf/mfu"]),
        ("step time (s)", ["perf/step_time_s"]),
    ],
    "Hidden communication": [
        ("hidden fraction of TP communication", ["perf/tp_comm_hidden_frac"]),
        ("TP communication per step (s): exposed and whole",
         ["perf/tp_comm_exposed_s", "perf/tp_comm_s"]),
        ("ZeRO-3 gather wait per step (s)", ["perf/zero_gather_wait_s"]),
        ("ring attention's transfer wait per step (s)", ["perf/cp_ring_wait_s"]),
    ],
    "Loss": [
        ("train loss", ["train/loss"]),
        ("eval loss", ["eval/loss"]),
        ("eval perplexity", ["eval/ppl"]),
        ("learning rate", ["train/lr"]),
        ("gradient norm", ["train/grad_norm"]),
        ("skipped steps", ["train/skipped_steps"]),
    ],
    "Memory": [
        ("peak allocated (GiB, max over ranks)", ["mem/peak_allocated_gib_max"]),
        ("reserved (GiB, max over ranks)", ["mem/reserved_gib_max"]),
    ],
    "Pipeline": [
        ("pipeline bubble", ["perf/pipeline_bubble"]),
    ],
}
GROUP_BY = "run.layout"  # the logged config's layout name (oases.runtime.observe)


def x_axis(keys: list[str]) -> str:
    return step_key(keys[0])


def build(entity: str, project: str, name: str = "oases"):
    """The workspace (not saved)."""
    import wandb_workspaces.reports.v2 as wr  # deferred: optional (the observe extra)
    import wandb_workspaces.workspaces as ws  # deferred: optional (the observe extra)

    sections = [ws.Section(name=title, is_open=True, panels=[
        wr.LinePlot(title=t, x=x_axis(keys), y=list(keys)) for t, keys in panels])
        for title, panels in SECTIONS.items()]
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections,
                        runset_settings=ws.RunsetSettings(groupby=[ws.Config(GROUP_BY)]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m oases.dashboard",
                                 description="Create a W&B workspace for oases runs.")
    ap.add_argument("--entity", required=True, help="W&B team or user")
    ap.add_argument("--project", default="oases", help="W&B project (default oases)")
    ap.add_argument("--name", default="oases", help="workspace (view) name")
    ap.add_argument("--dry-run", action="store_true",
                    help="build it offline and print its panels; save nothing")
    args = ap.parse_args(argv)
    try:
        workspace = build(args.entity, args.project, args.name)
    except ImportError:
        print("error: python -m oases.dashboard needs the wandb-workspaces package: "
              "pip install 'oases[observe]'", file=sys.stderr)
        return EXIT_USER_ERROR
    if args.dry_run:
        for section in workspace.sections:
            print(section.name)
            for p in section.panels:
                print(f"  {p.title}: {', '.join(p.y)} against {p.x}")
        return 0
    workspace.save()  # needs the network and an API key
    print(f"saved workspace {workspace.url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
