"""Head directories from and into the torch drafter: save, load, import, random init.

What a head directory is, and the checks it must pass, are the head contract
(:mod:`headspec`); this module moves :class:`adapt.drafter.PEagleDrafter` weights in
and out of that format (bf16 safetensors, never pickle).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adapt.drafter import PEagleDrafter
from headspec.config import DrafterConfig, config_from_vllm_dict, expected_shapes, pick_mask_token, vllm_config_dict
from headspec.errors import HeadError
from headspec.files import FORMAT, MANIFEST, PICKLE_SUFFIXES, WEIGHTS, sha256_file, target_identity
from headspec.validate import check_tensors, validate_head


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
            "drafter_config": model.config.to_json(),
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
        cfg = DrafterConfig.from_json(manifest["drafter_config"])
    else:
        cfg = config_from_vllm_dict(cfg_json)
    tensors = _read_tensors(d / WEIGHTS)
    check_tensors(cfg, {n: t.shape for n, t in tensors.items()}, d)
    model = PEagleDrafter(cfg)
    sd = {k: v for k, v in tensors.items()}
    sd["mask_embedding"] = tensors["embed_tokens.weight"][cfg.ptd_token_id]
    # Full-vocab heads carry no d2t/t2d: the identity map set in __init__ stays.
    ref = model.state_dict()
    model.load_state_dict({k: v.to(ref[k].dtype) for k, v in sd.items()}, strict=False)
    return model.to(device=device, dtype=dtype).train(False), manifest


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


# Tensors some exporters write that no served head uses: speculators' training-time copies
# of the target's output layer, and the ``hidden_norm`` vLLM creates on every layer but
# only reads on the first (layers after it take no embeddings).
_TRAINING_ONLY = frozenset({"verifier_lm_head.weight", "verifier_norm.weight"})
_UNUSED_HIDDEN_NORM = re.compile(r"layers\.\d+\.hidden_norm\.weight")


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

    Any number of layers, with the head's own inner sizes (the published P-EAGLE
    heads have 4 layers; tests/peagle_support.py writes their layout). Missing
    ``embed_tokens`` is copied from the target; a plain EAGLE-3 head without
    ``mask_hidden``/mask token gets a zero ``mask_hidden`` and a spare special token
    (it then needs training before parallel drafting is useful). Tensors vLLM never
    reads (speculators' ``verifier_*`` copies, ``hidden_norm`` past the first layer)
    are dropped; the manifest's ``imported_from.notes`` says what was done.
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
    cfg = config_from_vllm_dict(flat, int(tcfg["num_hidden_layers"]), ptd_fallback=pick_mask_token(target_dir))
    cfg.num_speculative_tokens = int(k or src_k or cfg.num_speculative_tokens)
    notes: list[str] = []
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in _read_tensors(f).items():
            tensors[_normalize_name(name)] = t
    for name in sorted(tensors):
        if name in _TRAINING_ONLY or (_UNUSED_HIDDEN_NORM.fullmatch(name) and not name.startswith("layers.0.")):
            del tensors[name]
            notes.append(f"dropped {name} (vLLM never reads it)")
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
    check_tensors(cfg, {n: t.shape for n, t in tensors.items()}, src)
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
