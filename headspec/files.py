"""A head directory on disk: its files, its manifest, the identity of its target, its tensors.

A head directory is what stock vLLM loads with
``--speculative-config '{"method":"eagle3","model":DIR,"num_speculative_tokens":K,
"parallel_drafting":true}'``: ``config.json`` + ``model.safetensors`` (never pickle),
plus this project's ``manifest.json`` (weights sha256, target identity, lineage).

Tensors are read with numpy from the safetensors layout itself (an 8-byte header
length, a JSON header, raw little-endian data), so checking a head needs neither
torch nor vLLM; bfloat16 is widened to float32 exactly (its bits are the top half
of a float32's).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from headspec.errors import HeadError

WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
FORMAT = "drafter-adapt/p-eagle-head/v1"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

# safetensors dtype codes -> (numpy dtype of the stored bytes, the name config.json uses)
DTYPES = {
    "BF16": (np.dtype("<u2"), "bfloat16"), "F16": (np.dtype("<f2"), "float16"), "F32": (np.dtype("<f4"), "float32"),
    "F64": (np.dtype("<f8"), "float64"), "I64": (np.dtype("<i8"), "int64"), "I32": (np.dtype("<i4"), "int32"),
    "I16": (np.dtype("<i2"), "int16"), "I8": (np.dtype("i1"), "int8"), "U8": (np.dtype("u1"), "uint8"),
    "BOOL": (np.dtype("?"), "bool"),
}


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(head_dir: str | Path) -> dict[str, Any]:
    p = Path(head_dir) / MANIFEST
    return json.loads(p.read_text()) if p.is_file() else {}


_IDENTITY_CACHE: dict[tuple, dict[str, Any]] = {}


def target_identity(target_dir: str | Path) -> dict[str, Any]:
    """Name plus sha256 of the target's config.json and weights (cached per file stat)."""
    d = Path(target_dir).resolve()
    weights = sorted(d.glob("*.safetensors"))
    key = (str(d),) + tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in [d / "config.json", *weights])
    if key in _IDENTITY_CACHE:
        return dict(_IDENTITY_CACHE[key])
    cfg = json.loads((d / "config.json").read_text())
    name = cfg.get("_name_or_path") or cfg.get("_model_name_or_path") or d.name
    ready = d / ".ready.json"
    if ready.is_file():
        name = json.loads(ready.read_text()).get("name", name)
    if len(weights) == 1:
        wsha = sha256_file(weights[0])
    else:  # sharded: digest over (file name, file sha) pairs
        h = hashlib.sha256()
        for p in weights:
            h.update(f"{p.name}:{sha256_file(p)}\n".encode())
        wsha = h.hexdigest()
    ident = {
        "name": name,
        "config_sha256": sha256_file(d / "config.json"),
        "weights_sha256": wsha,
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
    }
    _IDENTITY_CACHE[key] = ident
    return dict(ident)


class Tensor:
    """One stored tensor: its dtype name as config.json spells it, its shape, its values (numpy)."""

    __slots__ = ("dtype", "shape", "raw")

    def __init__(self, dtype: str, shape: tuple[int, ...], raw: np.ndarray) -> None:
        self.dtype, self.shape, self.raw = dtype, shape, raw

    def values(self) -> np.ndarray:
        """The values; bfloat16 as the float32 numbers they are."""
        if self.dtype == "bfloat16":
            return (self.raw.astype(np.uint32) << 16).view(np.float32)
        return self.raw


def read_tensors(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file, by name; HeadError if the file is not a valid one."""
    data = Path(path).read_bytes()
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
    except (struct.error, ValueError) as e:
        raise HeadError(f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise HeadError(f"{path} is not a readable safetensors file: its header is not an object")
    base, out = 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (start, end) = meta["dtype"], tuple(int(x) for x in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise HeadError(f"{path}: tensor {name!r} has a malformed header entry ({e})") from None
        if dt not in DTYPES:
            raise HeadError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
        np_dtype, label = DTYPES[dt]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not (0 <= start <= end <= len(data) - base) or end - start != count * np_dtype.itemsize:
            raise HeadError(f"{path}: tensor {name!r} lies outside the file or has the wrong byte length")
        raw = np.frombuffer(data, dtype=np_dtype, count=count, offset=base + start).reshape(shape)
        out[name] = Tensor(label, shape, raw)
    return out
