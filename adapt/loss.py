"""P-EAGLE batch assembly and loss.

:func:`collate` turns packed rows of featurized examples into drafter inputs
following :mod:`adapt.layout`; :func:`peagle_loss` is the per-depth
KL(target restricted to the draft vocabulary || drafter), weighted by depth,
with per-depth top-1 agreement (drafter argmax == target argmax) for logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from adapt.attention import SlotAttention, take_rows
from adapt.layout import ExampleSlots, batch_attention_mask, example_slots


@dataclass
class Features:
    """One example with everything training needs from the target, computed once.

    ``target_logits`` are the target's logits restricted to the draft vocabulary
    (columns in draft-id order), for every position or only for ``logit_rows``
    (see :func:`label_rows`). Compact features hold ``target_hidden`` instead:
    the target's final-norm output at those rows, which the trainer projects
    through the target's output rows of the draft vocabulary (the same product
    the target's output layer computes) at a fraction of the memory
    (H_target instead of draft_vocab values per row). ``target_argmax`` is the
    target's greedy token over its full vocabulary, so tokens outside the draft
    vocab count as misses (-1 where no slot is labelled with that position).
    """

    input_ids: torch.Tensor  # Long[N]
    loss_mask: torch.Tensor  # Bool[N]
    aux_hidden: torch.Tensor  # [N, n_aux*Ht]
    target_logits: torch.Tensor | None  # [N, draft_vocab], or [R, draft_vocab] for logit_rows; None if compact
    target_argmax: torch.Tensor  # Long[N]
    logit_rows: torch.Tensor | None = None  # Long[R]: positions the target rows hold (None = all)
    target_hidden: torch.Tensor | None = None  # [R, H_target] final-norm output, in place of target_logits
    # Host-side plans of this example, built once: its slots per (K, depth_keep) (see slots()), its logit index.
    slot_plans: dict = field(default_factory=dict, repr=False, compare=False)

    def slots(self, k: int, depth_keep: Sequence[float] = ()) -> ExampleSlots:
        """This example's :class:`adapt.layout.ExampleSlots`, built on first use and kept with the features."""
        key = (k, tuple(depth_keep))
        if key not in self.slot_plans:
            self.slot_plans[key] = example_slots(self.loss_mask.cpu(), k, depth_keep)
        return self.slot_plans[key]

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def target_rows(self) -> torch.Tensor:
        """What this example keeps of the target per row: logits, or (compact) final hidden states."""
        return self.target_logits if self.target_hidden is None else self.target_hidden

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.aux_hidden, self.target_rows))

    def logit_index(self) -> torch.Tensor:
        """Long[N] (host): row of ``target_logits`` for each position, -1 where not kept; built once."""
        if "logit_index" not in self.slot_plans:
            if self.logit_rows is None:
                idx = torch.arange(len(self))
            else:
                idx = torch.full((len(self),), -1, dtype=torch.long)
                rows = self.logit_rows.cpu()
                idx[rows] = torch.arange(rows.numel())
            self.slot_plans["logit_index"] = idx
        return self.slot_plans["logit_index"]


def label_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions whose target distribution some slot is trained on: those followed by an assistant token.

    Prompt positions only serve as attention context, so a feature cache keeps
    the draft-vocabulary logits of these rows alone (most of a tool-call
    request is its prompt).
    """
    return loss_mask[1:].nonzero().squeeze(1)


def project_hidden(hidden: torch.Tensor, output_rows: torch.Tensor) -> torch.Tensor:
    """The target's final hidden states [n,H] -> its logits over the draft vocabulary [n,Vd]:
    ``hidden @ output_rows.T`` in the output rows' dtype, the product its output layer computes."""
    return hidden.to(output_rows) @ output_rows.T


