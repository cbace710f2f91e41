"""Where the drafter and the target run: the device and the matmul precision."""

from __future__ import annotations

import os

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
    if device.type != "cpu":
        return False
    probes = (getattr(torch.cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    return any(probe is not None and bool(probe()) for probe in probes)
