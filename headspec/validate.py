"""Is a head directory safe to load, and does it fit the target? (No torch, no vLLM.)

Every path that hands a head to a replica (the swap protocol, the bench, the cycle,
the registry import, the serving stack's first head) goes through
:func:`validate_head` first, so a broken head fails here with a message naming the
file and the field, before any canary sees it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from headspec.config import DrafterConfig, config_from_vllm_dict, expected_shapes
from headspec.errors import HeadError
from headspec.files import MANIFEST, PICKLE_SUFFIXES, WEIGHTS, Tensor, read_tensors, sha256_file, target_identity

# The dtypes a head's config.json may declare. Our heads (save_head; import_head
# re-saves foreign heads through it) are always bfloat16; a float16/float32 head is
# accepted as long as every weight is in the dtype it declares, since vLLM casts
# the weights to the serving dtype when it loads them. A weight in another dtype
# (an int8 or half ``fc`` in a bfloat16 head) is a broken export.
HEAD_DTYPES = ("bfloat16", "float16", "float32")
# Index tensors: vLLM holds d2t as int64 (offsets, target = draft + d2t[draft]);
# t2d is a membership mask over the target vocab.
D2T_DTYPES = ("int64", "int32")
# 2-D weights that may be all zeros: import_head gives a plain EAGLE-3 head (no
# parallel drafting yet) a zero mask_hidden, to be trained. 1-D tensors are never
# checked for zeros: init_from_target zeroes attention biases, a zero norm vector is
# a well-defined head with a constant draft (the serving tests build one), and
# d2t is all zeros whenever the draft vocab is the first N target ids.
MAY_BE_ZERO = frozenset({"mask_hidden"})
# Fields through which transformers imports code from a model directory.
CODE_FIELDS = ("auto_map", "trust_remote_code", "custom_pipelines")
# A class name transformers resolves itself; a dotted or "repo--module.Class"
# value names a module to import.
CLASS_FIELDS = ("tokenizer_class", "processor_class", "image_processor_type", "feature_extractor_type")
_PLAIN_CLASS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class HeadInfo:
    path: Path
    config: DrafterConfig
    manifest: dict[str, Any]
    sha256: str
    num_speculative_tokens: int
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "num_speculative_tokens": self.num_speculative_tokens,
            "aux_layer_ids": self.config.aux_layer_ids,
            "draft_vocab_size": self.config.draft_vocab_size,
            "ptd_token_id": self.config.ptd_token_id,
            "parent": self.manifest.get("parent"),
            "target": self.manifest.get("target"),
            "warnings": self.warnings,
        }


def check_tensors(cfg: DrafterConfig, shapes: dict[str, tuple[int, ...]], where: Path | str) -> None:
    """Raise HeadError on missing, unexpected or mis-shaped tensors (``shapes``: name -> shape)."""
    want = expected_shapes(cfg)
    shapes = {k: tuple(v) for k, v in shapes.items()}
    missing = sorted(set(want) - set(shapes))
    extra = sorted(set(shapes) - set(want))
    bad = [f"{k}: {shapes[k]} != expected {want[k]}" for k in sorted(want) if k in shapes and shapes[k] != want[k]]
    msgs = []
    if missing:
        msgs.append(f"missing tensors: {', '.join(missing)}")
    if extra:
        msgs.append(f"unexpected tensors: {', '.join(extra)}")
    if bad:
        msgs.append("wrong shapes: " + "; ".join(bad))
    if msgs:
        raise HeadError(f"{where}: " + " | ".join(msgs))


def _read_json(path: Path, where: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadError(f"{where}/{path.relative_to(where)} is not valid JSON: {e}") from None


def _code_loading_fields(obj: Any, at: str = "") -> list[str]:
    """Dotted paths of the fields in a parsed JSON document that would make transformers load code."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{at}.{k}" if at else str(k)
            if k in CODE_FIELDS:
                found.append(path)
            elif k in CLASS_FIELDS and v is not None and not (isinstance(v, str) and _PLAIN_CLASS.fullmatch(v)):
                found.append(f"{path}={v!r}")
            else:
                found += _code_loading_fields(v, path)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _code_loading_fields(v, f"{at}[{i}]")
    return found