@dataclass
class Batch:
    input_ids: torch.Tensor  # Long[B,S]
    positions: torch.Tensor  # Long[B,S]
    aux_hidden: torch.Tensor  # [B,S,F]
    is_mask: torch.Tensor  # Bool[B,S]
    depth: torch.Tensor  # Long[B,S], 0 = padding
    valid: torch.Tensor  # Bool[B,S]
    # [n,Vd]: the valid slots' rows, in ``valid`` order (kept in the features' dtype); from compact
    # features, [n,H_target] final hidden states until the trainer projects them (see Features).
    target_logits: torch.Tensor
    target_argmax: torch.Tensor  # Long[B,S]
    num_tokens: int  # real tokens in the batch (for throughput)
    # Per row, each example's slots as (start, n_real, end): see adapt.attention.segment_attention.
    segments: list[list[tuple[int, int, int]]] | None = None
    compact: bool = False  # target_logits still holds final hidden states
    seg: torch.Tensor | None = None  # Long[B,S]: example number (-1 padding)
    anchor: torch.Tensor | None = None  # Long[B,S]
    valid_index: torch.Tensor | None = None  # Long[n]: flat indices (into B*S) of the valid slots
    attn_mask_: torch.Tensor | None = None  # Bool[B,S,S] once built (see attn_mask)

    @property
    def attn_mask(self) -> torch.Tensor:
        """Bool[B,S,S] (:func:`adapt.layout.attention_mask` per row), built from the vectors on first use."""
        if self.attn_mask_ is None:
            self.attn_mask_ = batch_attention_mask(self.seg, self.anchor, self.depth)
        return self.attn_mask_

    def project_targets(self, output_rows: torch.Tensor) -> None:
        """Compact batch -> logits over the draft vocabulary (see :func:`project_hidden`)."""
        if self.compact:
            self.target_logits = project_hidden(self.target_logits, output_rows)
            self.compact = False

    def model_inputs(self) -> dict[str, Any]:
        """The drafter's inputs with the dense mask (and the segments): the reference pass."""
        return {**self.drafter_inputs(), "attn_mask": self.attn_mask, "segments": self.segments}

    def drafter_inputs(self) -> dict[str, Any]:
        """The drafter's inputs without a mask: the trainer passes :meth:`attention` instead."""
        return {"input_ids": self.input_ids, "positions": self.positions, "aux_hidden": self.aux_hidden,
                "is_mask": self.is_mask}

    def attention(self, backend: str) -> SlotAttention:
        """This batch's attention with ``backend``, its mask built once for every layer."""
        return SlotAttention(backend, self.seg, self.anchor, self.depth, self.segments)

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> "Batch":
        mv = lambda t: None if t is None else (t.to(device, dtype=dtype) if t.is_floating_point()  # noqa: E731
                                               else t.to(device))
        moved = {f: mv(getattr(self, f)) for f in ("input_ids", "positions", "aux_hidden", "is_mask", "depth",
                                                     "valid", "target_argmax", "seg", "anchor", "valid_index",
                                                     "attn_mask_")}
        # The loss upcasts the target logits itself; an fp32 copy here would be the largest tensor of the step.
        return Batch(**moved, target_logits=self.target_logits.to(device), num_tokens=self.num_tokens,
                     segments=self.segments, compact=self.compact)


_PAD = {"tok": -1, "hid": -1, "pos": 0, "depth": 0, "tgt_row": -1, "tgt_tok": -1, "seg": -1, "anchor": 0}


