"""P-EAGLE drafter head: an EAGLE-3 Llama head with parallel drafting.

The module mirrors vLLM 0.32 ``Eagle3LlamaForCausalLM`` (model_executor/models/
llama_eagle3.py) exactly, so weights trained here serve unchanged:

* ``fc`` projects the concatenated target aux hidden states (n_aux*Ht -> H);
  parallel-drafting (mask) slots use the learned ``mask_hidden`` *before* fc,
  as vLLM copies ``combine_hidden_states(mask_hidden)`` into those slots.
* layer 0 attends over ``[input_layernorm(embeds); hidden_norm(hidden)]`` (2H),
  with the residual stream starting from the un-normed hidden
  (``norm_before_residual`` false, vLLM's default).
* the final norm adds the residual, ``lm_head`` scores the draft vocabulary and
  ``d2t`` maps a draft id to its target id (target = draft + d2t[draft]).

Slot layout (what vLLM builds in ``_copy_and_expand_eagle_inputs``): for a
context x_0..x_m whose target hidden states h_0..h_{m-1} are known and whose
next token x_m was just sampled, slot i < m holds (token x_{i+1}, hidden h_i,
position i); slots m..m+K-2 hold (ptd token, mask_hidden, position i). Logits at
slots m-1..m+K-2 are the K draft tokens. ``build_draft_inputs`` builds this.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adapt.attention import SlotAttention, segment_attention, take_rows  # noqa: F401  (segment_attention: re-exported)
from headspec.config import DrafterConfig

class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 like vLLM's."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(dtype)


def rope_inv_freq(cfg: DrafterConfig) -> torch.Tensor:
    """Inverse rotary frequencies for the default and llama3/linear rope types."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        factor = float(sc["factor"])
        lo, hi = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope type {kind!r}")
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation (vLLM's Llama default; same as HF rotate_half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, in_features: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(in_features, self.nh * self.hd, bias=b)
        self.k_proj = nn.Linear(in_features, self.nkv * self.hd, bias=b)
        self.v_proj = nn.Linear(in_features, self.nkv * self.hd, bias=b)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, attention: SlotAttention, keep=None) -> torch.Tensor:
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, N, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attention(q, k, v)
        out = out.transpose(1, 2).reshape(B, N, self.nh * self.hd)
        return self.o_proj(out if keep is None else take_rows(out, keep))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """vLLM's EAGLE-3 LlamaDecoderLayer; layer 0 also consumes the token embeddings."""

    def __init__(self, cfg: DrafterConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.norm_before_residual = cfg.norm_before_residual
        H = cfg.hidden_size
        self.self_attn = Attention(cfg, 2 * H if layer_idx == 0 else H)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if layer_idx == 0:
            # vLLM creates hidden_norm on every layer but only layer 0 uses it.
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, residual, cos, sin, attention: SlotAttention, keep=None):
        """``keep`` (see :func:`take_rows`): return only those slots' rows ([n,H]); every slot still serves as a key."""
        if self.layer_idx == 0:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual = hidden + residual
            x = self.input_layernorm(residual)
        x = self.self_attn(x, cos, sin, attention, keep)
        residual = x + (residual if keep is None else take_rows(residual, keep))
        x = self.mlp(self.post_attention_layernorm(residual))
        return x, residual


