"""The resumable run: its progress, its trainable weights and AdamW moments, in ``run_dir``.

Safetensors and JSON only (no pickle). A run resumes only from a checkpoint with
its own fingerprint (config, target, parent head and data), so a changed run
starts over instead of continuing someone else's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from settings.config import Config

RUN_STATE = "train_state.json"
RUN_MODEL = "model.safetensors"
RUN_OPTIM = "optimizer.safetensors"


@dataclass
class RunState:
    """Where a run stands; ``seconds`` is the training time of the runs before this one."""

    fingerprint: str
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    loss_curve: list[float] = field(default_factory=list)
    # The last step's loss and top-1 agreement per depth (empty before the first step).
    depth_loss: list[float] = field(default_factory=list)
    depth_acc: list[float] = field(default_factory=list)
    # The attention backend the run trains with (adapt.attention): kept so a resumed run computes as it did.
    attention: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "RunState":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in known})


def run_fingerprint(cfg: Config, parent_sha: str | None, snapshot: str) -> str:
    """What makes two runs the same run: training and head config, target, parent head, data."""
    blob = json.dumps({"training": cfg.training.model_dump(mode="json"), "head": cfg.head.model_dump(mode="json"),
                       "target": cfg.target.model, "parent": parent_sha, "data": snapshot}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def save_run_state(run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, state: RunState) -> None:
    """Trainable weights + AdamW moments as safetensors, ``state`` as JSON."""
    run_dir.mkdir(parents=True, exist_ok=True)
    params = trainable(model)
    save_file({n: p.detach().cpu().contiguous() for n, p in params.items()}, str(run_dir / f".{RUN_MODEL}"))
    moments: dict[str, torch.Tensor] = {}
    for n, p in params.items():
        for k, v in opt.state.get(p, {}).items():
            moments[f"{n}::{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
    save_file(moments, str(run_dir / f".{RUN_OPTIM}"))
    (run_dir / f".{RUN_STATE}").write_text(json.dumps(state.to_json(), indent=1))
    # Rename last: a crash mid-save leaves the previous complete checkpoint.
    for name in (RUN_MODEL, RUN_OPTIM, RUN_STATE):
        os.replace(run_dir / f".{name}", run_dir / name)


def load_run_state(run_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                   fingerprint: str) -> RunState | None:
    """Restore a checkpoint written by :func:`save_run_state` for the same run; None if absent/foreign."""
    if not (run_dir / RUN_STATE).is_file():
        return None
    state = json.loads((run_dir / RUN_STATE).read_text())
    if state.get("fingerprint") != fingerprint:
        return None
    params = trainable(model)
    weights = load_file(str(run_dir / RUN_MODEL))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n].to(p.device, p.dtype))
    moments = load_file(str(run_dir / RUN_OPTIM))
    for n, p in params.items():
        st = {k.split("::", 1)[1]: v.to(p.device) for k, v in moments.items() if k.split("::", 1)[0] == n}
        if st:
            opt.state[p] = st
    return RunState.from_json(state)
