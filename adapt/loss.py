"""P-EAGLE batch assembly and loss.

:func:`collate` turns packed rows of featurized examples into drafter inputs
following :mod:`adapt.layout`; :func:`peagle_loss` is the per-depth
KL(target restricted to the draft vocabulary || drafter), weighted by depth,
with per-depth top-1 agreement (drafter argmax == target argmax) for logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from adapt.layout import Layout, build_layout, pad_layout


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
        """Long[N]: row of ``target_logits`` for each position, -1 where not kept."""
        if self.logit_rows is None:
            return torch.arange(len(self))
        idx = torch.full((len(self),), -1, dtype=torch.long)
        idx[self.logit_rows] = torch.arange(self.logit_rows.numel())
        return idx


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
    attn_mask: torch.Tensor  # Bool[B,S,S]
    depth: torch.Tensor  # Long[B,S], 0 = padding
    valid: torch.Tensor  # Bool[B,S]
    # [n,Vd]: the valid slots' rows, in ``valid`` order (kept in the features' dtype); from compact
    # features, [n,H_target] final hidden states until the trainer projects them (see Features).
    target_logits: torch.Tensor
    target_argmax: torch.Tensor  # Long[B,S]
    num_tokens: int  # real tokens in the batch (for throughput)
    # Per row, each example's slots as (start, n_real, end): see adapt.drafter.segment_attention.
    segments: list[list[tuple[int, int, int]]] | None = None
    compact: bool = False  # target_logits still holds final hidden states

    def project_targets(self, output_rows: torch.Tensor) -> None:
        """Compact batch -> logits over the draft vocabulary (see :func:`project_hidden`)."""
        if self.compact:
            self.target_logits = project_hidden(self.target_logits, output_rows)
            self.compact = False

    def model_inputs(self) -> dict[str, Any]:
        return {"input_ids": self.input_ids, "positions": self.positions, "aux_hidden": self.aux_hidden,
                "is_mask": self.is_mask, "attn_mask": self.attn_mask, "segments": self.segments}

    def to(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> "Batch":
        mv = lambda t: t.to(device, dtype=dtype) if t.is_floating_point() else t.to(device)  # noqa: E731
        moved = {f: mv(getattr(self, f)) for f in ("input_ids", "positions", "aux_hidden", "is_mask", "attn_mask",
                                                     "depth", "valid", "target_argmax")}
        # The loss upcasts the target logits itself; an fp32 copy here would be the largest tensor of the step.
        return Batch(**moved, target_logits=self.target_logits.to(device), num_tokens=self.num_tokens,
                     segments=self.segments, compact=self.compact)


def row_segments(lay: Layout) -> list[tuple[int, int, int]]:
    """``(start, n_real, end)`` of each example in a layout (examples are contiguous, real slots first)."""
    segs = []
    seg, real = lay.seg.tolist(), (lay.tok_index >= 0).tolist()
    start = 0
    for i in range(1, len(seg) + 1):
        if i == len(seg) or seg[i] != seg[start]:
            if seg[start] >= 0:
                n_real = sum(real[start:i])
                if not all(real[start:start + n_real]):
                    raise ValueError("an example's real slots must precede its mask slots")
                segs.append((start, n_real, i))
            start = i
    return segs


def collate(rows: Sequence[Sequence[Features]], k: int, ptd_token_id: int, depth_keep: Sequence[float] = (),
            generator: torch.Generator | None = None) -> Batch:
    """Packed rows of examples -> one padded drafter batch."""
    layouts: list[Layout] = [build_layout([f.loss_mask for f in row], k, depth_keep, generator) for row in rows]
    S = max(lay.num_slots for lay in layouts)
    layouts = [pad_layout(lay, S) for lay in layouts]
    kinds = {f.target_hidden is not None for row in rows for f in row}
    if len(kinds) > 1:
        raise ValueError("a batch mixes compact (target_hidden) and full (target_logits) features")
    ids, aux, tl, ta = [], [], [], []
    for row, lay in zip(rows, layouts):
        r_ids = torch.cat([f.input_ids for f in row])
        r_aux = torch.cat([f.aux_hidden for f in row])
        r_tl = torch.cat([f.target_rows for f in row])
        # Each example's logit rows, shifted to where its target rows start in r_tl.
        li, start = [], 0
        for f in row:
            ix = f.logit_index()
            li.append(torch.where(ix >= 0, ix + start, ix))
            start += f.target_rows.shape[0]
        r_li = torch.cat(li)
        r_ta = torch.cat([f.target_argmax for f in row])
        real = lay.tok_index >= 0
        x = torch.full((S,), ptd_token_id, dtype=torch.long)
        x[real] = r_ids[lay.tok_index[real]]
        h = r_aux.new_zeros(S, r_aux.shape[-1])
        h[real] = r_aux[lay.hid_index[real]]
        has_t = lay.tgt_index >= 0
        src = torch.full((S,), -1, dtype=torch.long)
        src[has_t] = r_li[lay.tgt_index[has_t]]
        if (lay.valid & (src < 0)).any():
            raise ValueError("a labelled slot's target logits were not kept (logit_rows too narrow)")
        t = r_tl[src[lay.valid]]
        a = torch.full((S,), -1, dtype=torch.long)
        a[has_t] = r_ta[lay.tgt_index[has_t]]
        ids.append(x), aux.append(h), tl.append(t), ta.append(a)
    return Batch(
        input_ids=torch.stack(ids),
        positions=torch.stack([lay.positions for lay in layouts]),
        aux_hidden=torch.stack(aux),
        is_mask=torch.stack([lay.tok_index < 0 for lay in layouts]),
        attn_mask=torch.stack([lay.attn_mask for lay in layouts]),
        depth=torch.stack([lay.depth for lay in layouts]),
        valid=torch.stack([lay.valid for lay in layouts]),
        target_logits=torch.cat(tl),
        target_argmax=torch.stack(ta),
        num_tokens=sum(len(f) for row in rows for f in row),
        segments=[row_segments(lay) for lay in layouts],
        compact=kinds == {True},
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
    valid = batch.valid
    if logits.dim() == 3:
        logits = logits[valid]
    depth = batch.depth[valid]
    if batch.compact:
        raise ValueError("compact batch: project_targets() before the loss")
    logq = F.log_softmax(logits.float(), dim=-1)
    logp = F.log_softmax(batch.target_logits.float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # [n]
    pred = logits.argmax(-1)
    agree = (pred + d2t[pred]) == batch.target_argmax[valid]
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
