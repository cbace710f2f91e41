"""Process memory: what the machine has to spare, what this process holds, and glibc's heap.

Nothing heavy is imported here (the ingest benchmark uses :func:`available_bytes`).
"""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from typing import Any, Iterator


def available_bytes(default: int) -> int:
    """``MemAvailable`` from ``/proc/meminfo`` (Linux), else ``default``."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return default


def process_rss_bytes() -> int | None:
    """Resident memory of this process (Linux ``/proc``), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _glibc() -> Any | None:
    """glibc, for its malloc tuning calls; None on other C libraries."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def trim_heap() -> bool:
    """Return free heap pages to the OS (glibc ``malloc_trim``); False where unavailable."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


# glibc mallopt parameters and their defaults (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM_THRESHOLD, _DEFAULT_MMAP_MAX = 128 * 1024, 65536


@contextmanager
def heap_kept_between_steps() -> Iterator[bool]:
    """Inside, glibc serves large blocks from its heap and keeps freed ones for reuse.

    By default a CPU step's large tensors (above glibc's 32 MiB mmap ceiling)
    are mmapped, unmapped when freed and faulted in again page by page the next
    step, so every step pays the page faults of its largest tensors again; kept
    in the heap they are reused, for a little more peak memory. The defaults
    come back on exit and the heap's free pages go back to the OS. Yields
    whether the tuning took (False off glibc).
    """
    libc = _glibc()
    if libc is None:
        yield False  # not glibc: nothing to tune
        return
    ok = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    try:
        yield ok
    finally:
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM_THRESHOLD)
        trim_heap()
