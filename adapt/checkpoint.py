"""Head directories: save, load, validate, import, random init.

A head directory is what stock vLLM loads with
``--speculative-config '{"method":"eagle3","model":DIR,"num_speculative_tokens":K,
"parallel_drafting":true}'``: ``config.json`` + ``model.safetensors`` (bf16, never
pickle), plus our ``manifest.json`` (weights sha256, target identity, lineage).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapt.drafter import DrafterConfig, PEagleDrafter
from adapt.model_zoo import sha256_file

WEIGHTS = "model.safetensors"
MANIFEST = "manifest.json"
FORMAT = "drafter-adapt/p-eagle-head/v1"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


class HeadError(ValueError):
    """A head directory is unusable; the message says why."""


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


# --- hashing / identity ---------------------------------------------------

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


# --- config.json ------------------------------------------------------------

def vllm_config_dict(cfg: DrafterConfig) -> dict[str, Any]:
    """The draft ``config.json`` vLLM's Eagle3LlamaForCausalLM reads."""
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        rope.update(cfg.rope_scaling)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
            "use_aux_hidden_state": True,
        },
        "ptd_token_id": cfg.ptd_token_id,
        "parallel_drafting": True,
        "num_speculative_tokens": cfg.num_speculative_tokens,
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }


UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


_REQUIRED = object()


