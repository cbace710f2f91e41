"""Stopping a replica's process group: nothing of it is left when ``start`` runs again."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

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
