"""P-EAGLE drafters for tests: a small random one in memory (:func:`small_drafter`), and heads written the
way the published P-EAGLE checkpoints are (speculators ``peagle`` format).

Not a test module: test modules import it, never each other.

The published heads (GPT-OSS 20B/120B, Qwen3-Coder-30B-A3B) are 4-layer Llama-layer
drafters saved by speculators: ``config.json`` with ``speculators_model_type: peagle``,
the layer sizes under ``transformer_layer_config`` (which need not be the target's),
``mask_token_id``, the aux layer ids and the draft vocab size at the top level, and K
under ``speculators_config.proposal_methods``; tensors ``layers.N.*`` (``hidden_norm``
on the first layer only), ``fc.weight``, ``norm.weight``, ``lm_head.weight``, their
own trained ``embed_tokens.weight``, ``mask_hidden`` of shape [1, 1, n_aux*H] and the
draft vocabulary as ``d2t`` (int64 offsets) / ``t2d`` (bool mask). This writes such a
head from random weights for a tiny target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headspec.config import DrafterConfig, default_aux_layer_ids, pick_mask_token


def small_drafter(k: int = 3, num_layers: int = 1, seed: int = 0):
    """A random drafter of a few thousand weights (hidden 32 over a 16-wide target, vocab 40, a 24-token draft
    vocabulary that skips ids 20-29, mask token 39), in eval mode; weights drawn N(0, 0.3) so that its
    outputs are far from uniform."""
    from adapt.drafter import PEagleDrafter

    cfg = DrafterConfig(hidden_size=32, target_hidden_size=16, intermediate_size=48, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=40, draft_vocab_size=24,
                        aux_layer_ids=[1, 2, 3], ptd_token_id=39, num_speculative_tokens=k, num_layers=num_layers)
    torch.manual_seed(seed)
    m = PEagleDrafter(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    m.set_draft_vocab(torch.cat([torch.arange(0, 20), torch.arange(30, 34)]))
    return m.eval()


def write_published_peagle_head(target_dir: Path, out_dir: Path, *, num_layers: int = 4, k: int = 3,
                                draft_vocab_size: int = 256, intermediate_size: int = 384,
                                num_attention_heads: int = 2, num_key_value_heads: int = 2,
                                norm_before_residual: bool = True, seed: int = 0) -> Path:
    """A random ``num_layers``-layer P-EAGLE head for ``target_dir`` in the published layout.

    The inner sizes (``intermediate_size``, attention heads) deliberately differ from
    the target's, as a published head's may: an import and a warm start must keep them.
    """
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    H, V, L = int(tcfg["hidden_size"]), int(tcfg["vocab_size"]), int(tcfg["num_hidden_layers"])
    head_dim = H // num_attention_heads
    aux = default_aux_layer_ids(L)
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.05) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return (1.0 + torch.randn(n, generator=g) * 0.05).to(torch.bfloat16)

    t: dict[str, torch.Tensor] = {}
    q, kv = num_attention_heads * head_dim, num_key_value_heads * head_dim
    for i in range(num_layers):
        p, fin = f"layers.{i}.", 2 * H if i == 0 else H
        t.update({
            p + "self_attn.q_proj.weight": w(q, fin), p + "self_attn.k_proj.weight": w(kv, fin),
            p + "self_attn.v_proj.weight": w(kv, fin), p + "self_attn.o_proj.weight": w(H, q),
            p + "mlp.gate_proj.weight": w(intermediate_size, H), p + "mlp.up_proj.weight": w(intermediate_size, H),
            p + "mlp.down_proj.weight": w(H, intermediate_size),
            p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
        })
    t["layers.0.hidden_norm.weight"] = ones(H)
    t["fc.weight"] = w(H, len(aux) * H)
    t["norm.weight"] = ones(H)
    t["lm_head.weight"] = w(draft_vocab_size, H)
    t["mask_hidden"] = w(1, 1, len(aux) * H, std=1.0)
    # P-EAGLE trains its embeddings (speculators' embed_requires_grad): the target's, moved.
    with safe_open(str(Path(target_dir) / "model.safetensors"), framework="pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight").float()
    t["embed_tokens.weight"] = (emb + torch.randn(emb.shape, generator=g) * 0.01).to(torch.bfloat16)
    # Draft vocabulary: the even token ids (so the d2t offsets are not all zero).
    assert V >= 2 * draft_vocab_size, "the target's vocabulary is too small for this draft vocabulary"
    ids = torch.arange(0, 2 * draft_vocab_size, 2)
    t["d2t"] = ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    out = Path(out_dir)
    out.mkdir(parents=True)
    save_file({n: v.contiguous() for n, v in t.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    layer = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": intermediate_size, "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads, "head_dim": head_dim, "num_hidden_layers": num_layers,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 2048,
        "attention_bias": False, "mlp_bias": False, "vocab_size": V, "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps({
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": "peagle",
        "speculators_version": "0.3.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": None,
        "norm_before_residual": norm_before_residual,
        "norm_before_fc": False,
        "embed_requires_grad": True,
        "mask_token_id": pick_mask_token(target_dir),
        "eagle_aux_hidden_state_layer_ids": aux,
        # Training-only P-EAGLE fields an importer ignores.
        "para_depths": 8, "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2, "max_seq_len": 2048,
        "speculators_config": {
            "algorithm": "peagle", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": tcfg.get("architectures"), "name_or_path": str(target_dir)},
        },
        "dtype": "bfloat16",
    }, indent=2))
    return out
