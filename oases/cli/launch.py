"""Start one node's share of a multi-node job from a scheduler's environment.

    python -m oases.launch slurm --config configs/gpt.yaml [--nproc-per-node N] [--port P]
        [--max-restarts K] [--grace-s S] [--dry-run] [-- key.sub=value ...]

Run once per node (``srun --ntasks-per-node=1``; ``examples/slurm/train.sbatch``).
From the Slurm environment it builds and runs this node's torchrun agent::

    torchrun --nnodes=$SLURM_NNODES --nproc-per-node=$SLURM_GPUS_ON_NODE \\
        --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$PORT --rdzv-id=$SLURM_JOB_ID \\
        --rdzv-conf=is_host=<1 on node 0> --max-restarts=K \\
        train.py --config ... [overrides] resume=auto

* The rendezvous is at the job's first node (``$MASTER_ADDR``, else the first host of
  ``$SLURM_JOB_NODELIST``), keyed by the job id, so every node's agent meets the
  others there, also after a requeue. Node ranks come from the rendezvous.
* ``--max-restarts``: a crashed rank restarts the worker group on every node, which
  resumes from the latest checkpoint. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set:
  a restarted group across nodes must not reuse the agents' store
  (docs/checkpoints.md, fault tolerance).
* ``resume=auto`` is always passed (a requeued job must continue its run); an override
  asking for another ``resume`` is refused.
* Preemption: SIGUSR1 or SIGTERM (Slurm's ``--signal=USR1@120``, or its SIGTERM at the
  time limit) is passed to the agent as SIGTERM, which torchrun hands to the workers;
  oases finishes the step, saves a checkpoint and stops. torchrun reports that as a
  failure, so this launcher exits with oases' status 5 itself when a stop signal came
  and the job did not finish: the batch script requeues on 5. torchrun waits
  ``--grace-s`` (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``; torch >= 2.9 reads it, older
  versions wait 30 s) for the workers before it kills them.

Bad arguments or a missing Slurm variable: one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NoReturn, Optional

from oases.errors import EXIT_USER_ERROR, UserError
from oases.parallel.nccl_env import ABORT_ONLY, ERROR_VARS, MAX_CONNECTIONS

EXIT_PREEMPTED = 5      # oases' status for "stopped on a signal after a checkpoint"
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


@dataclass
class NodeSettings:
    """What one node's agent needs to know about the job."""
    nnodes: int
    node_id: int
    nproc_per_node: int
    master_addr: str
    port: int
    job_id: str


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist (``gpu[07-10,12],cpu3`` -> ``gpu07``;
    ``rack[1-2]-n[3-4]`` -> ``rack1-n3``), as ``scontrol show hostnames`` lists it."""
    depth, end = 0, len(nodelist)
    for i, c in enumerate(nodelist):
        depth += (c == "[") - (c == "]")
        if c == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    host = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)
    if not host or "[" in host or "]" in host:
        raise UserError(f"cannot read the first host of SLURM_JOB_NODELIST={nodelist!r}")
    return host


def _int(env: Mapping[str, str], name: str, value: Optional[str] = None) -> int:
    raw = env.get(name) if value is None else value
    m = re.match(r"^\s*(?:[A-Za-z0-9_]+:)*(\d+)", raw or "")  # "4", "gpu:4", "h100:4(x2)"
    if not m:
        raise UserError(f"{name}={raw!r} is not a count")
    return int(m.group(1))


def slurm_settings(env: Mapping[str, str], nproc_per_node: Optional[int] = None,
                   port: Optional[int] = None) -> NodeSettings:
    """This node's settings from a Slurm job's environment (``env``: os.environ)."""
    missing = [v for v in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID") if not env.get(v)]
    if missing:
        raise UserError(f"not inside a Slurm job step: {', '.join(missing)} unset "
                        f"(run it with srun from a batch script)")
    if nproc_per_node is None:
        for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
            if env.get(name):
                nproc_per_node = _int(env, name)
                break
        else:
            raise UserError("no GPU count in the Slurm environment (SLURM_GPUS_ON_NODE): "
                            "pass --nproc-per-node")
    if nproc_per_node < 1:
        raise UserError(f"{nproc_per_node} processes per node: need at least 1")
    master = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", ""))
    if port is None:
        port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else 29500
    return NodeSettings(nnodes=_int(env, "SLURM_NNODES"), node_id=_int(env, "SLURM_NODEID"),
                        nproc_per_node=nproc_per_node, master_addr=master, port=port,
                        job_id=env["SLURM_JOB_ID"])


def train_args(config: str, overrides: list[str]) -> list[str]:
    """``train.py``'s arguments: the config, the overrides, ``resume=auto``."""
    clash = [o for o in overrides if o.split("=", 1)[0].strip() == "resume"]
    if any(o.split("=", 1)[-1].strip() != "auto" for o in clash):
        raise UserError(f"{clash[-1]}: a launched job always resumes (resume=auto), so that "
                        f"a restart or a requeue continues the run")
    return ["--config", config, *[o for o in overrides if o not in clash], "resume=auto"]


def torchrun_command(s: NodeSettings, config: str, overrides: list[str], max_restarts: int = 2,
                     script: str = "train.py", python: str = sys.executable) -> list[str]:
    return [python, "-m", "torch.distributed.run",
            f"--nnodes={s.nnodes}", f"--nproc-per-node={s.nproc_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={s.master_addr}:{s.port}",
            f"--rdzv-id={s.job_id}", f"--rdzv-conf=is_host={int(s.node_id == 0)}",
            f"--max-restarts={max_restarts}", script, *train_args(config, overrides)]


def command_env(grace_s: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Variables the agent runs with (on top of the node's environment). Its workers
    create their CUDA context in order of their kernels' issue
    (``CUDA_DEVICE_MAX_CONNECTIONS=1``, :mod:`oases.parallel.nccl_env`) and have a hung
    collective's communicators aborted rather than the process (torchrun would give
    them ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``), unless the node's environment chose."""
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(grace_s)}
    if MAX_CONNECTIONS not in environ:
        env[MAX_CONNECTIONS] = "1"
    if not any(k in environ for k in ERROR_VARS):
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = ABORT_ONLY
    return env


def run(cmd: list[str], env: Mapping[str, str]) -> int:
    """Run the agent; the first stop signal goes to it as SIGTERM. Exit status: the
    agent's, except 5 when a stop signal came and the agent did not finish (0)."""
    stopped: list[int] = []
    proc: Optional[subprocess.Popen] = None

    def forward(signum, frame) -> None:
        if not stopped:  # a second signal would cut torchrun's own shutdown short
            stopped.append(signum)
            print(f"oases.launch: {signal.Signals(signum).name}: stopping the job (SIGTERM "
                  f"to torchrun)", file=sys.stderr, flush=True)
            if proc is not None:
                proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        proc = subprocess.Popen(cmd, env=dict(env))
        if stopped:  # the notice came while it started
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stopped and rc != 0:
        return EXIT_PREEMPTED
    return rc if rc >= 0 else 128 - rc  # killed by a signal: the shell's convention


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m oases.launch", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scheduler", choices=("slurm",))
    p.add_argument("--config", required=True, help="the run's config (YAML)")
    p.add_argument("--nproc-per-node", type=int,
                   help="processes (GPUs) per node; default: SLURM_GPUS_ON_NODE")
    p.add_argument("--port", type=int, help="rendezvous port on the first node "
                                            "(default: MASTER_PORT, else 29500)")
    p.add_argument("--max-restarts", type=int, default=2,
                   help="worker-group restarts after a crashed rank (default 2)")
    p.add_argument("--grace-s", type=int, default=90,
                   help="seconds torchrun gives the workers to checkpoint after a stop "
                        "signal (default 90: within Slurm's USR1@120 notice)")
    p.add_argument("--script", default="train.py", help="training script (default train.py)")
    p.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides for train.py")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:  # everything after -- is train.py's
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1:]
    args = _parser().parse_args(argv)
    try:
        if args.max_restarts < 0 or args.grace_s < 0:
            raise UserError("--max-restarts and --grace-s must be >= 0")
        s = slurm_settings(os.environ, args.nproc_per_node, args.port)
        cmd = torchrun_command(s, args.config, args.overrides + rest, args.max_restarts,
                               args.script)
        if not args.dry_run and not Path(args.script).is_file():
            raise UserError(f"{args.script} not found: run from the repository root or "
                            f"pass --script")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    extra = command_env(args.grace_s, os.environ)
    line = shlex.join([f"{k}={v}" for k, v in extra.items()] + cmd)
    if args.dry_run:
        print(line, flush=True)
        return 0
    print(f"oases.launch: SLURM_NODEID {s.node_id} of {s.nnodes} nodes: {line}", file=sys.stderr,
          flush=True)
    return run(cmd, {**os.environ, **extra})


if __name__ == "__main__":
    sys.exit(main())
