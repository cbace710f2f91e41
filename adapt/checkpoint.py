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
import os
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


def config_from_vllm_dict(d: dict[str, Any], target_layers: int | None = None,
                          ptd_fallback: int | None = None) -> DrafterConfig:
    """Inverse of :func:`vllm_config_dict`, tolerant of the variants heads ship with."""
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
    rope = d.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = None
    if rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    elif d.get("rope_scaling"):
        scaling = dict(d["rope_scaling"])
    ptd = d.get("ptd_token_id", d.get("mask_token_id", d.get("pard_token")))
    if ptd is None:
        ptd = ptd_fallback
    if ptd is None:
        raise HeadError("config.json has no ptd_token_id / mask_token_id: not a parallel-drafting head")
    H = int(d["hidden_size"])
    nh = int(d["num_attention_heads"])
    try:
        return DrafterConfig(
            hidden_size=H,
            target_hidden_size=int(d.get("target_hidden_size") or H),
            intermediate_size=int(d["intermediate_size"]),
            num_attention_heads=nh,
            num_key_value_heads=int(d.get("num_key_value_heads") or nh),
            head_dim=int(d.get("head_dim") or H // nh),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            aux_layer_ids=[int(i) for i in ids],
            ptd_token_id=int(ptd),
            num_speculative_tokens=int(d.get("num_speculative_tokens") or 3),
            num_layers=int(d.get("num_hidden_layers", 1)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            attention_bias=bool(d.get("attention_bias", False)),
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            num_target_layers=target_layers,
        )
    except KeyError as e:
        raise HeadError(f"config.json lacks {e.args[0]!r}") from None


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

def validate_head(head_dir: str | Path, target_dir: str | Path | None = None,
                  require_manifest: bool = True) -> HeadInfo:
    """Check a head directory is safe and fits ``target_dir``; raise HeadError otherwise."""
    d = Path(head_dir)
    if not d.is_dir():
        raise HeadError(f"{d}: head directory does not exist")
    pickles = sorted(p.name for p in d.rglob("*") if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise HeadError(f"{d}: pickle files are not allowed in a head (safetensors only): {', '.join(pickles)}")
    if not (d / "config.json").is_file():
        raise HeadError(f"{d}: config.json is missing")
    if not (d / WEIGHTS).is_file():
        raise HeadError(f"{d}: {WEIGHTS} is missing")
    try:
        cfg_json = json.loads((d / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise HeadError(f"{d}/config.json is not valid JSON: {e}") from None
    manifest: dict[str, Any] = {}
    if (d / MANIFEST).is_file():
        manifest = json.loads((d / MANIFEST).read_text())
    elif require_manifest:
        raise HeadError(f"{d}: {MANIFEST} is missing (import foreign heads with `adapt head import`)")
    digest = sha256_file(d / WEIGHTS)
    if manifest.get("sha256") and manifest["sha256"] != digest:
        raise HeadError(f"{d}: {WEIGHTS} sha256 {digest[:12]}… does not match manifest {manifest['sha256'][:12]}…")

    tcfg = json.loads((Path(target_dir) / "config.json").read_text()) if target_dir else None
    cfg = config_from_vllm_dict(cfg_json, tcfg["num_hidden_layers"] if tcfg else None)
    try:
        with safe_open(str(d / WEIGHTS), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
        raise HeadError(f"{d}/{WEIGHTS} is not a readable safetensors file: {e}") from None
    _check_tensors(cfg, shapes, d)

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
        if len(set(cfg.aux_layer_ids)) != len(cfg.aux_layer_ids) or list(cfg.aux_layer_ids) != sorted(cfg.aux_layer_ids):
            problems.append(f"aux layer ids {cfg.aux_layer_ids} must be distinct and ascending (vLLM sorts them)")
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
    if "d2t" in shapes:
        with safe_open(str(d / WEIGHTS), framework="pt") as f:
            d2t = f.get_tensor("d2t").long()
            t2d = f.get_tensor("t2d")
        tgt = torch.arange(d2t.numel()) + d2t
        if tgt.min() < 0 or tgt.max() >= cfg.vocab_size or tgt.unique().numel() != tgt.numel():
            raise HeadError(f"{d}: d2t maps draft ids outside the target vocab or onto duplicate ids")
        if t2d.dtype == torch.bool and int(t2d.sum()) != cfg.draft_vocab_size:
            raise HeadError(f"{d}: t2d marks {int(t2d.sum())} tokens, draft vocab is {cfg.draft_vocab_size}")
    k = int(manifest.get("num_speculative_tokens") or cfg_json.get("num_speculative_tokens") or cfg.num_speculative_tokens)
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
