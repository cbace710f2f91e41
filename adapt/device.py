"""Where the drafter and the target run: the device and the matmul precision."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_RANK", "0"))
            return torch.device("cuda", local)
        return torch.device("cpu")
    return torch.device(name)


def target_device_map(device: torch.device, world: int = 1, gpus: int | None = None) -> str | None:
    """How to place the target for featurization: "auto" (its layers spread over every visible GPU, so a
    target larger than one GPU still runs) for a single-process CUDA run that sees several GPUs; None (the
    whole target on ``device``) otherwise. Under ``torchrun`` each rank owns one GPU, so nothing spreads."""
    if device.type != "cuda" or world > 1:
        return None
    if gpus is None:
        gpus = torch.cuda.device_count()
    return "auto" if gpus > 1 else None


def use_bf16_autocast(dtype: str, device: torch.device) -> bool:
    """bf16 autocast when asked for, or on ``auto`` where matmuls run natively in bf16.

    That is CUDA, and CPUs with AMX tiles or AVX512-BF16 (e.g. AMD Zen 4), where
    oneDNN's bf16 kernels run a drafter step faster than fp32 does. Master
    weights and the loss stay fp32.
    """
    if dtype != "auto":
        return dtype == "bf16"
    if device.type == "cuda":
        return True
    return device.type == "cpu" and cpu_has_native_bf16()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16); elsewhere oneDNN
    emulates bf16 matmuls, several times slower than fp32 ones."""
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe is not None and bool(probe()) for probe in probes)


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), or the machine type where it has none: what a
    timing measured on this CPU is keyed by."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "cpu"


def usable_cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def cores_busy_elsewhere(window_s: float = 0.2) -> float | None:
    """How many cores other processes kept busy over ``window_s`` (Linux ``/proc/stat``, less this
    process's own CPU time); None where ``/proc/stat`` is missing."""

    def busy_seconds() -> float:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user

    try:
        b0, t0 = busy_seconds(), time.perf_counter()
        own0 = sum(os.times()[:2])
        time.sleep(window_s)
        b1, t1 = busy_seconds(), time.perf_counter()
        own1 = sum(os.times()[:2])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, ((b1 - b0) - (own1 - own0)) / (t1 - t0))


@contextmanager
def decode_threads(device: torch.device) -> Iterator[int]:
    """Inside, token-by-token decoding on a CPU uses one thread per core no other process is using.

    Each decoded token runs hundreds of small parallel regions, and each region waits at its
    barrier for all its threads: where other processes hold the cores, every region waits for a
    descheduled thread's next time slice, and decoding with all threads can run many times slower
    than with one (``benchmarks/decode_threads.py``). Bulk work (a training step, featurization)
    has few, large regions and keeps every thread. Yields the thread count used; elsewhere than
    on a CPU, nothing changes.
    """
    n = torch.get_num_threads()
    busy = cores_busy_elsewhere() if device.type == "cpu" else None
    if busy is None:
        yield n
        return
    k = max(1, min(n, int(usable_cores() - busy + 0.5)))
    torch.set_num_threads(k)
    try:
        yield k
    finally:
        torch.set_num_threads(n)