def collate(rows: Sequence[Sequence[Features]], k: int, ptd_token_id: int, depth_keep: Sequence[float] = (),
            generator: torch.Generator | None = None, *, flat: bool = False, pad_multiple: int = 1,
            device: torch.device | str | None = None) -> Batch:
    """Packed rows of examples -> one padded drafter batch (on ``device``; default: where the features are).

    The slot plan is small integer vectors built on the host from each example's
    cached :class:`adapt.layout.ExampleSlots` (one draw per anchor when depths
    are down-sampled, as :func:`adapt.layout.build_layout` draws); the features
    are gathered where they live, so a step moves nothing per example between
    host and device. ``flat`` puts every example in one row (the ``flex``
    backend's layout); rows are padded to a multiple of ``pad_multiple`` slots.
    """
    feats = [f for row in rows for f in row]
    kinds = {f.target_hidden is not None for f in feats}
    if len(kinds) > 1:
        raise ValueError("a batch mixes compact (target_hidden) and full (target_logits) features")
    if flat:
        rows = [feats]
    src = feats[0].aux_hidden.device
    dev = torch.device(device) if device is not None else src
    # --- the plan, on the host ---
    planned, segments = [], []
    tok_base = row_base = 0
    for row in rows:
        parts: dict[str, list[torch.Tensor]] = {key: [] for key in (*_PAD, "valid")}
        segs, used = [], 0
        for e, f in enumerate(row):
            es = f.slots(k, depth_keep)
            sel = es.select(generator)
            tok, hid, tgt = es.tok_index[sel], es.hid_index[sel], es.tgt_index[sel]
            li = f.logit_index()
            parts["tok"].append(torch.where(tok >= 0, tok + tok_base, tok))
            parts["hid"].append(torch.where(hid >= 0, hid + tok_base, hid))
            parts["pos"].append(es.positions[sel])
            parts["depth"].append(es.depth[sel])
            has_t = tgt >= 0
            row_of = torch.where(has_t, li[tgt.clamp(min=0)], torch.full_like(tgt, -1))
            parts["tgt_row"].append(torch.where(row_of >= 0, row_of + row_base, row_of))
            parts["tgt_tok"].append(torch.where(has_t, tgt + tok_base, tgt))
            parts["valid"].append(es.valid[sel])
            parts["seg"].append(torch.full_like(tok, e))
            parts["anchor"].append(es.anchor[sel])
            n = int(sel.numel())
            segs.append((used, es.n_real, used + n))
            used += n
            tok_base += len(f)
            row_base += f.target_rows.shape[0]
        planned.append({key: torch.cat(v) for key, v in parts.items()})
        segments.append(segs)
    S = max(p["depth"].numel() for p in planned)
    S = -(-S // pad_multiple) * pad_multiple
    plan = {}
    for key in (*_PAD, "valid"):
        fill = _PAD.get(key, False)
        plan[key] = torch.stack([torch.cat([p[key], torch.full((S - p[key].numel(),), fill, dtype=p[key].dtype)])
                                 for p in planned])
    valid = plan["valid"]
    if (valid & (plan["tgt_row"] < 0)).any():
        raise ValueError("a labelled slot's target logits were not kept (logit_rows too narrow)")
    valid_index = valid.flatten().nonzero().squeeze(1)
    label_rows_ = plan["tgt_row"].flatten()[valid_index]
    # --- the features, gathered where they live ---
    idx = torch.stack([plan[key] for key in ("tok", "hid", "tgt_tok")])
    if src.type == "cuda":
        idx, label_rows_ = idx.pin_memory().to(src, non_blocking=True), label_rows_.pin_memory().to(src, non_blocking=True)
    else:
        idx, label_rows_ = idx.to(src), label_rows_.to(src)
    tok, hid, tgt_tok = idx[0], idx[1], idx[2]
    ids_all = torch.cat([f.input_ids.to(src) for f in feats])
    aux_all = torch.cat([f.aux_hidden for f in feats])
    ta_all = torch.cat([f.target_argmax.to(src) for f in feats])
    real = tok >= 0
    input_ids = torch.where(real, ids_all[tok.clamp(min=0)], torch.full_like(tok, ptd_token_id))
    aux = aux_all[hid.clamp(min=0)].masked_fill_(~(hid >= 0)[..., None], 0)
    target_argmax = torch.where(tgt_tok >= 0, ta_all[tgt_tok.clamp(min=0)], torch.full_like(tgt_tok, -1))
    target_rows = torch.cat([f.target_rows for f in feats])[label_rows_]
    mv = (lambda t: t.to(dev, non_blocking=True)) if dev != src else (lambda t: t)  # noqa: E731
    host = (lambda t: t.pin_memory().to(dev, non_blocking=True)) if dev.type == "cuda" else (lambda t: t.to(dev))  # noqa: E731
    return Batch(
        input_ids=mv(input_ids), positions=host(plan["pos"]), aux_hidden=mv(aux), is_mask=mv(~real),
        depth=host(plan["depth"]), valid=host(valid), target_logits=mv(target_rows),
        target_argmax=mv(target_argmax), num_tokens=sum(len(f) for f in feats), segments=segments,
        compact=kinds == {True}, seg=host(plan["seg"]), anchor=host(plan["anchor"]), valid_index=host(valid_index),
    )


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    depth_loss: torch.Tensor  # [K] mean KL per depth (detached)
    depth_acc: torch.Tensor  # [K] top-1 agreement per depth
    depth_count: torch.Tensor  # [K] counted slots per depth


def peagle_loss(logits: torch.Tensor, batch: Batch, d2t: torch.Tensor, depth_weights: Sequence[float],
                k: int) -> LossOutput:
    """Depth-weighted mean KL(target_draft_vocab || drafter) over valid slots.

    ``logits`` cover every slot [B,S,V] or only the valid ones [n,V] (in
    ``batch.valid`` order, as ``forward(..., select=batch.valid)`` returns them).
    ``loss = sum_d w_d * mean_{slots of depth d} KL``; a depth with no valid slot
    in the batch contributes nothing.
    """
    w = list(depth_weights) + [depth_weights[-1] if depth_weights else 1.0] * max(0, k - len(depth_weights))
    if batch.compact:
        raise ValueError("compact batch: project_targets() before the loss")
    # Flat indices where the batch has them: a boolean index makes the host wait for the device to count.
    at = batch.valid if batch.valid_index is None else batch.valid_index
    if logits.dim() == 3:
        logits = take_rows(logits, at)
    depth = take_rows(batch.depth[..., None], at)[:, 0]
    target_argmax = take_rows(batch.target_argmax[..., None], at)[:, 0]
    logq = F.log_softmax(logits.float(), dim=-1)
    logp = F.log_softmax(batch.target_logits.float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [n]
    pred = logits.argmax(-1)
    agree = (pred + d2t[pred]) == target_argmax
    total = logits.new_zeros((), dtype=torch.float32)
    dl, da, dc = [], [], []
    for d in range(1, k + 1):
        sel = depth == d
        n = sel.sum()
        mean = (kl * sel).sum() / n.clamp(min=1)
        total = total + w[d - 1] * mean
        dl.append(mean.detach())
        da.append(((agree & sel).sum() / n.clamp(min=1)).detach().float())
        dc.append(n.detach().float())
    return LossOutput(total, torch.stack(dl), torch.stack(da), torch.stack(dc))
