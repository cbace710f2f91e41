"""How ``torchrun`` ranks are started, and whether this process is one: no torch imported here, so a
launcher (the cycle's train step, ``adapt train --gpus``) builds its command without loading torch."""

from __future__ import annotations

import os
import sys


def torchrun_prefix(gpus: int, nnodes: int = 1, rdzv_endpoint: str = "", python: str = sys.executable) -> list[str]:
    """The ``torchrun`` (``torch.distributed.run``) command that starts ``gpus`` ranks on this node, one per
    GPU (gloo ranks on a CPU), up to the module to run (append ``-m module args``). With ``nnodes`` > 1, a
    c10d rendezvous at ``rdzv_endpoint`` (host:port of one of the nodes), where every node runs the same
    command; else a local rendezvous on a free port. ``adapt train --gpus`` and the cycle's train step
    (``[training] gpus``) both start their ranks with it."""
    run = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(gpus)]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError("several nodes need --rdzv-endpoint HOST:PORT, the same on every node")
        return run + ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                      "--rdzv-id", "adapt-train"]
    return run + ["--standalone"]


def launched_rank() -> int | None:
    """This process's rank when ``torchrun`` started it (before any process group is joined), else None."""
    return int(os.environ.get("RANK", "0")) if "WORLD_SIZE" in os.environ else None
