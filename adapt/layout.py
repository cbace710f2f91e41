"""The packed P-EAGLE training layout: which slots exist and who attends to whom.

It reproduces what vLLM 0.32 feeds the drafter at a decode step, for every
anchor of a sequence at once. For a sequence x_0..x_{N-1} with target aux
hidden states h_0..h_{N-1}:

* real slot i (0 <= i <= N-2): token x_{i+1}, hidden h_i, position i, depth 1;
  it predicts x_{i+2}, whose target distribution is the target's at position i+1.
* mask slot (anchor i, depth d >= 2): ptd token, ``mask_hidden``, position
  i+d-1; it predicts x_{i+d+1} (target distribution at position i+d).

Attention (True = may attend), within one sequence only: a slot of anchor i
sees every real slot of anchor <= i (the drafter KV cache vLLM holds for the
accepted context) and the mask slots of its own chain up to its own depth
(the earlier drafts of the same forward pass). Real slots are thus plainly causal.

Depth down-sampling keeps the chain of an anchor up to a random depth: anchor i
keeps depth d when ``u_i < depth_keep[d-2]`` (u_i uniform, fractions
non-increasing), so kept chains are always contiguous, as at inference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Layout:
    """Slots of one packed row (S slots). Indices refer to the row's concatenated tokens."""

    tok_index: torch.Tensor  # Long[S]: token index for real slots, -1 for mask/padding slots
    hid_index: torch.Tensor  # Long[S]: aux hidden index for real slots, -1 otherwise
    positions: torch.Tensor  # Long[S]
    depth: torch.Tensor  # Long[S]: 1..K, 0 for padding
    tgt_index: torch.Tensor  # Long[S]: row index whose target distribution is the label (-1: none)
    valid: torch.Tensor  # Bool[S]: the slot's label exists and is an assistant token
    seg: torch.Tensor  # Long[S]: example number within the row (-1 padding)
    anchor: torch.Tensor  # Long[S]: anchor position i within its example
    attn_mask: torch.Tensor  # Bool[S,S]

    @property
    def num_slots(self) -> int:
        return int(self.depth.numel())


def check_depth_keep(depth_keep: Sequence[float], k: int) -> list[float]:
    """Per-depth keep fractions for depths 2..K (empty = keep all); validated."""
    keep = [float(x) for x in depth_keep] or [1.0] * (k - 1)
    if len(keep) < k - 1:
        keep = keep + [keep[-1]] * (k - 1 - len(keep))
    keep = keep[: k - 1]
    if any(not 0.0 <= x <= 1.0 for x in keep) or any(b > a for a, b in zip(keep, keep[1:])):
        raise ValueError(f"depth_keep must be non-increasing fractions in [0, 1], got {depth_keep}")
    return keep


def chain_depths(loss_mask: torch.Tensor, k: int, depth_keep: Sequence[float] = (),
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Deepest mask-slot depth for each anchor 0..N-2 (1 = no mask slots).

    A chain stops where the sequence ends, where down-sampling drops it, and
    after its last depth whose label is an assistant token (deeper slots would
    only cost compute).
    """
    n = int(loss_mask.numel())
    keep = check_depth_keep(depth_keep, k)
    anchors = torch.arange(max(n - 1, 0))
    # Draw only when sampling, so runs without down-sampling consume no randomness.
    sampling = any(x < 1.0 for x in keep)
    u = torch.rand(anchors.numel(), generator=generator) if sampling else torch.zeros(anchors.numel())
    best = torch.ones(anchors.numel(), dtype=torch.long)
    alive = torch.ones(anchors.numel(), dtype=torch.bool)
    for d in range(2, k + 1):
        label = anchors + d + 1
        alive &= (label <= n - 1) & (u < keep[d - 2])
        has_label = torch.zeros_like(alive)
        has_label[alive] = loss_mask[label[alive]]
        best = torch.where(alive & has_label, torch.full_like(best, d), best)
    return best


def build_layout(loss_masks: Sequence[torch.Tensor], k: int, depth_keep: Sequence[float] = (),
                 generator: torch.Generator | None = None, pad_to: int | None = None) -> Layout:
    """Slots and attention for one row packing the given examples (by their loss masks)."""
    tok, hid, pos, dep, tgt, val, seg, anc = ([] for _ in range(8))
    offset = 0
    for e, lm in enumerate(loss_masks):
        n = int(lm.numel())
        i = torch.arange(n - 1)
        # Real slots.
        tok.append(offset + i + 1)
        hid.append(offset + i)
        pos.append(i)
        dep.append(torch.ones_like(i))
        tgt.append(offset + i + 1)
        lab = i + 2
        val.append(torch.where(lab <= n - 1, lm[lab.clamp(max=n - 1)], torch.zeros_like(lab, dtype=torch.bool)))
        seg.append(torch.full_like(i, e))
        anc.append(i)
        # Mask slots, chain by chain (anchor-major so a chain is contiguous).
        deepest = chain_depths(lm, k, depth_keep, generator)
        reps = (deepest - 1).clamp(min=0)
        a = torch.repeat_interleave(i, reps)
        # Depth within the chain: 2..deepest for each anchor.
        starts = torch.cumsum(reps, 0) - reps
        d = torch.arange(a.numel()) - torch.repeat_interleave(starts, reps) + 2
        tok.append(torch.full_like(a, -1))
        hid.append(torch.full_like(a, -1))
        pos.append(a + d - 1)
        dep.append(d)
        tgt.append(offset + a + d)
        val.append(lm[(a + d + 1).clamp(max=n - 1)] & (a + d + 1 <= n - 1))
        seg.append(torch.full_like(a, e))
        anc.append(a)
        offset += n
    cat = (lambda xs, dt=torch.long: torch.cat(xs).to(dt) if xs else torch.zeros(0, dtype=dt))
    lay = Layout(cat(tok), cat(hid), cat(pos), cat(dep), cat(tgt), cat(val, torch.bool), cat(seg), cat(anc),
                 torch.zeros(0, 0, dtype=torch.bool))
    lay.attn_mask = attention_mask(lay.seg, lay.anchor, lay.depth)
    return pad_layout(lay, pad_to) if pad_to is not None else lay


def pad_layout(lay: Layout, size: int) -> Layout:
    """Pad to ``size`` slots; padding slots attend only to themselves and carry no loss."""
    p = size - lay.num_slots
    if p <= 0:
        return lay
    ext = lambda t, v: torch.cat([t, torch.full((p,), v, dtype=t.dtype)])  # noqa: E731
    seg, anchor, depth = ext(lay.seg, -1), ext(lay.anchor, 0), ext(lay.depth, 0)
    return Layout(ext(lay.tok_index, -1), ext(lay.hid_index, -1), ext(lay.positions, 0), depth,
                  ext(lay.tgt_index, -1), ext(lay.valid, False), seg, anchor, attention_mask(seg, anchor, depth))


def attention_mask(seg: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Bool[S,S], True where query slot (row) may attend key slot (column)."""
    same = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    key_real = (depth == 1)[None, :]
    real_ok = key_real & (anchor[None, :] <= anchor[:, None])
    chain_ok = (depth[None, :] >= 2) & (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None])
    m = same & (real_ok | chain_ok)
    # Padding slots see only themselves, so softmax never runs over an empty row.
    pad = (seg < 0).nonzero().squeeze(1)
    m[pad, pad] = True
    return m


