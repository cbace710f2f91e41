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
import os
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
# Where the sha256 of each target file is kept between processes, by (path, size, mtime): a large target is
# hashed once per machine, not once per process that validates a head. ADAPT_IDENTITY_CACHE moves it.
IDENTITY_CACHE_ENV = "ADAPT_IDENTITY_CACHE"


def identity_cache_dir() -> Path:
    explicit = os.environ.get(IDENTITY_CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("DRAFTER_ADAPT_HOME") or str(Path.home() / ".cache" / "drafter-adapt")
    return Path(home).expanduser() / "target-identity"


def _cache_file(d: Path, cache_dir: Path) -> Path:
    return cache_dir / (hashlib.sha256(str(d).encode()).hexdigest()[:32] + ".json")


def _file_shas(d: Path, files: list[Path], cache_dir: Path | None) -> dict[str, str]:
    """sha256 of each of ``files`` (in ``d``), reusing the on-disk cache for files whose size and mtime are
    unchanged; the cache is rewritten when anything was hashed. A cache that cannot be read or written only
    costs the hashing."""
    cached: dict[str, Any] = {}
    path = _cache_file(d, cache_dir) if cache_dir is not None else None
    if path is not None:
        try:
            raw = json.loads(path.read_text())
            if raw.get("dir") == str(d) and isinstance(raw.get("files"), dict):
                cached = raw["files"]
        except (OSError, ValueError, AttributeError):
            pass
    out: dict[str, str] = {}
    entries: dict[str, Any] = {}
    hashed = False
    for f in files:
        st = f.stat()
        hit = cached.get(f.name)
        if isinstance(hit, dict) and hit.get("size") == st.st_size and hit.get("mtime_ns") == st.st_mtime_ns \
                and isinstance(hit.get("sha256"), str):
            sha = hit["sha256"]
        else:
            sha, hashed = sha256_file(f), True
        out[f.name] = sha
        entries[f.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    if hashed and path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"dir": str(d), "files": entries}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return out


def target_identity(target_dir: str | Path, cache_dir: str | Path | None = "") -> dict[str, Any]:
    """Name plus sha256 of the target's config.json and weights.

    Each file is hashed once per (path, size, mtime): in memory for this process, and on disk in
    ``cache_dir`` (default :func:`identity_cache_dir`; None: no disk cache) for the next one."""
    d = Path(target_dir).resolve()
    weights = sorted(d.glob("*.safetensors"))
    files = [d / "config.json", *weights]
    key = (str(d),) + tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    if key in _IDENTITY_CACHE:
        return dict(_IDENTITY_CACHE[key])
    cfg = json.loads((d / "config.json").read_text())
    name = cfg.get("_name_or_path") or cfg.get("_model_name_or_path") or d.name
    ready = d / ".ready.json"
    if ready.is_file():
        name = json.loads(ready.read_text()).get("name", name)
    shas = _file_shas(d, files, identity_cache_dir() if cache_dir == "" else
                      (Path(cache_dir) if cache_dir is not None else None))
    if len(weights) == 1:
        wsha = shas[weights[0].name]
    else:  # sharded: digest over (file name, file sha) pairs
        h = hashlib.sha256()
        for p in weights:
            h.update(f"{p.name}:{shas[p.name]}\n".encode())
        wsha = h.hexdigest()
    ident = {
        "name": name,
        "config_sha256": shas["config.json"],
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
