"""Shared by the serving tests (a support module: no test module imports another)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def constant_token_head(src: Path, dst: Path, token_id: int) -> Path:
    """Copy of ``src`` whose draft is always ``token_id``: final norm zeroed, draft vocab mapped so the
    draft is always that token (the tiny target emits token 1 often): non-zero acceptance, and two such
    heads from different random heads behave alike with different weights and sha256."""
    t = load_file(str(src / "model.safetensors"))
    t["norm.weight"] = torch.zeros_like(t["norm.weight"])
    # All draft logits tie at 0; vLLM's argmax takes the smallest target id among
    # them, so map the draft vocab onto token_id, token_id+1, ...
    n = t["d2t"].numel()
    t["d2t"] = torch.full_like(t["d2t"], token_id)
    t2d = torch.zeros_like(t["t2d"])
    t2d[token_id:token_id + n] = True
    t["t2d"] = t2d
    dst.mkdir(parents=True)
    save_file(t, str(dst / "model.safetensors"))
    shutil.copy(src / "config.json", dst / "config.json")
    m = json.loads((src / "manifest.json").read_text())
    m["sha256"] = hashlib.sha256((dst / "model.safetensors").read_bytes()).hexdigest()
    m["version"] = dst.name
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst
