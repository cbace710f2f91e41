"""Data parallelism under ``torchrun``: who this process is, and what the ranks agree on.

Launched without ``torchrun`` (no ``WORLD_SIZE``), everything here is a no-op
for a world of one, so the recipe reads the same either way.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    # Whether this process group was started here (and so is ours to destroy).
    owns_group: bool = False

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> Dist:
    """Join the ``torchrun`` process group when launched by it (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # CPU ranks share the cores; oversubscribed OpenMP threads spin and crawl.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return Dist(dist.get_rank(), dist.get_world_size(), owns)


def teardown_distributed(dd: Dist) -> None:
    """Leave the process group if :func:`init_distributed` started it (a caller's own group stays)."""
    if dd.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def wrap_data_parallel(model: torch.nn.Module, device: torch.device, dd: Dist) -> torch.nn.Module:
    """``model`` under DDP when there are several ranks (gradients averaged in ``backward``), else itself."""
    if dd.world <= 1:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def barrier(dd: Dist) -> None:
    """Wait for every rank (nothing to wait for alone)."""
    if dd.world > 1:
        dist.barrier()


def broadcast_from_main(obj, dd: Dist):
    """Rank 0's ``obj`` (any picklable value), on every rank."""
    if dd.world <= 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def max_over_ranks(value: float, dd: Dist) -> float:
    """The largest ``value`` of all ranks, on every rank."""
    if dd.world <= 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())
