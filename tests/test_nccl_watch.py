"""The NCCL watch (oases/parallel/nccl_watch.py): a group whose backend reports an error
ends the process with one line and exit status 4, after this rank's flight-recorder dump
settled; nothing happens while every group is well or after the run stopped it. The
CUDA test hangs a collective on one GPU (held behind a sleeping kernel) and checks the
process ends within the timeout and a few seconds, where the watchdog alone took 28 s
(the module's docstring)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from oases.parallel import nccl_watch as W
from tests.support.runs import REPO, subprocess_env


class _Backend:
    def __init__(self, fail_after: int) -> None:
        self.calls, self.fail_after = 0, fail_after

    def get_error(self):
        self.calls += 1
        return SimpleNamespace(name="TIMEOUT" if self.calls > self.fail_after else "SUCCESS")


def _watch(backends, dump=None, **kw):
    exits = []
    w = W.NcclWatch(lambda: backends, lambda g, e, d: f"group {g}: {e} dumped={d}", dump,
                    poll_s=0.01, dump_wait_s=0.5, exit=exits.append, **kw)
    return w, exits


def _until(cond, limit=5.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < limit:
        time.sleep(0.01)
    return cond()


def test_a_failed_group_ends_the_process_with_one_line(tmp_path, capsys):
    dump = tmp_path / "rank_0"
    dump.write_text("flight recorder")
    well, bad = _Backend(10**9), _Backend(3)
    w, exits = _watch([(0, well), (2, bad)], dump)
    assert w.start()
    assert _until(lambda: exits)
    w.stop()
    assert exits == [4] and bad.calls == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: group 2: TIMEOUT dumped=True"]


def test_no_dump_is_said_and_a_stopped_watch_does_nothing(tmp_path, capsys):
    w, exits = _watch([(1, _Backend(0))], tmp_path / "never")
    assert w.start() and _until(lambda: exits)
    w.stop()
    assert capsys.readouterr().err.strip() == "error: group 1: TIMEOUT dumped=False"
    w, exits = _watch([(0, _Backend(10**9))])
    assert w.start()
    time.sleep(0.1)
    w.stop()
    assert exits == [] and w.check() is None


def test_nothing_to_watch_on_gloo(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0,
                            world_size=1)
    try:
        assert W.nccl_backends() == []
        assert not W.watch_run(0, 5.0, {}).start()
    finally:
        dist.destroy_process_group()


def test_the_dump_path_is_torchs_file_for_the_rank():
    w = W.watch_run(3, 5.0, {"TORCH_FR_DUMP_TEMP_FILE": "/x/nccl_trace/rank_"})
    assert str(w.dump) == "/x/nccl_trace/rank_3"


_HANG = textwrap.dedent("""
    import time

    import torch
    import torch.distributed as dist

    from oases.parallel.groups import join_world
    from oases.parallel.nccl_watch import watch_run
    join_world("cuda", "auto", timeout_s=2)
    watch_run(0, 2.0)
    x = torch.ones(1, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e10))  # ~20 s of cycles at 2 GHz
    t0 = time.monotonic()
    dist.all_reduce(x, async_op=True)
    print("queued", flush=True)
    while time.monotonic() - t0 < 60:
        time.sleep(0.2)
        dist.all_reduce(x)  # collectives pile up behind the hung one, as a step's do
    print("no exit", flush=True)
""")


@pytest.mark.cuda
def test_a_hung_nccl_collective_exits_4_within_seconds(tmp_path):
    env = {k: v for k, v in subprocess_env().items() if "NCCL" not in k}
    env["TORCH_FR_DUMP_TEMP_FILE"] = str(tmp_path / "rank_")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _HANG], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 4, proc.stdout + proc.stderr[-3000:]
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(ours) == 1 and re.search(r"parallel.timeout_s=2: a peer rank died or hangs "
                                        r"\(NCCL group 0: \w+", ours[0]), proc.stderr[-3000:]
    # timeout 2 s + a poll + the dump (at most DUMP_WAIT_S) + start-up; the watchdog
    # alone needs the sleeping kernel's 20 s and 2 s per queued collective more
    assert took < 2 + W.DUMP_WAIT_S + 10, (took, proc.stderr[-2000:])
