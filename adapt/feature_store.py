"""The target's features on disk, shared by the training runs of one deployment.

A cycle trains on a window of captured traffic, and most of tonight's window is last
night's: the target's aux hidden states and final hidden states of an example depend only
on the target and the example's tokens, not on the head being trained. On a CPU the
target's forwards are most of a training run (``adapt.features``), so each example is
featurized once per deployment and read back by every later run that trains on it.

Layout: ``<root>/<identity>/<key[:2]>/<key>.safetensors``, where the identity digests
the target (its weights' sha256), the aux layers, the precision the target ran in and
this format's version, and the key digests the example's token ids and loss mask; a file
also holds both, checked on reading, so a stale or foreign file is never used. Features
are user data (hidden states can be decoded back to text): they live under the state
directory, beside the warehouse, in a directory only its owner reads. The store keeps
under ``max_bytes``, dropping the least recently used files first.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from adapt.data import Example
from adapt.loss import Features

FORMAT = 1
# After an eviction the store is this share of its budget, so the next writes do not each evict again.
EVICT_TO = 0.8


def example_key(ex: Example) -> str:
    """What names an example's features: its token ids and its loss mask."""
    h = hashlib.sha256()
    h.update(ex.input_ids.to(torch.int64).contiguous().numpy().tobytes())
    h.update(ex.loss_mask.to(torch.bool).contiguous().numpy().tobytes())
    return h.hexdigest()


class FeatureStore:
    """Compact features (``Features.target_hidden``, not logits) of examples, on disk, within ``max_bytes``."""

    def __init__(self, root: str | Path, identity: dict, max_bytes: int) -> None:
        blob = json.dumps({**identity, "format": FORMAT}, sort_keys=True)
        self.root = Path(root)
        self.dir = self.root / hashlib.sha256(blob.encode()).hexdigest()[:24]
        self.max_bytes = max_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        (self.dir / "identity.json").write_text(blob)
        self.used = sum(p.stat().st_size for p in self._files())
        self.hits = self.misses = self.writes = self.evicted = 0

    def _files(self) -> list[Path]:
        return list(self.root.glob("*/*/*.safetensors"))

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.safetensors"

    def load(self, ex: Example) -> Features | None:
        """``ex``'s features as stored, or None (not stored, unreadable, or not this example's)."""
        path = self._path(example_key(ex))
        try:
            t = load_file(str(path))
            os.utime(path)  # recently used: evicted last
        except (OSError, ValueError, RuntimeError, SafetensorError):
            self.misses += 1
            return None
        ids, mask = t.get("input_ids"), t.get("loss_mask")
        names = ("aux_hidden", "target_argmax", "logit_rows", "target_hidden")
        if ids is None or mask is None or not torch.equal(ids, ex.input_ids.to(torch.int64)) \
                or not torch.equal(mask, ex.loss_mask.to(torch.bool)) or any(n not in t for n in names):
            self.misses += 1
            return None
        self.hits += 1
        return Features(input_ids=ids, loss_mask=ex.loss_mask, aux_hidden=t["aux_hidden"], target_logits=None,
                        target_argmax=t["target_argmax"], logit_rows=t["logit_rows"], target_hidden=t["target_hidden"])

    def save(self, ex: Example, f: Features) -> None:
        """Store ``f`` (compact features only: logits depend on the head's draft vocabulary)."""
        if f.target_hidden is None or self.max_bytes <= 0:
            return
        path = self._path(example_key(ex))
        if path.exists():
            return
        path.parent.mkdir(exist_ok=True)
        tensors = {"input_ids": f.input_ids.to(device="cpu", dtype=torch.int64),
                   "loss_mask": ex.loss_mask.to(torch.bool), "aux_hidden": f.aux_hidden.cpu(),
                   "target_argmax": f.target_argmax.cpu(), "logit_rows": f.logit_rows.cpu(),
                   "target_hidden": f.target_hidden.cpu()}
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")  # ranks may write the same example at once
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)
        self.used += path.stat().st_size
        self.writes += 1
        if self.used > self.max_bytes:
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used files (any identity's) until the store is :data:`EVICT_TO` of its budget."""
        files = []
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        files.sort()
        self.used = sum(s for _, s, _ in files)
        for _, size, p in files:
            if self.used <= self.max_bytes * EVICT_TO:
                break
            p.unlink(missing_ok=True)
            self.used -= size
            self.evicted += 1

    def report(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "writes": self.writes, "evicted": self.evicted,
                "bytes": self.used}
