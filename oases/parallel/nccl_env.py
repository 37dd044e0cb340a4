"""What NCCL and CUDA read from the environment when they start, and what oases sets
there where the user did not choose.

**How a hung or dead peer ends a run.** ProcessGroupNCCL reads its error handling
when each process group is constructed (torch 2.13, ``ProcessGroupNCCL.cpp``):

* ``TORCH_NCCL_BLOCKING_WAIT=1``: ``work.wait()`` makes the current stream wait, then
  polls the work's end event on the host, sleeping 1 ms between polls, until it
  completes or times out (then it raises in the caller). No watchdog thread is started.
  Every wait then blocks the host: where the GPU is the bottleneck, the host sleeps in
  a wait instead of issuing the next segment, and the GPU idles once it has drained
  what was queued. A collective nobody waits on (``async_op=False``) has no timeout.
* Without it, ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says what the watchdog thread does
  when a collective times out or NCCL reports an error. First it asks every rank to
  dump its flight recorder and waits for the dumps (4 x
  ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``); then 0: nothing more; 1: abort the
  communicators and take the process down (the watchdog rethrows: SIGABRT); 2: abort
  the communicators only; 3 (torch's default): take the process down without aborting.
  torchrun gives its workers 1 unless its own environment has the variable.

oases sets **2**: waits never block the host, the watchdog times every collective
(synchronous ones included), and a hung collective gets its group's communicators
aborted; the next collective the run issues on an aborted communicator raises ("NCCL
communicator was aborted"), and the run ends as on any collective failure, with one
line and exit status 4. The watchdog is slow to get there (it sleeps 4 x the dump wait
per queued collective first), so the trainer's :mod:`~oases.parallel.nccl_watch` ends
the run ``parallel.timeout_s`` plus the dump's few seconds after the hang.
The flight recorder keeps the last :data:`FLIGHT_RECORDER` collectives of each rank
(``TORCH_FR_BUFFER_SIZE``) and dumps them on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``)
to ``<out_dir>/nccl_trace/rank_<r>`` (``TORCH_FR_DUMP_TEMP_FILE``), as torchtitan does.

A user who set any of these variables chose; oases then sets none of them, with one
exception: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` in a torchrun worker whose agent's own
environment lacks the variable is torchrun's default, not a choice (the agent's
environment is read from ``/proc/<agent pid>/environ``).

**Kernel order.** ``CUDA_DEVICE_MAX_CONNECTIONS`` is how many hardware work queues the
CUDA driver feeds a device's streams through (8 by default). With one, kernels start in
the order they were issued, whatever their stream: the all-reduce a sub-batch launches
starts before the other sub-batch's GEMM that was issued after it, instead of queueing
behind it for free SMs (Megatron-LM sets 1 for the same overlap). It is read when the
process creates its CUDA context, so it must be in the environment before then:
:func:`kernel_order` sets it at the start of every oases entry point, unless the user
set it, and says which order is in force.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Mapping, MutableMapping, Optional

# ProcessGroupNCCL's error-handling variables (and their older names)
ERROR_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")
ABORT_ONLY = "2"            # TORCH_NCCL_ASYNC_ERROR_HANDLING: abort, keep the process
FLIGHT_RECORDER = 2000      # collectives each rank remembers for the dump
MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def torchrun_default(environ: Mapping[str, str], agent_env: Optional[Mapping[str, str]]) -> bool:
    """Whether ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` in ``environ`` is torchrun's default
    for its workers: a torchrun worker's, and the agent's environment (``agent_env``;
    None when it cannot be read) does not have the variable."""
    return (environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == "1"
            and "TORCHELASTIC_RUN_ID" in environ
            and agent_env is not None and "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in agent_env)


def agent_environ(pid: Optional[int] = None) -> Optional[dict[str, str]]:
    """The environment the parent process (a torchrun agent) started with, or None."""
    try:
        raw = Path(f"/proc/{pid or os.getppid()}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def nccl_error_env(environ: Mapping[str, str], trace_dir: Optional[str] = None,
                   agent_env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The variables to set before an NCCL process group is created (module docstring):
    the watchdog aborts a hung collective's communicators and the run's next collective
    raises, unless ``environ`` chose how NCCL handles errors (torchrun's default is no
    choice); the flight recorder keeps the last collectives and dumps them to
    ``trace_dir`` (if given) on a timeout, where ``environ`` did not say otherwise."""
    out = {}
    chosen = [k for k in ERROR_VARS if k in environ]
    if chosen == ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] and torchrun_default(environ, agent_env):
        chosen = []
    if not chosen:
        out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = ABORT_ONLY
    if "TORCH_FR_BUFFER_SIZE" not in environ and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ:
        out["TORCH_FR_BUFFER_SIZE"] = str(FLIGHT_RECORDER)
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if trace_dir and "TORCH_FR_DUMP_TEMP_FILE" not in environ \
            and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in environ:
        out["TORCH_FR_DUMP_TEMP_FILE"] = str(Path(trace_dir) / "rank_")
    return out


def prepare_backend(backend: str, trace_dir: Optional[str] = None,
                    environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Before ``init_process_group``: NCCL reads its error handling from the environment
    when each process group is constructed (:func:`nccl_error_env`). Returns what it set
    (nothing on gloo)."""
    if backend != "nccl":
        return {}
    agent = agent_environ() if "TORCHELASTIC_RUN_ID" in environ else None
    new = nccl_error_env(environ, trace_dir, agent)
    if "TORCH_FR_DUMP_TEMP_FILE" in new:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    environ.update(new)
    return new


def error_handling(environ: Mapping[str, str] = os.environ) -> str:
    """The start-up line's words for how NCCL errors end the run."""
    if environ.get("TORCH_NCCL_BLOCKING_WAIT", environ.get("NCCL_BLOCKING_WAIT")) == "1":
        return "NCCL waits block the host (TORCH_NCCL_BLOCKING_WAIT=1: yours)"
    mode = environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                       environ.get("NCCL_ASYNC_ERROR_HANDLING", "3"))
    what = {"0": "hangs until killed", "1": "aborts the process (SIGABRT)",
            "2": "aborts the communicators: exit 4", "3": "aborts the process (SIGABRT)"}
    return f"NCCL timeout {what.get(mode, 'handled by mode ' + mode)} " \
           f"(TORCH_NCCL_ASYNC_ERROR_HANDLING={mode})"


def kernel_order(environ: MutableMapping[str, str] = os.environ) -> str:
    """Set ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless the user chose, before this process
    creates its CUDA context; returns the start-up line's words for the order in force.
    Call it first thing in an entry point (nothing CUDA has run yet)."""
    if MAX_CONNECTIONS in environ:
        n = environ[MAX_CONNECTIONS]
        return (f"kernels in issue order ({MAX_CONNECTIONS}=1)" if n == "1" else
                f"kernels may overtake issue order ({MAX_CONNECTIONS}={n}: yours)")
    torch = sys.modules.get("torch")  # not imported (the launcher): no CUDA context yet
    if torch is not None and torch.cuda.is_initialized():  # too late: it kept the default
        return (f"kernels may overtake issue order ({MAX_CONNECTIONS} unset when CUDA "
                f"started)")
    environ[MAX_CONNECTIONS] = "1"
    return f"kernels in issue order ({MAX_CONNECTIONS}=1)"
