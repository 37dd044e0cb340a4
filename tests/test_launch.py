"""``python -m oases.launch slurm`` and ``examples/slurm/train.sbatch``, without Slurm.

The launcher is fed a fake Slurm environment and its torchrun command line is
checked; its signal handling runs against a stand-in for torchrun; the batch script
runs with ``srun`` and ``scontrol`` replaced by small shell scripts that record how
they were called.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from oases.cli import launch as L
from oases.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_GPUS_ON_NODE": "8"}


def launch(env: dict, *args: str) -> subprocess.CompletedProcess:
    # what an earlier test in this process set (a trainer's kernel order, NCCL's error
    # handling) would read as the user's choice: only ``env`` chooses here
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCH_NCCL_", "NCCL_"))
            and k not in ("MASTER_ADDR", "MASTER_PORT", "CUDA_DEVICE_MAX_CONNECTIONS")}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "oases.launch", "slurm", *args], cwd=ROOT,
                          env=full, capture_output=True, text=True, timeout=60)


def test_slurm_command_line():
    r = launch(SLURM, "--config", "configs/gpt-tiny.yaml", "--dry-run", "--",
               "train.steps=50", "parallel.tp=2")
    assert r.returncode == 0, r.stderr
    words = shlex.split(r.stdout)
    # kernels start in issue order, and a hung collective ends the run with exit 4
    # (torchrun would give its workers TORCH_NCCL_ASYNC_ERROR_HANDLING=1: SIGABRT)
    assert words[:4] == ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
                         "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90", "CUDA_DEVICE_MAX_CONNECTIONS=1",
                         "TORCH_NCCL_ASYNC_ERROR_HANDLING=2"]
    cmd = words[4:]
    assert cmd[0] == sys.executable and cmd[1:3] == ["-m", "torch.distributed.run"]
    script = cmd.index("train.py")
    assert cmd[3:script] == ["--nnodes=4", "--nproc-per-node=8", "--rdzv-backend=c10d",
                             "--rdzv-endpoint=gpu07:29500", "--rdzv-id=4242",
                             "--rdzv-conf=is_host=0", "--max-restarts=2"]
    assert cmd[script + 1:] == ["--config", "configs/gpt-tiny.yaml", "train.steps=50",
                                "parallel.tp=2", "resume=auto"]


def test_the_users_cuda_and_nccl_choices_stand():
    chosen = {**SLURM, "CUDA_DEVICE_MAX_CONNECTIONS": "8", "TORCH_NCCL_BLOCKING_WAIT": "1"}
    r = launch(chosen, "--config", "configs/gpt-tiny.yaml", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert not [w for w in shlex.split(r.stdout)
                if w.startswith(("CUDA_DEVICE_MAX_CONNECTIONS=", "TORCH_NCCL_"))]


def test_slurm_settings_sources():
    """MASTER_ADDR/MASTER_PORT and the flags win over the nodelist, the defaults and
    SLURM_GPUS_ON_NODE; node 0 hosts the rendezvous."""
    env = {**SLURM, "SLURM_NODEID": "0", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31000"}
    s = L.slurm_settings(env)
    assert (s.master_addr, s.port, s.nproc_per_node, s.nnodes, s.job_id) == \
        ("10.0.0.5", 31000, 8, 4, "4242")
    cmd = L.torchrun_command(s, "c.yaml", [], max_restarts=5, python="py")
    assert "--rdzv-conf=is_host=1" in cmd and "--max-restarts=5" in cmd
    s = L.slurm_settings({**SLURM, "SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:4"})
    assert s.nproc_per_node == 4
    assert L.slurm_settings(SLURM, nproc_per_node=2, port=1234).nproc_per_node == 2
    assert L.slurm_settings(SLURM, port=1234).port == 1234


@pytest.mark.parametrize("nodelist,host", [
    ("gpu[07-10]", "gpu07"), ("gpu[07-10,12],cpu3", "gpu07"), ("node-a,node-b", "node-a"),
    ("rack[1-2]-n[3-4]", "rack1-n3"), ("solo", "solo"), ("n[5,3]", "n5")])
def test_first_host(nodelist, host):
    assert L.first_host(nodelist) == host


def test_resume_is_always_auto():
    assert L.train_args("c.yaml", ["resume=auto", "a=1"]) == ["--config", "c.yaml", "a=1",
                                                              "resume=auto"]
    with pytest.raises(UserError, match="resume=none"):
        L.train_args("c.yaml", ["resume=none"])


@pytest.mark.parametrize("env,args,msg", [
    ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, [], "SLURM_JOB_ID"),
    ({**SLURM, "SLURM_GPUS_ON_NODE": ""}, [], "--nproc-per-node"),
    (SLURM, ["resume=none"], "resume=auto"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"}, [], "SLURM_JOB_NODELIST"),
])
def test_bad_input_is_one_line_exit_2(env, args, msg):
    r = launch(env, "--config", "configs/gpt-tiny.yaml", "--dry-run", "--", *args)
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr


# ---------------------------------------------------------------------------
# signals: a stand-in for torchrun that stops on SIGTERM with a given status

FAKE_TORCHRUN = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    def stop(signum, frame):
        Path(sys.argv[1]).write_text(signal.Signals(signum).name)
        sys.exit(int(sys.argv[2]))
    signal.signal(signal.SIGTERM, stop)
    Path(sys.argv[1] + ".ready").touch()
    time.sleep(60)
""")