def _int_field(d: dict[str, Any], key: str, default: Any = _REQUIRED) -> int:
    """An integer config value; ``int()`` would quietly turn 128.5 or "128" into a size."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise HeadError(f"config.json lacks {key!r}")
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise HeadError(f"config.json {key} must be an integer, got {v!r}")
    return v


def _float_field(d: dict[str, Any], key: str, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise HeadError(f"config.json {key} must be a number, got {v!r}")
    return float(v)


def _bool_field(d: dict[str, Any], key: str) -> bool:
    """A flag; ``bool("false")`` is True, so a string must not pass as one."""
    v = d.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise HeadError(f"config.json {key} must be true or false, got {v!r}")
    return v


def config_problems(cfg: DrafterConfig, head_dim_given: bool = True) -> list[str]:
    """Values no head can have (vLLM would crash, or silently compute something else)."""
    p = []
    sizes = {"hidden_size": cfg.hidden_size, "target_hidden_size": cfg.target_hidden_size,
             "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
             "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
             "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
             "num_hidden_layers": cfg.num_layers, "max_position_embeddings": cfg.max_position_embeddings,
             "num_speculative_tokens": cfg.num_speculative_tokens}
    p += [f"{k} {v} must be >= 1" for k, v in sizes.items() if v < 1]
    if p:
        return p  # the relations below divide by these
    if cfg.head_dim % 2:
        p.append(f"head_dim {cfg.head_dim} must be even (rotary embedding rotates halves)")
    # With an explicit head_dim vLLM never derives it from hidden_size, so only
    # the derived case needs hidden_size to split evenly over the heads.
    if not head_dim_given and cfg.hidden_size % cfg.num_attention_heads:
        p.append(f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads {cfg.num_attention_heads}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        p.append(f"num_key_value_heads {cfg.num_key_value_heads} does not divide "
                 f"num_attention_heads {cfg.num_attention_heads}")
    if cfg.draft_vocab_size > cfg.vocab_size:
        p.append(f"draft_vocab_size {cfg.draft_vocab_size} > vocab_size {cfg.vocab_size}")
    if not 0 <= cfg.ptd_token_id < cfg.vocab_size:
        p.append(f"ptd_token_id {cfg.ptd_token_id} outside the vocab [0, {cfg.vocab_size})")
    if any(i < 0 for i in cfg.aux_layer_ids):
        p.append(f"aux layer ids {cfg.aux_layer_ids} must be >= 0")
    if len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids) or list(cfg.aux_layer_ids) != sorted(cfg.aux_layer_ids):
        p.append(f"aux layer ids {cfg.aux_layer_ids} must be distinct and ascending (vLLM sorts them)")
    for name, v in (("rope_theta", cfg.rope_theta), ("rms_norm_eps", cfg.rms_norm_eps)):
        if not (math.isfinite(v) and v > 0):
            p.append(f"{name} {v} must be a finite number > 0")
    factor = (cfg.rope_scaling or {}).get("factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                               or not (math.isfinite(factor) and factor > 0)):
        p.append(f"rope scaling factor {factor!r} must be a finite number > 0")
    return p


def config_from_vllm_dict(d: dict[str, Any], target_layers: int | None = None,
                          ptd_fallback: int | None = None) -> DrafterConfig:
    """Inverse of :func:`vllm_config_dict`, tolerant of the variants heads ship with.

    Refuses (HeadError) mistyped fields and impossible values (:func:`config_problems`).
    """
    eagle = d.get("eagle_config") or {}
    on = [f for f in UNSUPPORTED_FLAGS if d.get(f) or eagle.get(f)]
    if on:
        raise HeadError(f"head uses {', '.join(on)}, which this drafter does not implement")
    if eagle.get("use_aux_hidden_state") is False:
        raise HeadError("head has use_aux_hidden_state=false (EAGLE-1 style), not an EAGLE-3 head")
    ids = d.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        if target_layers is None:
            raise HeadError("config.json names no eagle_aux_hidden_state_layer_ids")
        from adapt.drafter import default_aux_layer_ids

        ids = default_aux_layer_ids(target_layers)
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise HeadError(f"config.json eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    rope = d.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise HeadError(f"config.json rope_parameters must be an object, got {rope!r}")
    theta = _float_field(rope, "rope_theta", _float_field(d, "rope_theta", 10000.0))
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    elif d.get("rope_scaling"):
        scaling = dict(d["rope_scaling"])
    ptd_key = next((k for k in ("ptd_token_id", "mask_token_id", "pard_token") if d.get(k) is not None), None)
    ptd = _int_field(d, ptd_key) if ptd_key else ptd_fallback
    if ptd is None:
        raise HeadError("config.json has no ptd_token_id / mask_token_id: not a parallel-drafting head")
    H = _int_field(d, "hidden_size")
    nh = _int_field(d, "num_attention_heads")
    V = _int_field(d, "vocab_size")
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=_int_field(d, "target_hidden_size", H),
        intermediate_size=_int_field(d, "intermediate_size"),
        num_attention_heads=nh,
        num_key_value_heads=_int_field(d, "num_key_value_heads", nh),
        head_dim=_int_field(d, "head_dim", H // nh if nh > 0 else 0),
        vocab_size=V,
        draft_vocab_size=_int_field(d, "draft_vocab_size", V),
        aux_layer_ids=list(ids),
        ptd_token_id=ptd,
        num_speculative_tokens=_int_field(d, "num_speculative_tokens", 3),
        num_layers=_int_field(d, "num_hidden_layers", 1),
        rms_norm_eps=_float_field(d, "rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int_field(d, "max_position_embeddings", 2048),
        attention_bias=_bool_field(d, "attention_bias"),
        norm_before_residual=_bool_field(d, "norm_before_residual"),
        num_target_layers=target_layers,
    )
    problems = config_problems(cfg, head_dim_given=d.get("head_dim") is not None)
    if problems:
        raise HeadError("impossible config values: " + "; ".join(problems))
    return cfg


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as vLLM loads them."""
    H, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    s: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, H),
        "fc.weight": (H, cfg.fc_input_size),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "mask_hidden": (1, cfg.fc_input_size),
    }
    if cfg.draft_vocab_size != cfg.vocab_size:
        # vLLM only has a draft->target map when the vocabularies differ and
        # refuses a d2t tensor otherwise.
        s.update({"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,)})
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        fin = 2 * H if i == 0 else H
        s.update({
            p + "self_attn.q_proj.weight": (q, fin),
            p + "self_attn.k_proj.weight": (kv, fin),
            p + "self_attn.v_proj.weight": (kv, fin),
            p + "self_attn.o_proj.weight": (H, q),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, H),
            p + "mlp.down_proj.weight": (H, cfg.intermediate_size),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        })
        if i == 0:
            s[p + "hidden_norm.weight"] = (H,)
        if cfg.attention_bias:
            s.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                      p + "self_attn.v_proj.bias": (kv,)})
    return s


# --- save / load ------------------------------------------------------------

