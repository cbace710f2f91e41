"""The P-EAGLE head's configuration: its fields, the draft ``config.json`` vLLM reads, its tensor shapes.

Pure data (no torch, no vLLM): training, the registry, the swap protocol, the bench
and the controller all describe heads with these definitions.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from headspec.errors import HeadError

# Special tokens chat traffic never produces, in order of preference, used as the
# parallel-drafting (mask) token when the target has no dedicated one.
MASK_TOKEN_CANDIDATES = (
    "<|mask|>",
    "<mask>",
    "<empty_output>",
    "<jupyter_script>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
)


# Rotary embedding types the drafter (adapt.drafter.rope_inv_freq) implements.
DRAFTER_ROPE_TYPES = ("default", "linear", "llama3")


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers (2, L//2, L-3), made distinct and sorted.

    vLLM records aux states as ``sorted(set(ids))``, so duplicates (small targets)
    would silently shrink the fc input; fall back to evenly spread distinct layers.
    """
    L = num_target_layers
    ids = [2, L // 2, L - 3]
    if len(set(ids)) == 3 and all(0 <= i <= L for i in ids):
        return sorted(ids)
    spread = sorted({max(1, min(L - 1, round(L * f))) for f in (0.25, 0.5, 0.75)})
    if len(spread) == 3:
        return spread
    return list(range(L + 1))[-3:]


@dataclass
class DrafterConfig:
    """Shape and semantics of one P-EAGLE head (fields mirror the vLLM draft config)."""

    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    ptd_token_id: int
    num_speculative_tokens: int = 3
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    # vLLM default False: the residual stream starts from the un-normed hidden.
    norm_before_residual: bool = False
    num_target_layers: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_input_size(self) -> int:
        return self.n_aux * self.target_hidden_size

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DrafterConfig":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_target(
        cls,
        target_dir: str | Path,
        k: int = 3,
        draft_vocab_size: int | None = None,
        aux_layer_ids: list[int] | None = None,
        num_layers: int = 1,
    ) -> "DrafterConfig":
        """Size a head for the HF target in ``target_dir``."""
        tcfg = json.loads((Path(target_dir) / "config.json").read_text())
        L = int(tcfg["num_hidden_layers"])
        V = int(tcfg["vocab_size"])
        H = int(tcfg["hidden_size"])
        nh = int(tcfg["num_attention_heads"])
        ids = sorted(set(aux_layer_ids)) if aux_layer_ids else default_aux_layer_ids(L)
        if any(i < 0 or i > L for i in ids):
            raise ValueError(f"aux layer ids {ids} out of range for a {L}-layer target")
        rope = tcfg.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", tcfg.get("rope_theta", 10000.0)))
        scaling = None
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            scaling = {k_: v for k_, v in rope.items() if k_ != "rope_theta"}
        elif tcfg.get("rope_scaling"):
            scaling = dict(tcfg["rope_scaling"])
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) not in DRAFTER_ROPE_TYPES:
            # The drafter's rotary embedding is its own (vLLM builds it from the draft
            # config): a target scaling it does not implement (GPT-OSS's YaRN) gives
            # plain rotary at the target's theta, as published GPT-OSS EAGLE-3 heads use.
            scaling = None
        return cls(
            hidden_size=H,
            target_hidden_size=H,
            intermediate_size=int(tcfg["intermediate_size"]),
            num_attention_heads=nh,
            num_key_value_heads=int(tcfg.get("num_key_value_heads", nh)),
            head_dim=int(tcfg.get("head_dim") or H // nh),
            vocab_size=V,
            draft_vocab_size=min(int(draft_vocab_size or V), V),
            aux_layer_ids=ids,
            ptd_token_id=pick_mask_token(target_dir),
            num_speculative_tokens=k,
            num_layers=num_layers,
            rms_norm_eps=float(tcfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(tcfg.get("max_position_embeddings", 2048)),
            num_target_layers=L,
        )


def pick_mask_token(target_dir: str | Path) -> int:
    """Id of a special token the target's chat traffic never uses (the P-EAGLE mask token)."""
    tok = json.loads((Path(target_dir) / "tokenizer.json").read_text())
    added = {t["content"]: int(t["id"]) for t in tok.get("added_tokens", [])}
    for name in MASK_TOKEN_CANDIDATES:
        if name in added:
            return added[name]
    # Otherwise the last added special that is none of the structural ones.
    tcfg_path = Path(target_dir) / "tokenizer_config.json"
    structural = {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<pad>"}
    if tcfg_path.is_file():
        tc = json.loads(tcfg_path.read_text())
        structural |= {v for k, v in tc.items() if k.endswith("_token") and isinstance(v, str)}
    spare = [i for n, i in added.items() if n not in structural]
    if not spare:
        raise ValueError(f"{target_dir}: tokenizer has no spare special token to use as mask token")
    return max(spare)


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




# Fields of the draft config.json that fix tensor shapes or runtime constants vLLM's
# proposer caches at start-up: a head that differs in any of them cannot replace the
# running one in place (a restart is needed), and a warm start may never change them.
SHAPE_FIELDS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size", "target_hidden_size",
    "ptd_token_id", "mask_token_id",
)


def shape_signature(cfg: dict[str, Any] | DrafterConfig) -> dict[str, Any]:
    """What must match between two heads for an in-place swap (a draft config dict or a DrafterConfig)."""
    if isinstance(cfg, DrafterConfig):
        cfg = vllm_config_dict(cfg)
    sig = {k: cfg.get(k) for k in SHAPE_FIELDS}
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    sig["aux_layer_ids"] = list(ids) if ids is not None else None
    sig["num_speculative_tokens"] = cfg.get("num_speculative_tokens")
    return sig


def shape_differences(a: dict[str, Any] | DrafterConfig, b: dict[str, Any] | DrafterConfig) -> dict[str, tuple]:
    """Fields of :func:`shape_signature` where ``a`` and ``b`` differ: name -> (a's, b's)."""
    sa, sb = shape_signature(a), shape_signature(b)
    return {k: (sa[k], sb[k]) for k in sa if sa[k] != sb[k]}
