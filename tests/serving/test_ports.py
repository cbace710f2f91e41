"""A pool's ports are all free before its servers start, and a replica that cannot start says why."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from serving.pool import BENCH_PORT_OFFSET, free_pool_ports
from serving.replica import ReplicaProcess, ReplicaSpec, ephemeral_ports, free_port_block, ports_bindable


class Proposals:
    """An rng whose ``randrange`` proposes the given ports in turn (then falls back to the middle)."""

    def __init__(self, *ports: int) -> None:
        self.ports = list(ports)

    def randrange(self, lo: int, hi: int) -> int:
        return self.ports.pop(0) if self.ports else (lo + hi) // 2


def test_every_port_of_the_pool_is_free_and_below_the_ephemeral_range():
    lo, _ = ephemeral_ports()
    for replicas in (1, 2):
        base, router = free_pool_ports(replicas)
        block = [base + i for i in range(replicas)] + [base + BENCH_PORT_OFFSET, base + BENCH_PORT_OFFSET + 1]
        assert router not in block
        assert all(p < lo for p in block + [router])
        assert ports_bindable(block + [router])


def test_a_block_with_one_port_taken_is_passed_over():
    first, _ = free_port_block([0, BENCH_PORT_OFFSET, BENCH_PORT_OFFSET + 1, 100, 200, 250, 251])
    taken = socket.socket()
    taken.bind(("127.0.0.1", first + BENCH_PORT_OFFSET))  # the bench replica's port of the first proposal
    try:
        other, router = first + 200, first + 100
        # Proposals: base, router (refused: base+50 is taken), then base, router again.
        base, (r,) = free_port_block([0, BENCH_PORT_OFFSET, BENCH_PORT_OFFSET + 1], n_free=1,
                                     rng=Proposals(first, router, other, router))
        assert base == other and r == router
    finally:
        taken.close()


def test_a_block_that_never_comes_free_is_an_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match="no free block"):
            free_port_block([0], rng=Proposals(*[port] * 5), tries=5, host="127.0.0.1")
    finally:
        s.close()


def test_a_replica_that_exits_shows_the_error_it_logged_before_its_shutdown_noise(tmp_path):
    log = tmp_path / "replica.log"
    script = ("import sys\n"
              "print('INFO starting the engine')\n"
              "print(\"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8150): "
              "address already in use\")\n"
              "for i in range(60): print(f' - leaked type {i}')\n"
              "sys.exit(1)\n")
    rp = ReplicaProcess(ReplicaSpec(target_dir="t", head_dir=None, num_speculative_tokens=3, port=1), log)
    with open(log, "w") as fh:
        rp.proc = subprocess.Popen([sys.executable, "-c", script], stdout=fh, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        rp.proc.wait(30)
    with pytest.raises(RuntimeError) as err:
        rp.wait_healthy(timeout=10)
    text = str(err.value)
    assert "exited with 1" in text and "address already in use" in text and "leaked type 59" in text
    assert "leaked type 5\n" not in text  # the shutdown noise is cut to its tail