def _state_for_save(model: PEagleDrafter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    names = expected_shapes(model.config)
    sd = dict(model.state_dict())
    sd["embed_tokens.weight"] = model.merged_embed_weight()
    out = {}
    for name in names:
        t = sd[name].detach().cpu()
        if t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def _publish_dir(tmp: Path, final: Path) -> None:
    """Swap a fully written directory into place (old one removed only after the swap)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_head(
    model: PEagleDrafter,
    out_dir: str | Path,
    manifest_extra: dict[str, Any] | None = None,
    *,
    target_dir: str | Path | None = None,
) -> Path:
    """Write a vLLM-loadable head directory atomically; returns its path.

    ``manifest_extra`` may carry ``parent`` (sha or None), ``data_snapshot``,
    ``config`` (training config) and ``target`` (identity dict); ``target_dir``
    computes the target identity here instead.
    """
    out = Path(out_dir).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        save_file(_state_for_save(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(vllm_config_dict(model.config), indent=2) + "\n")
        extra = dict(manifest_extra or {})
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "sha256": sha256_file(tmp / WEIGHTS),
            "num_speculative_tokens": model.config.num_speculative_tokens,
            "target": extra.pop("target", None) or (target_identity(target_dir) if target_dir else None),
            "parent": extra.pop("parent", None),
            "data_snapshot": extra.pop("data_snapshot", None),
            "config": extra.pop("config", None),
            "drafter_config": model.config.to_dict(),
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        manifest.update(extra)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str) + "\n")
        # mkdtemp makes 0700; heads are read by other processes (vLLM, router).
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        _publish_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    return tensors


def load_head(head_dir: str | Path, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[PEagleDrafter, dict[str, Any]]:
    """Load a normalized head directory into a trainable ``PEagleDrafter``."""
    d = Path(head_dir)
    if not (d / "config.json").is_file() or not (d / WEIGHTS).is_file():
        raise HeadError(f"{d}: not a head directory (needs config.json and {WEIGHTS})")
    manifest = json.loads((d / MANIFEST).read_text()) if (d / MANIFEST).is_file() else {}
    cfg_json = json.loads((d / "config.json").read_text())
    if manifest.get("drafter_config"):
        cfg = DrafterConfig.from_dict(manifest["drafter_config"])
    else:
        cfg = config_from_vllm_dict(cfg_json)
    tensors = _read_tensors(d / WEIGHTS)
    _check_tensors(cfg, tensors, d)
    model = PEagleDrafter(cfg)
    sd = {k: v for k, v in tensors.items()}
    sd["mask_embedding"] = tensors["embed_tokens.weight"][cfg.ptd_token_id]
    # Full-vocab heads carry no d2t/t2d: the identity map set in __init__ stays.
    ref = model.state_dict()
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in sd.items()}, strict=False)
    return model.to(device=device, dtype=dtype).train(False), manifest


def _check_tensors(cfg: DrafterConfig, tensors: dict[str, Any], where: Path) -> None:
    """Raise HeadError on missing, unexpected or mis-shaped tensors."""
    want = expected_shapes(cfg)
    shapes = {k: tuple(v.shape if hasattr(v, "shape") else v) for k, v in tensors.items()}
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


# --- validate -----------------------------------------------------------------

# The dtypes a head's config.json may declare. Our heads (save_head; import_head
# re-saves foreign heads through it) are always bfloat16; a float16/float32 head is
# accepted as long as every weight is in the dtype it declares, since vLLM casts
# the weights to the serving dtype when it loads them. A weight in another dtype
# (an int8 or half ``fc`` in a bfloat16 head) is a broken export.
HEAD_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Index tensors: vLLM holds d2t as int64 (offsets, target = draft + d2t[draft]);
# t2d is a membership mask over the target vocab.
D2T_DTYPES = (torch.int64, torch.int32)
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


def declared_dtype(cfg_json: dict[str, Any]) -> torch.dtype:
    """The weight dtype config.json declares (``torch_dtype`` and/or ``dtype``)."""
    names = {cfg_json[k] for k in ("torch_dtype", "dtype") if cfg_json.get(k) is not None}
    if len(names) != 1:
        raise HeadError("config.json must declare one weight dtype in torch_dtype/dtype, got "
                        f"{sorted(map(repr, names)) or 'none'}")
    name = names.pop()
    if name not in HEAD_DTYPES:
        raise HeadError(f"config.json declares dtype {name!r}, not one of {', '.join(HEAD_DTYPES)}")
    return HEAD_DTYPES[name]


def _tensor_problems(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> list[str]:
    """Wrong dtypes, NaN/Inf values and all-zero weight matrices (shapes already checked)."""
    p = []
    for name in sorted(tensors):
        t = tensors[name]
        if name == "d2t":
            if t.dtype not in D2T_DTYPES:
                p.append(f"d2t is {t.dtype}, must be an integer tensor (int64)")
            continue
        if name == "t2d":
            if t.dtype != torch.bool:
                p.append(f"t2d is {t.dtype}, must be a bool mask")
            continue
        if t.dtype != dtype:
            p.append(f"{name} is {t.dtype}, config.json declares {dtype}")
            continue
        # One pass per tensor: min and max are NaN if any value is, +-Inf if any is,
        # and both 0 only when every value is.
        lo, hi = torch.aminmax(t)
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            bad = int((~torch.isfinite(t)).sum())
            p.append(f"{name} has {bad} NaN/Inf of {t.numel()} values")
        elif t.dim() == 2 and name not in MAY_BE_ZERO and lo == 0 and hi == 0:
            p.append(f"{name} is all zeros")
    return p


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
    loaders = [f"{name}: {field}" for name, doc in docs.items() for field in _code_loading_fields(doc)]
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
    # Every tensor is read here once (the weights are tens of MB): the shape,
    # dtype and value checks and the d2t/t2d checks all use this one read.
    try:
        with safe_open(str(d / WEIGHTS), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
        raise HeadError(f"{d}/{WEIGHTS} is not a readable safetensors file: {e}") from None
    _check_tensors(cfg, tensors, d)
    problems = _tensor_problems(tensors, dtype)
    if problems:
        raise HeadError(f"{d}/{WEIGHTS}: " + "; ".join(problems))

    warnings: list[str] = []
    if tcfg is not None:
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
        d2t, t2d = tensors["d2t"].long(), tensors["t2d"]
        tgt = torch.arange(d2t.numel()) + d2t
        if tgt.min() < 0 or tgt.max() >= cfg.vocab_size or tgt.unique().numel() != tgt.numel():
            raise HeadError(f"{d}: d2t maps draft ids outside the target vocab or onto duplicate ids")
        if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[tgt].all()):
            raise HeadError(f"{d}: t2d marks {int(t2d.sum())} tokens, not exactly the "
                            f"{cfg.draft_vocab_size} draft tokens d2t maps to")
    return HeadInfo(path=d.absolute(), config=cfg, manifest=manifest, sha256=digest,
                    num_speculative_tokens=k, warnings=warnings)


# --- random init / import ----------------------------------------------------------

def _target_tensors(target_dir: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Those of ``names`` the target's safetensors hold (float32), from whichever shard has them."""
    found: dict[str, torch.Tensor] = {}
    for p in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            for name in names:
                if name in f.keys():
                    found[name] = f.get_tensor(name).float()
    return found


def _target_embeddings(target_dir: Path) -> torch.Tensor:
    found = _target_tensors(target_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))
    if not found:
        raise HeadError(f"{target_dir}: no embed_tokens weight found in its safetensors")
    return found.get("model.embed_tokens.weight", found.get("embed_tokens.weight"))


