"""Deliberately worse copies of a head, to check that the promotion gate refuses them.

Each copy is a valid, loadable head of the same shapes (so it hot-swaps in place)
that drafts worse than its source:

* ``permute_lm_head``: the draft vocabulary's output rows are shuffled, so every
  draft names a wrong token while the rest of the head is intact;
* ``zero_mask_hidden``: the learned mask-slot hidden state is zeroed, so the
  parallel drafts after the first lose what they were trained on.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"
KINDS = ("permute_lm_head", "zero_mask_hidden")


def degraded_copy(src: str | Path, dst: str | Path, kind: str = "permute_lm_head", seed: int = 0) -> Path:
    """Write ``src`` with one deliberate defect (``KINDS``) to ``dst``; returns ``dst``."""
    if kind not in KINDS:
        raise ValueError(f"unknown degradation {kind!r}; choose from {KINDS}")
    src, dst = Path(src), Path(dst)
    t = load_file(str(src / WEIGHTS))
    if kind == "permute_lm_head":
        g = torch.Generator().manual_seed(seed)
        t["lm_head.weight"] = t["lm_head.weight"][torch.randperm(t["lm_head.weight"].shape[0], generator=g)].contiguous()
    else:
        t["mask_hidden"] = torch.zeros_like(t["mask_hidden"])
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    save_file(t, str(dst / WEIGHTS), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    manifest = json.loads((src / "manifest.json").read_text())
    manifest.update(sha256=hashlib.sha256((dst / WEIGHTS).read_bytes()).hexdigest(),
                    degraded={"from": manifest.get("sha256"), "kind": kind, "seed": seed})
    manifest.pop("version", None)
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return dst
