"""Thread count for token-by-token decoding on a CPU (``adapt.device.decode_threads``)."""

from __future__ import annotations

import multiprocessing as mp
import time

import torch

from adapt.device import cores_busy_elsewhere, decode_threads, usable_cores


def _spin(stop) -> None:
    while not stop.is_set():
        sum(range(10_000))


def test_other_processes_spinning_every_core_leave_decoding_one_thread_and_the_count_is_restored():
    cores = usable_cores()
    n = torch.get_num_threads()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(cores)]
    for p in spinners:
        p.start()
    try:
        time.sleep(1.0)
        busy = cores_busy_elsewhere(0.5)
        with decode_threads(torch.device("cpu")) as k:
            inside = torch.get_num_threads()
    finally:
        stop.set()
        for p in spinners:
            p.join()
    assert busy is not None and busy >= 0.6 * cores, busy
    assert k == inside == 1
    assert torch.get_num_threads() == n


def test_on_a_gpu_device_nothing_changes():
    n = torch.get_num_threads()
    with decode_threads(torch.device("cuda")) as k:
        assert k == n == torch.get_num_threads()
