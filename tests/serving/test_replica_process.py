"""A replica's process group and what it leaves: nothing of either is left when ``start`` runs again."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from serving import replica
from serving.replica import ReplicaProcess, ReplicaSpec, group_alive, stat_fields

# A leader that ignores SIGTERM and a child (same process group) that ignores it too,
# as a wedged API server and its engine core would.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


SPEC = ReplicaSpec(target_dir="t", head_dir="h", num_speculative_tokens=3, port=1)


def running(pid: int) -> bool:
    fields = stat_fields(Path(f"/proc/{pid}/stat"))
    return bool(fields) and fields[0] not in ("Z", "X")


def test_stop_kills_the_whole_group_and_start_may_follow(tmp_path):
    rp = ReplicaProcess(SPEC, tmp_path / "log")
    rp.proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    child = int(rp.proc.stdout.readline())
    assert group_alive(rp.proc.pid) and rp.alive()
    t = time.monotonic()
    rp.stop(grace=0.5)
    assert time.monotonic() - t < 30
    assert not rp.alive() and not group_alive(rp.proc.pid)
    assert not running(child)


def test_stop_raises_when_the_leader_outlives_the_wait(tmp_path, monkeypatch):
    rp = ReplicaProcess(SPEC, tmp_path / "log")
    # A process outside its own group: killpg on its pid finds nothing, so it survives SIGKILL.
    rp.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with pytest.raises(RuntimeError, match="did not exit"):
            rp.stop(grace=0.2, kill_wait=0.5)
    finally:
        rp.proc.kill()
        rp.proc.wait()


# Stands in for `vllm serve`: makes a socket where vLLM's engine would (VLLM_RPC_BASE_PATH), says
# where, and waits to be killed without removing it.
ENGINE = """
import os, socket, sys, time, uuid
path = os.path.join(os.environ["VLLM_RPC_BASE_PATH"], str(uuid.uuid4()))
socket.socket(socket.AF_UNIX).bind(path)
print(path, flush=True)
time.sleep(600)
"""


def _sockets_made_in(d: Path, wait: float = 10.0) -> list[str]:
    """The names in ``d`` once the stand-in engine has bound its socket there."""
    deadline = time.monotonic() + wait
    while not os.listdir(d) and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.listdir(d)


def test_each_start_keeps_the_engine_sockets_in_a_private_directory_that_stop_removes(tmp_path, monkeypatch):
    monkeypatch.delenv(replica.RPC_DIR_ENV, raising=False)
    monkeypatch.setattr(replica, "build_command", lambda spec: [sys.executable, "-c", ENGINE])
    rp = ReplicaProcess(SPEC, tmp_path / "log")
    dirs = []
    for _ in range(2):  # a start after a stop gets a fresh one
        rp.start()
        (sock,) = _sockets_made_in(Path(rp.rpc_dir))
        assert stat.S_ISSOCK(os.stat(os.path.join(rp.rpc_dir, sock)).st_mode)
        assert stat.S_IMODE(os.stat(rp.rpc_dir).st_mode) == 0o700
        dirs.append(rp.rpc_dir)
        rp.stop(grace=0.5)
        assert rp.rpc_dir is None and not os.path.exists(dirs[-1])
    assert dirs[0] != dirs[1]


def test_a_rpc_directory_the_user_set_is_kept(tmp_path, monkeypatch):
    mine = tmp_path / "rpc"
    mine.mkdir()
    monkeypatch.setenv(replica.RPC_DIR_ENV, str(mine))
    monkeypatch.setattr(replica, "build_command", lambda spec: [sys.executable, "-c", ENGINE])
    rp = ReplicaProcess(SPEC, tmp_path / "log")
    rp.start()
    try:
        assert rp.rpc_dir is None and len(_sockets_made_in(mine)) == 1
    finally:
        rp.stop(grace=0.5)
    assert mine.is_dir()