class PEagleDrafter(nn.Module):
    """EAGLE-3 head with P-EAGLE parallel drafting (vLLM 0.32 semantics).

    Parameter/buffer names equal the checkpoint tensor names vLLM loads.
    ``embed_tokens`` is frozen (a copy of the target's); the mask token's row is
    the trainable ``mask_embedding`` and is merged into ``embed_tokens`` on save.
    """

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)
        self.mask_embedding = nn.Parameter(torch.zeros(H))
        self.fc = nn.Linear(cfg.fc_input_size, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.mask_hidden = nn.Parameter(torch.zeros(1, cfg.fc_input_size))
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.set_draft_vocab(torch.arange(cfg.draft_vocab_size))

    # --- vocab -------------------------------------------------------------

    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Use ``target_ids`` (sorted ascending, as vLLM expects) as the draft vocabulary."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten()
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocab needs {self.config.draft_vocab_size} ids, got {ids.numel()}")
        ids, _ = ids.sort()
        if ids.unique().numel() != ids.numel() or ids[-1] >= self.config.vocab_size or ids[0] < 0:
            raise ValueError("draft vocab ids must be distinct target ids")
        dev = self.d2t.device
        self.d2t.copy_((ids - torch.arange(ids.numel())).to(dev))
        self.t2d.zero_()
        self.t2d[ids.to(dev)] = True

    def remap_draft_vocab(self, target_ids: torch.Tensor, output_rows: torch.Tensor | None = None) -> int:
        """Hold ``target_ids`` in the draft vocabulary instead (same size); returns how many are new.

        A token that stays keeps its ``lm_head`` row. A new one starts from the
        target's own output row (``output_rows`` [vocab, H]), rescaled to the
        norm of the rows kept, or at the mean row (an average logit) without it.
        """
        ids = torch.as_tensor(target_ids, dtype=torch.long).flatten().sort().values
        old = self.draft_to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device)).cpu()
        where = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
        where[old] = torch.arange(old.numel())
        src = where[ids.clamp(0, self.config.vocab_size - 1)]
        keep = src >= 0
        with torch.no_grad():
            w = self.lm_head.weight
            rows = w.mean(0, keepdim=True).expand_as(w).clone()
            rows[keep.to(w.device)] = w[src[keep].to(w.device)]
            if output_rows is not None and bool(keep.any()) and bool((~keep).any()):
                kept = output_rows[ids[keep]].to(w)
                scale = rows[keep.to(w.device)].norm(dim=-1).mean() / kept.norm(dim=-1).mean().clamp(min=1e-12)
                rows[(~keep).to(w.device)] = output_rows[ids[~keep]].to(w) * scale
            w.copy_(rows)
        self.set_draft_vocab(ids)
        return int((~keep).sum())

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target-vocab ids."""
        return ids + self.d2t[ids]

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Map target ids to draft ids; -1 where the token is outside the draft vocab."""
        table = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        d = torch.arange(self.config.draft_vocab_size, device=self.d2t.device)
        table[d + self.d2t] = d
        return table[ids]

    # --- init --------------------------------------------------------------

    def init_from_target(self, embed_weight: torch.Tensor, seed: int = 0) -> None:
        """Copy the target's embeddings and give the other weights a small random init."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif p.dim() == 2 and name != "embed_tokens.weight":
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                elif name.endswith(".bias"):
                    p.zero_()
            self.embed_tokens.weight.copy_(embed_weight.to(self.embed_tokens.weight.dtype))
            # The mean embedding, not the target's own row: a head whose embeddings equal
            # the target's is made to share them by vLLM, and a later head with a trained
            # mask row could then never be hot-swapped in place.
            self.mask_embedding.copy_(self.embed_tokens.weight.float().mean(0).to(self.mask_embedding.dtype))

    def merged_embed_weight(self) -> torch.Tensor:
        """``embed_tokens`` with the trained mask-token row written in (what vLLM loads)."""
        w = self.embed_tokens.weight.detach().clone()
        w[self.config.ptd_token_id] = self.mask_embedding.detach().to(w.dtype)
        return w

    # --- forward -----------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        e = self.embed_tokens(input_ids)
        is_ptd = (input_ids == self.config.ptd_token_id).unsqueeze(-1)
        return torch.where(is_ptd, self.mask_embedding.to(e.dtype), e)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [B,N,hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B,1,N,hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        aux_hidden: torch.Tensor,
        is_mask: torch.Tensor,
        attn_mask: torch.Tensor | None,
        segments: list[list[tuple[int, int, int]]] | None = None,
        select: torch.Tensor | None = None,
        attention: SlotAttention | None = None,
    ) -> torch.Tensor:
        """Final normed hidden states [B,N,H] (before ``lm_head``), or [n,H] for the ``select`` slots.

        Nothing reads the last layer's output at other slots, so its ``o_proj`` and
        MLP run on the selected rows only (exact: every op after attention is per row).
        """
        dtype = self.fc.weight.dtype
        aux = torch.where(is_mask.unsqueeze(-1), self.mask_hidden.to(dtype), aux_hidden.to(dtype))
        hidden = self.fc(aux)
        embeds = self.embed(input_ids).to(dtype)
        cos, sin = self.rope(positions, dtype)
        if attention is None:
            attention = SlotAttention.from_dense(attn_mask, segments)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(embeds, hidden, residual, cos, sin, attention, select if i == last else None)
        return self.norm(hidden + residual)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        aux_hidden: torch.Tensor,
        is_mask: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        select: torch.Tensor | None = None,
        segments: list[list[tuple[int, int, int]]] | None = None,
        attention: SlotAttention | None = None,
    ) -> torch.Tensor:
        """Draft logits [B,N,draft_vocab], or [n,draft_vocab] for the ``select`` slots (Bool[B,N], or Long[n]
        flat indices, see :func:`take_rows`).

        input_ids/positions Long[B,N]; aux_hidden [B,N,n_aux*Ht]; is_mask Bool[B,N]
        (slot uses ``mask_hidden``); attn_mask Bool[B,N,N], True = may attend;
        ``segments`` (packed training rows, see :func:`segment_attention`) skips
        the pairs ``attn_mask`` rules out between examples. ``attention``
        (:class:`adapt.attention.SlotAttention`, the trainer's) replaces both.
        """
        # Training scores only labelled slots: prompt slots are attention context, and
        # lm_head + the loss over the draft vocabulary would otherwise be half the step.
        return self.lm_head(self.hidden(input_ids, positions, aux_hidden, is_mask, attn_mask, segments, select,
                                        attention))


def build_draft_inputs(
    context_ids: torch.Tensor,
    aux_hidden: torch.Tensor,
    next_token: int,
    cfg: DrafterConfig,
) -> dict[str, torch.Tensor]:
    """vLLM's single-request drafting pass as drafter inputs (batch of 1).

    ``context_ids`` [m] are the tokens the target has processed (x_0..x_{m-1}),
    ``aux_hidden`` [m, n_aux*Ht] their aux hidden states and ``next_token`` x_m
    the token the target just produced. Returns forward() kwargs plus
    ``sample_index`` [K]: the slots whose logits are draft tokens 1..K.
    """
    m = int(context_ids.shape[0])
    K = cfg.num_speculative_tokens
    dev = aux_hidden.device
    ids = torch.cat([
        context_ids[1:].to(dev),
        torch.tensor([next_token], device=dev),
        torch.full((K - 1,), cfg.ptd_token_id, device=dev),
    ]).long()
    n = m + K - 1
    hid = torch.cat([aux_hidden, aux_hidden.new_zeros(K - 1, aux_hidden.shape[-1])])
    is_mask = torch.arange(n, device=dev) >= m
    positions = torch.arange(n, device=dev)
    causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
    return {
        "input_ids": ids[None],
        "positions": positions[None],
        "aux_hidden": hid[None],
        "is_mask": is_mask[None],
        "attn_mask": causal[None],
        "sample_index": torch.arange(m - 1, n, device=dev),
    }


@torch.no_grad()
def propose(model: PEagleDrafter, context_ids: torch.Tensor, aux_hidden: torch.Tensor, next_token: int) -> list[int]:
    """Greedy K-token parallel draft (target ids), as vLLM proposes it."""
    inp = build_draft_inputs(context_ids, aux_hidden, next_token, model.config)
    idx = inp.pop("sample_index")
    logits = model(**inp)[0, idx]
    return model.draft_to_target(logits.argmax(-1)).tolist()