def target_output_layer(target_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final norm weight [H] and output embedding [V,H] (its lm_head, or the tied embeddings)."""
    found = _target_tensors(target_dir, ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"))
    head = found.get("lm_head.weight", found.get("model.embed_tokens.weight"))
    if "model.norm.weight" not in found or head is None:
        raise HeadError(f"{target_dir}: no final norm / lm_head weights found in its safetensors")
    return found["model.norm.weight"], head


def init_output_from_target(model: PEagleDrafter, target_dir: str | Path) -> None:
    """Start ``norm`` and ``lm_head`` from the target's final norm and output rows of the draft vocabulary.

    The drafter then only has to learn to produce a hidden state like the
    target's; its logits start on the target's scale and token geometry.
    """
    norm, head = target_output_layer(Path(target_dir))
    ids = model.draft_to_target(torch.arange(model.config.draft_vocab_size, device=model.d2t.device)).cpu()
    with torch.no_grad():
        model.norm.weight.copy_(norm.to(model.norm.weight))
        model.lm_head.weight.copy_(head[ids].to(model.lm_head.weight))


def new_head(target_dir: str | Path, k: int = 3, draft_vocab_size: int | None = None,
             aux_layer_ids: list[int] | None = None, num_layers: int = 1, seed: int = 0) -> PEagleDrafter:
    """A randomly initialised drafter for ``target_dir`` (embeddings copied from the target)."""
    target_dir = Path(target_dir)
    cfg = DrafterConfig.from_target(target_dir, k, draft_vocab_size, aux_layer_ids, num_layers)
    torch.manual_seed(seed)
    model = PEagleDrafter(cfg)
    model.init_from_target(_target_embeddings(target_dir), seed=seed)
    return model


def init_random_head(target_dir: str | Path, out_dir: str | Path, k: int = 3,
                     draft_vocab_size: int | None = None, seed: int = 0,
                     aux_layer_ids: list[int] | None = None, num_layers: int = 1) -> Path:
    """Write a random P-EAGLE head for ``target_dir`` (draft vocab = first N ids)."""
    model = new_head(target_dir, k, draft_vocab_size, aux_layer_ids, num_layers, seed)
    return save_head(model, out_dir, {"parent": None, "data_snapshot": None, "init": {"kind": "random", "seed": seed}},
                     target_dir=target_dir)


def _normalize_name(name: str) -> str:
    """Map the tensor names EAGLE-3 / P-EAGLE / speculators checkpoints use to ours."""
    if name.startswith("model.") and not name.startswith("model.lm_head"):
        name = name[len("model."):]
    name = name.replace("midlayer.", "layers.0.")
    if name.endswith("draft_id_to_target_id"):
        name = "d2t"
    return name


def _source_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str, int | None]:
    """Flatten a speculators-format config into vLLM-style keys; returns (dict, format, K)."""
    if "speculators_config" not in raw and "speculators_model_type" not in raw:
        return dict(raw), "vllm-eagle3", raw.get("num_speculative_tokens")
    kind = raw.get("speculators_model_type", "eagle3")
    if kind not in ("eagle3", "peagle"):
        raise HeadError(f"speculators model type {kind!r} is not an EAGLE-3/P-EAGLE head")
    d = dict(raw.get("transformer_layer_config") or {})
    if not d:
        raise HeadError("speculators config has no transformer_layer_config")
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                "fc_norm", "norm_output"):
        if raw.get(key) is not None:
            d[key] = raw[key]
    # speculators' defaults differ by algorithm (vLLM's algos.py): eagle3 True, peagle False.
    d["norm_before_residual"] = raw.get("norm_before_residual", kind == "eagle3")
    if raw.get("mask_token_id") is not None:
        d["ptd_token_id"] = raw["mask_token_id"]
    k = None
    methods = (raw.get("speculators_config") or {}).get("proposal_methods") or []
    if methods:
        k = methods[0].get("speculative_tokens")
    return d, f"speculators-{kind}", k


def import_head(src_dir: str | Path, target_dir: str | Path, out_dir: str | Path, k: int | None = None) -> Path:
    """Normalize a foreign EAGLE-3 / P-EAGLE head (vLLM-style or speculators format) into a head dir.

    Missing ``embed_tokens`` is copied from the target; a plain EAGLE-3 head
    without ``mask_hidden``/mask token gets a zero ``mask_hidden`` and a spare
    special token (it then needs training before parallel drafting is useful).
    """
    src, target_dir = Path(src_dir), Path(target_dir)
    if not (src / "config.json").is_file():
        raise HeadError(f"{src}: config.json is missing")
    pickles = sorted(p.name for p in src.rglob("*") if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise HeadError(f"{src}: refusing pickle weights ({', '.join(pickles)}); convert them to safetensors first")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise HeadError(f"{src}: no *.safetensors weights")
    raw = json.loads((src / "config.json").read_text())
    flat, fmt, src_k = _source_config(raw)
    tcfg = json.loads((target_dir / "config.json").read_text())
    from adapt.drafter import pick_mask_token

    cfg = config_from_vllm_dict(flat, int(tcfg["num_hidden_layers"]), ptd_fallback=pick_mask_token(target_dir))
    cfg.num_speculative_tokens = int(k or src_k or cfg.num_speculative_tokens)
    notes: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in _read_tensors(f).items():
            tensors[_normalize_name(name)] = t
    if "embed_tokens.weight" not in tensors:
        tensors["embed_tokens.weight"] = _target_embeddings(target_dir)
        notes.append("embed_tokens copied from the target")
    if "mask_hidden" not in tensors:
        tensors["mask_hidden"] = torch.zeros(1, cfg.fc_input_size)
        notes.append("no mask_hidden: initialised to zeros (train before serving)")
    if "mask_hidden" in tensors:
        tensors["mask_hidden"] = tensors["mask_hidden"].reshape(1, -1)
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    elif "d2t" in tensors and "t2d" not in tensors:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + tensors["d2t"].long()] = True
        tensors["t2d"] = t2d
    _check_tensors(cfg, {n: t for n, t in tensors.items()}, src)
    model = PEagleDrafter(cfg)
    sd = dict(tensors)
    sd["mask_embedding"] = tensors["embed_tokens.weight"][cfg.ptd_token_id]
    ref = model.state_dict()
    model.load_state_dict({n: t.to(ref[n].dtype) for n, t in sd.items()}, strict=False)
    out = save_head(model, out_dir, {
        "parent": None, "data_snapshot": None,
        "imported_from": {"path": str(src.absolute()), "format": fmt,
                          "files": {f.name: sha256_file(f) for f in files}, "notes": notes},
    }, target_dir=target_dir)
    validate_head(out, target_dir)
    return out
