"""What oases sets in the environment for NCCL and CUDA, as pure functions (the CUDA tests
that exercise it on a GPU are in tests/test_groups.py and tests/test_gpu_check.py).

NCCL: waits never block the host (no ``TORCH_NCCL_BLOCKING_WAIT``); the watchdog aborts
a hung collective's communicators (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) so that the
run's next collective raises; the flight recorder keeps the last collectives and dumps
them under ``out_dir``. A user's choice stands, but torchrun's default ``1`` for its
workers is no choice. CUDA: kernels in issue order (``CUDA_DEVICE_MAX_CONNECTIONS=1``)
unless the user chose.
"""

from __future__ import annotations

import os

from oases.parallel import nccl_env as N

WORKER = {"TORCHELASTIC_RUN_ID": "none", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def test_defaults_abort_the_communicators_and_keep_a_flight_recorder(tmp_path):
    got = N.nccl_error_env({}, str(tmp_path / "trace"))
    assert got == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_FR_BUFFER_SIZE": "2000",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace" / "rank_")}
    assert "TORCH_NCCL_BLOCKING_WAIT" not in got  # a wait never sleeps on the host
    assert "TORCH_FR_DUMP_TEMP_FILE" not in N.nccl_error_env({})  # no out_dir: torch's file


def test_the_users_choices_stand():
    for chosen in ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, {"NCCL_BLOCKING_WAIT": "1"},
                   {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {"NCCL_ASYNC_ERROR_HANDLING": "1"}):
        got = N.nccl_error_env(chosen)
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in got, chosen
        assert got["TORCH_FR_BUFFER_SIZE"] == "2000"  # the recorder does not change handling
    mine = {"TORCH_FR_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/y"}
    assert N.nccl_error_env(mine, "/trace") == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_torchruns_default_is_not_a_choice():
    # the agent's own environment lacks the variable: torchrun set it for its worker
    assert N.torchrun_default(WORKER, {"PATH": "/bin"})
    assert N.nccl_error_env(WORKER, agent_env={})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    # the user exported it before torchrun, or the agent's environment cannot be read
    for agent in ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, None):
        assert not N.torchrun_default(WORKER, agent)
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in N.nccl_error_env(WORKER, agent_env=agent)
    # not a torchrun worker, or another value: a choice
    assert not N.torchrun_default({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, {})
    assert not N.torchrun_default({**WORKER, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, {})


def test_agent_environ_reads_a_process_environment():
    env = N.agent_environ(os.getpid())
    assert env is not None and env.get("PATH") == os.environ.get("PATH")
    assert N.agent_environ(2**22 + 12345) is None  # no such process


def test_prepare_backend_sets_nothing_for_gloo_and_makes_the_trace_dir(tmp_path):
    env: dict = {}
    assert N.prepare_backend("gloo", str(tmp_path / "t"), env) == {} and env == {}
    new = N.prepare_backend("nccl", str(tmp_path / "t"), env)
    assert env == new and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert (tmp_path / "t").is_dir()
    assert N.prepare_backend("nccl", str(tmp_path / "t"), env) == {}  # again: all set


def test_start_up_words():
    assert N.error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) == \
        "NCCL timeout aborts the communicators: exit 4 (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)"
    assert "block the host" in N.error_handling({"TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert "SIGABRT" in N.error_handling({})  # torch's own default, 3


def test_kernel_order_is_set_unless_chosen():
    env: dict = {}
    assert N.kernel_order(env) == "kernels in issue order (CUDA_DEVICE_MAX_CONNECTIONS=1)"
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    mine = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert "8: yours" in N.kernel_order(mine) and mine == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}

