"""What the machine has to spare, without importing anything heavy (the ingest benchmark uses it too)."""
from __future__ import annotations


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