def declared_dtype(cfg_json: dict[str, Any]) -> str:
    """The weight dtype config.json declares (``torch_dtype`` and/or ``dtype``)."""
    names = {cfg_json[k] for k in ("torch_dtype", "dtype") if cfg_json.get(k) is not None}
    if len(names) != 1:
        raise HeadError("config.json must declare one weight dtype in torch_dtype/dtype, got "
                        f"{sorted(map(repr, names)) or 'none'}")
    name = names.pop()
    if name not in HEAD_DTYPES:
        raise HeadError(f"config.json declares dtype {name!r}, not one of {', '.join(HEAD_DTYPES)}")
    return name


def tensor_problems(tensors: dict[str, Tensor], dtype: str) -> list[str]:
    """Wrong dtypes, NaN/Inf values and all-zero weight matrices (shapes already checked)."""
    p = []
    for name in sorted(tensors):
        t = tensors[name]
        if name == "d2t":
            if t.dtype not in D2T_DTYPES:
                p.append(f"d2t is {t.dtype}, must be an integer tensor (int64)")
            continue
        if name == "t2d":
            if t.dtype != "bool":
                p.append(f"t2d is {t.dtype}, must be a bool mask")
            continue
        if t.dtype != dtype:
            p.append(f"{name} is {t.dtype}, config.json declares {dtype}")
            continue
        v = t.values()
        if v.size == 0:
            continue
        # One pass per tensor: min and max are NaN if any value is, +-Inf if any is,
        # and both 0 only when every value is.
        lo, hi = v.min(), v.max()
        if not (np.isfinite(lo) and np.isfinite(hi)):
            p.append(f"{name} has {int((~np.isfinite(v)).sum())} NaN/Inf of {v.size} values")
        elif v.ndim == 2 and name not in MAY_BE_ZERO and lo == 0 and hi == 0:
            p.append(f"{name} is all zeros")
    return p


def draft_vocab_problem(cfg: DrafterConfig, d2t: np.ndarray, t2d: np.ndarray) -> str | None:
    """Why d2t/t2d do not describe the draft vocabulary (None when they do)."""
    tgt = np.arange(d2t.size, dtype=np.int64) + d2t.astype(np.int64)
    if tgt.min() < 0 or tgt.max() >= cfg.vocab_size or np.unique(tgt).size != tgt.size:
        return "d2t maps draft ids outside the target vocab or onto duplicate ids"
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[tgt].all()):
        return f"t2d marks {int(t2d.sum())} tokens, not exactly the {cfg.draft_vocab_size} draft tokens d2t maps to"
    return None


def target_fit(cfg: DrafterConfig, tcfg: dict[str, Any]) -> list[str]:
    """How a head's config does not fit a target's config.json."""
    L, Ht, V = int(tcfg["num_hidden_layers"]), int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    problems = []
    if cfg.target_hidden_size != Ht:
        problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden_size {Ht}")
    if cfg.vocab_size != V:
        problems.append(f"vocab_size {cfg.vocab_size} != target vocab_size {V}")
    bad_ids = [i for i in cfg.aux_layer_ids if not 0 <= i <= L]
    if bad_ids:
        problems.append(f"aux layer ids {bad_ids} out of range for a {L}-layer target")
    if not 0 <= cfg.ptd_token_id < V:
        problems.append(f"ptd_token_id {cfg.ptd_token_id} outside target vocab {V}")
    return problems