# --- the per-example plan the trainer builds once --------------------------------------

@dataclass
class ExampleSlots:
    """One example's slots with every chain at its deepest labelled depth, built once per example.

    Indices are local to the example (its tokens 0..n-1). Depth down-sampling
    only removes slots from this set: a mask slot is kept for a draw ``u`` of its
    anchor when ``u < threshold``, where the threshold is the keep fraction of
    the shallowest labelled depth at or below it in its chain. That is exactly
    :func:`chain_depths`' rule (a chain stops after its last labelled depth it
    reaches), so a step draws one number per anchor, as :func:`build_layout`
    does, and selects instead of rebuilding.
    """

    n: int
    tok_index: torch.Tensor  # Long[s]
    hid_index: torch.Tensor  # Long[s]
    positions: torch.Tensor  # Long[s]
    depth: torch.Tensor  # Long[s]
    tgt_index: torch.Tensor  # Long[s]
    valid: torch.Tensor  # Bool[s]
    anchor: torch.Tensor  # Long[s]
    threshold: torch.Tensor  # Float[s]: kept when the anchor's draw is below it (real slots: always)
    sampling: bool  # whether a step draws (depth_keep has a fraction below 1)

    @property
    def n_real(self) -> int:
        return self.n - 1

    def select(self, generator: torch.Generator | None) -> torch.Tensor:
        """Long[s'] of the slots this step keeps (real slots first), drawing as :func:`chain_depths` does."""
        if not self.sampling:
            return torch.arange(self.tok_index.numel())
        u = torch.rand(self.n_real, generator=generator)
        keep = torch.ones(self.tok_index.numel(), dtype=torch.bool)
        mask = slice(self.n_real, None)
        keep[mask] = u[self.anchor[mask]] < self.threshold[mask]
        return keep.nonzero().squeeze(1)


def example_slots(loss_mask: torch.Tensor, k: int, depth_keep: Sequence[float] = ()) -> ExampleSlots:
    """The :class:`ExampleSlots` of one example (by its loss mask)."""
    keep = check_depth_keep(depth_keep, k)
    full = build_layout([loss_mask], k)  # every chain at its deepest labelled depth
    n = int(loss_mask.numel())
    depth, anchor = full.depth, full.anchor
    # Label depth of each mask slot: the shallowest labelled depth >= its own in its chain.
    label_depth = depth.clone()
    labelled = full.valid | (depth == 1)
    nxt = torch.full((n,), k + 1, dtype=torch.long)  # per anchor, while walking depths down
    for d in range(k, 1, -1):
        at = (depth == d).nonzero().squeeze(1)
        a = anchor[at]
        nxt[a] = torch.where(labelled[at], torch.full_like(a, d), nxt[a])
        label_depth[at] = nxt[a]
    fractions = torch.tensor([2.0, 2.0] + keep, dtype=torch.float32)  # index by depth: 0, 1 unused
    threshold = torch.where(depth >= 2, fractions[label_depth.clamp(max=k)], torch.full_like(depth, 2, dtype=torch.float32))
    return ExampleSlots(n, full.tok_index, full.hid_index, full.positions, depth, full.tgt_index, full.valid,
                        anchor, threshold, any(x < 1.0 for x in keep))


def batch_attention_mask(seg: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """:func:`attention_mask` for a batch of rows: Bool[B,S,S] from Long[B,S] vectors, built where they live."""
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    a_q, a_k = anchor[:, :, None], anchor[:, None, :]
    d_q, d_k = depth[:, :, None], depth[:, None, :]
    m = same & (((d_k == 1) & (a_k <= a_q)) | ((d_k >= 2) & (a_k == a_q) & (d_k <= d_q)))
    pad = (seg < 0)
    eye = torch.eye(seg.shape[1], dtype=torch.bool, device=seg.device)[None]
    return m | (pad[:, :, None] & eye)