def _launcher(tmp_path: Path, status_on_term: int) -> tuple[subprocess.Popen, Path]:
    fake = tmp_path / "torchrun.py"
    fake.write_text(FAKE_TORCHRUN)
    got = tmp_path / "got"
    code = (f"import os, sys; from oases.cli.launch import run; "
            f"sys.exit(run([sys.executable, {str(fake)!r}, {str(got)!r}, "
            f"'{status_on_term}'], os.environ))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 30
    while not Path(str(got) + ".ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "fake torchrun did not start"
        time.sleep(0.02)
    return proc, got


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_stop_signal_reaches_torchrun_and_exits_5(tmp_path, sig):
    """Slurm's notice: torchrun gets SIGTERM, reports failure (1), the launcher says 5."""
    proc, got = _launcher(tmp_path, status_on_term=1)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == L.EXIT_PREEMPTED, proc.stderr.read()
    assert got.read_text() == "SIGTERM"
    assert sig.name in proc.stderr.read()


def test_job_that_finished_despite_the_signal_exits_0(tmp_path):
    proc, got = _launcher(tmp_path, status_on_term=0)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 0


def test_failure_without_a_signal_keeps_its_status():
    assert L.run([sys.executable, "-c", "import sys; sys.exit(3)"], os.environ) == 3
    assert L.run([sys.executable, "-c", "pass"], os.environ) == 0


# ---------------------------------------------------------------------------
# the batch script, with srun and scontrol stubbed

STUB_SRUN = """#!/bin/bash
{ echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT"; printf '%s\\n' "$@"; } > "$STUB_DIR/srun.args"
exit "${SRUN_RC:-0}"
"""
STUB_SCONTROL = """#!/bin/bash
if [ "$1 $2" = "show hostnames" ]; then printf 'node-a\\nnode-b\\n'; exit 0; fi
echo "$@" >> "$STUB_DIR/scontrol.calls"
"""


def _sbatch(tmp_path: Path, srun_rc: int) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", STUB_DIR=str(tmp_path), SRUN_RC=str(srun_rc),
               SLURM_JOB_ID="777", SLURM_JOB_NODELIST="node-[a-b]", SLURM_SUBMIT_DIR=str(ROOT),
               NPROC_PER_NODE="2")
    return subprocess.run(["bash", str(ROOT / "examples/slurm/train.sbatch"),
                           "configs/gpt-tiny.yaml", "train.steps=5"],
                          env=env, capture_output=True, text=True, timeout=60)


def test_sbatch_launches_one_agent_per_node(tmp_path):
    r = _sbatch(tmp_path, 0)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = (tmp_path / "srun.args").read_text().splitlines()
    assert lines[0] == "MASTER_ADDR=node-a MASTER_PORT=29500"
    args = lines[1:]
    launcher = args.index("oases.launch")
    assert "--ntasks-per-node=1" in args[:launcher]
    assert args[launcher - 1] == "-m" and args[launcher + 1] == "slurm"
    assert args[launcher + 2:] == ["--config", "configs/gpt-tiny.yaml", "--nproc-per-node", "2",
                                   "--", "train.steps=5"]
    assert not (tmp_path / "scontrol.calls").exists()  # finished: no requeue


def test_sbatch_requeues_on_status_5_only(tmp_path):
    r = _sbatch(tmp_path, 5)
    assert r.returncode == 5
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "777"]
    (tmp_path / "scontrol.calls").unlink()
    r = _sbatch(tmp_path, 1)  # a crash is not requeued (it would crash again)
    assert r.returncode == 1 and not (tmp_path / "scontrol.calls").exists()