def validate_head(head_dir: str | Path, target_dir: str | Path | None = None,
                  require_manifest: bool = True) -> HeadInfo:
    """Check a head directory is safe and fits ``target_dir``; raise HeadError otherwise.

    Refused: pickle files, code (``*.py``, or JSON fields that make transformers
    import code), mistyped or impossible config values, a weights file that does
    not match the manifest's sha256, missing/extra/mis-shaped tensors, weights not
    in the declared dtype, NaN/Inf values, all-zero weight matrices, a d2t/t2d
    that does not describe a valid draft vocabulary, and (with ``target_dir``) a
    head that does not fit the target.
    """
    d = Path(head_dir)
    if not d.is_dir():
        raise HeadError(f"{d}: head directory does not exist")
    files = sorted(p for p in d.rglob("*") if p.is_file())
    pickles = [str(p.relative_to(d)) for p in files if p.suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        raise HeadError(f"{d}: pickle files are not allowed in a head (safetensors only): {', '.join(pickles)}")
    code = [str(p.relative_to(d)) for p in files if p.suffix.lower() == ".py"]
    if code:
        raise HeadError(f"{d}: code files are not allowed in a head: {', '.join(code)}")
    if not (d / "config.json").is_file():
        raise HeadError(f"{d}: config.json is missing")
    if not (d / WEIGHTS).is_file():
        raise HeadError(f"{d}: {WEIGHTS} is missing")
    docs = {p.relative_to(d).as_posix(): _read_json(p, d) for p in files if p.suffix.lower() == ".json"}
    loaders = [f"{name}: {field_}" for name, doc in docs.items() for field_ in _code_loading_fields(doc)]
    if loaders:
        raise HeadError(f"{d}: fields that load custom code are not allowed in a head: {'; '.join(loaders)}")
    cfg_json = docs["config.json"]
    if not isinstance(cfg_json, dict):
        raise HeadError(f"{d}/config.json is not a JSON object")
    manifest: dict[str, Any] = docs.get(MANIFEST, {})
    if MANIFEST not in docs and require_manifest:
        raise HeadError(f"{d}: {MANIFEST} is missing (import foreign heads with `adapt head import`)")
    if not isinstance(manifest, dict):
        raise HeadError(f"{d}/{MANIFEST} is not a JSON object")
    digest = sha256_file(d / WEIGHTS)
    if manifest.get("sha256") and manifest["sha256"] != digest:
        raise HeadError(f"{d}: {WEIGHTS} sha256 {digest[:12]}… does not match manifest {manifest['sha256'][:12]}…")

    tcfg = json.loads((Path(target_dir) / "config.json").read_text()) if target_dir else None
    try:
        cfg = config_from_vllm_dict(cfg_json, tcfg["num_hidden_layers"] if tcfg else None)
        dtype = declared_dtype(cfg_json)
    except HeadError as e:
        raise HeadError(f"{d}: {e}") from None
    ks = {src: v for src, v in ((MANIFEST, manifest.get("num_speculative_tokens")),
                                ("config.json", cfg_json.get("num_speculative_tokens"))) if v is not None}
    bad_k = [f"{src} num_speculative_tokens {v!r}" for src, v in ks.items()
             if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad_k or len(set(ks.values())) > 1:
        raise HeadError(f"{d}: num_speculative_tokens must be one integer >= 1, got " + ", ".join(
            f"{src} {v!r}" for src, v in ks.items()))
    k = next(iter(ks.values()), cfg.num_speculative_tokens)
    # Every tensor is read once (the weights are tens of MB): the shape, dtype and
    # value checks and the d2t/t2d checks all use this one read.
    tensors = read_tensors(d / WEIGHTS)
    check_tensors(cfg, {n: t.shape for n, t in tensors.items()}, d)
    problems = tensor_problems(tensors, dtype)
    if problems:
        raise HeadError(f"{d}/{WEIGHTS}: " + "; ".join(problems))

    warnings: list[str] = []
    if tcfg is not None:
        problems = target_fit(cfg, tcfg)
        if problems:
            raise HeadError(f"{d}: head does not fit target {target_dir}: " + "; ".join(problems))
        ident = manifest.get("target") or {}
        if ident.get("config_sha256") or ident.get("weights_sha256"):
            now = target_identity(target_dir)
            for key in ("config_sha256", "weights_sha256"):
                if ident.get(key) and ident[key] != now[key]:
                    warnings.append(f"trained for target {ident.get('name')} with {key} {ident[key][:12]}…, "
                                    f"serving target has {now[key][:12]}…")
    if "d2t" in tensors:
        problem = draft_vocab_problem(cfg, tensors["d2t"].values(), tensors["t2d"].values())
        if problem:
            raise HeadError(f"{d}: {problem}")
    return HeadInfo(path=d.absolute(), config=cfg, manifest=manifest, sha256=digest,
                    num_speculative_tokens=k, warnings=warnings)
