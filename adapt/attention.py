"""How the slots of a packed P-EAGLE batch attend to each other: one call per layer, several backends.

The rule is :func:`adapt.layout.attention_mask`'s: within one example, real
slots are causal, a mask slot sees the real slots up to its anchor and its own
chain up to its depth, nothing crosses examples and a padding slot sees only
itself. Three backends compute it:

``flex``     FlexAttention with a ``BlockMask`` whose ``mask_mod`` reads the
             batch's ``seg``/``anchor``/``depth`` vectors, so whole blocks
             between examples are skipped and the S x S mask never exists;
             compiled on CUDA. The batch is one flat row (examples never
             attend across each other, so rows are only a dense mask's need).
             torch has no FlexAttention backward on CPU, so it trains on CUDA.
``sdpa``     one ``scaled_dot_product_attention`` call per layer with the dense
             Bool[B,S,S] mask, built on the device from the same vectors.
``segment``  the reference: example by example, two SDPA calls each
             (:func:`adapt.drafter.segment_attention`); no cross-example pair
             is computed, but it is a Python loop of small kernels.

Which one is fastest depends on the device and the batch shape, so ``auto``
(``[training] attention``) times them on the run's first batch
(:func:`pick_backend`) instead of assuming.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from adapt.layout import batch_attention_mask

BACKENDS = ("flex", "sdpa", "segment")
FLEX_BLOCK = 128  # FlexAttention's block: a flat batch is padded to a multiple of it


@dataclass(frozen=True)
class BackendShape:
    """How :func:`adapt.loss.collate` lays a batch out for a backend."""

    flat: bool  # every example in one row
    pad_multiple: int  # slots per row rounded up to this


SHAPES = {"flex": BackendShape(True, FLEX_BLOCK), "sdpa": BackendShape(False, 1), "segment": BackendShape(False, 1)}


def unavailable_reason(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot train on ``device`` (None: it can)."""
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}: one of {', '.join(BACKENDS)} or auto"
    if backend == "flex" and device.type != "cuda":
        return (f"FlexAttention has no backward pass on {device.type} in torch {torch.__version__}; "
                "it trains on CUDA (use auto, sdpa or segment here)")
    return None


def candidates(device: torch.device) -> list[str]:
    """The backends ``auto`` measures on ``device``, in the order that breaks a tie."""
    return [b for b in BACKENDS if unavailable_reason(b, device) is None]


def take_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[B,N,...] -> [n,...]: the slots where ``keep`` (Bool[B,N]) holds, or at ``keep`` (Long[n], flat
    indices into B*N: what the trainer passes, since a boolean index waits for the device to count)."""
    if keep.dtype == torch.bool:
        return x[keep]
    return x.flatten(0, 1).index_select(0, keep)


# --- one backend, prepared for one batch -------------------------------------------------

_compiled: dict[str, Any] = {}


def _flex_fn(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(flex_attention, create_block_mask), compiled on CUDA (eager FlexAttention materializes every score)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if device.type != "cuda":
        return flex_attention, create_block_mask
    if "flex" not in _compiled:
        _compiled["flex"] = torch.compile(flex_attention)
    return _compiled["flex"], create_block_mask


class SlotAttention:
    """One batch's attention: the backend and its mask, built once and used by every layer.

    Called with q [B,H,S,D] and k, v [B,Hkv,S,D]; returns [B,H,S,D].
    """

    def __init__(self, backend: str, seg: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor,
                 segments: list[list[tuple[int, int, int]]] | None = None,
                 dense: torch.Tensor | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(unavailable_reason(backend, seg.device))
        if backend == "segment" and segments is None:
            raise ValueError("the segment backend needs the batch's segments")
        self.backend, self.segments = backend, segments
        self.seg, self.anchor, self.depth = seg, anchor, depth
        self._dense = dense
        self.block_mask = self._block_mask() if backend == "flex" else None

    @classmethod
    def from_dense(cls, attn_mask: torch.Tensor, segments: list[list[tuple[int, int, int]]] | None = None
                   ) -> "SlotAttention":
        """An explicit Bool[B,S,S] mask (any rule): SDPA with it, or the segment loop where ``segments`` are given."""
        obj = cls.__new__(cls)
        obj.backend = "sdpa" if segments is None else "segment"
        obj.segments, obj._dense, obj.block_mask = segments, attn_mask, None
        obj.seg = obj.anchor = obj.depth = None
        return obj

    @property
    def dense(self) -> torch.Tensor:
        """Bool[B,S,S], built on the vectors' device the first time something needs it."""
        if self._dense is None:
            self._dense = batch_attention_mask(self.seg, self.anchor, self.depth)
        return self._dense

    def _block_mask(self) -> Any:
        seg, anchor, depth = self.seg, self.anchor, self.depth
        B, S = seg.shape

        def mask_mod(b, h, q, kv):
            sq, sk = seg[b, q], seg[b, kv]
            aq, ak = anchor[b, q], anchor[b, kv]
            dq, dk = depth[b, q], depth[b, kv]
            real = (dk == 1) & (ak <= aq)
            chain = (dk >= 2) & (ak == aq) & (dk <= dq)
            return ((sq == sk) & (sq >= 0) & (real | chain)) | ((sq < 0) & (q == kv))

        _, create_block_mask = _flex_fn(seg.device)
        return create_block_mask(mask_mod, B, None, S, S, device=seg.device, BLOCK_SIZE=FLEX_BLOCK,
                                 _compile=seg.device.type == "cuda")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend == "flex":
            flex, _ = _flex_fn(q.device)
            # Under autocast the projections are bf16 but rope's product is not: one dtype for the kernel.
            dt = v.dtype
            return flex(q.to(dt), k.to(dt), v, block_mask=self.block_mask, enable_gqa=k.shape[1] != q.shape[1])
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.backend == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense[:, None])
        vectors = None if self._dense is not None else (self.seg, self.anchor, self.depth)
        return segment_attention(q, k, v, self._dense, self.segments, vectors)


def segment_attention(q, k, v, attn_mask, segments, vectors=None) -> torch.Tensor:
    """Attention of a packed training row, example by example; equal to the dense masked pass.

    ``segments[b]`` lists each example of row ``b`` as ``(start, n_real, end)``:
    slots ``start..start+n_real`` are its real slots, which attend causally among
    themselves only, and the rest up to ``end`` its mask slots (masked by
    ``attn_mask``, or by the rule over ``vectors`` = (seg, anchor, depth) Long[B,S]
    without it). Examples never attend across each other, yet the dense S x S
    pass computes every such pair; this skips them and runs the real slots as
    plain causal attention. Slots after the last example (padding) get zeros.
    """
    rows = []
    N = q.shape[2]
    for b, segs in enumerate(segments):
        qb, kb, vb = q[b:b + 1], k[b:b + 1], v[b:b + 1]
        parts, used = [], 0
        for start, n_real, end in segs:
            if start != used:
                raise ValueError("segments must tile the row from slot 0 in order")
            mid = start + n_real
            if n_real:
                parts.append(F.scaled_dot_product_attention(qb[:, :, start:mid], kb[:, :, start:mid],
                                                            vb[:, :, start:mid], is_causal=True))
            if end > mid:
                if attn_mask is not None:
                    m = attn_mask[b:b + 1, None, mid:end, start:end]
                else:
                    m = batch_attention_mask(*(t[b:b + 1, start:end] for t in vectors))[:, None, n_real:]
                parts.append(F.scaled_dot_product_attention(qb[:, :, mid:end], kb[:, :, start:end],
                                                            vb[:, :, start:end], attn_mask=m))
            used = end
        if used < N:
            parts.append(qb.new_zeros(1, qb.shape[1], N - used, qb.shape[3]))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0)


# --- auto: measure, then pick ------------------------------------------------------------

@dataclass
class Pick:
    """What ``auto`` chose and what it measured (milliseconds per forward + backward)."""

    backend: str
    measured: dict[str, list[float]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # backend -> why it was not timed to the end
    how: str = "measured"  # measured | configured | cached | resumed

    def to_json(self) -> dict[str, Any]:
        """The pick, every timing, each backend's median, and whether the timings separate the winner
        from the rest (its slowest run faster than every other backend's fastest): the pick's own noise."""
        out = asdict(self)
        out["median_ms"] = {b: round(statistics.median(t), 3) for b, t in self.measured.items() if t}
        won = self.measured.get(self.backend)
        others = [min(t) for b, t in self.measured.items() if t and b != self.backend]
        out["clear_win"] = bool(won and others and max(won) < min(others))
        return out


_picks: dict[tuple, Pick] = {}


def _stored_pick(store: Path | None, key: tuple) -> Pick | None:
    try:
        got = json.loads(store.read_text()).get(json.dumps(list(key))) if store is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(got, dict) or not isinstance(got.get("backend"), str):
        return None
    return Pick(got["backend"], got.get("measured") or {}, got.get("skipped") or {}, "cached")


def _store_pick(store: Path, key: tuple, pick: Pick) -> None:
    """Add ``pick`` to the JSON file of picks (written whole and renamed: a reader never sees half of it)."""
    try:
        picks = json.loads(store.read_text())
        picks = picks if isinstance(picks, dict) else {}
    except (OSError, ValueError):
        picks = {}
    picks[json.dumps(list(key))] = {"backend": pick.backend, "measured": pick.measured, "skipped": pick.skipped}
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_name(f".{store.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(picks, indent=1))
        os.replace(tmp, store)
    except OSError:
        pass  # a read-only cache only costs the next run its timing


def pick_backend(names: Sequence[str], run: Callable[[str, int], None], sync: Callable[[], None],
                 key: tuple | None = None, reps: int = 3, warmups: int = 1, store: Path | None = None) -> Pick:
    """Time ``run(name, i)`` (one forward + backward on the run's ``i``-th batch) for each backend; the
    one fastest batch by batch wins (the median of its time over the fastest's on each batch).

    Each backend first runs ``warmups`` batches untimed (kernel selection, compilation:
    a compiled kernel compiles again once shapes vary, so a CUDA pick warms up on
    several), then ``reps`` timed runs on further batches, interleaved across backends
    so a drifting machine biases none. The batches differ, as training's do: a backend
    that pays for every new batch shape (a plan built per shape) pays for it here too.
    A backend whose timed run already took over twice the best median so far cannot
    win and stops early. A tie goes to the earlier name. ``key`` caches the pick for
    the process (same device and batch shape, same answer) and, with ``store`` (a JSON file), for later
    processes too: each cycle's training is a process of its own, and timing the backends costs a
    CPU trainer about as many seconds as a dozen steps.
    """
    if key is not None and key in _picks:
        cached = _picks[key]
        return Pick(cached.backend, cached.measured, cached.skipped, "cached")
    if key is not None and (stored := _stored_pick(store, key)) is not None:
        _picks[key] = stored
        return stored
    times: dict[str, list[float]] = {n: [] for n in names}
    skipped: dict[str, str] = {}
    for n in names:
        try:
            for w in range(warmups):
                run(n, w)
            sync()
        except Exception as e:  # a backend that cannot run this batch here is not a candidate
            skipped[n] = f"{type(e).__name__}: {e}"[:300]
    live = [n for n in names if n not in skipped]
    if not live:
        raise RuntimeError(f"no attention backend could run: {skipped}")
    for r in range(reps):
        for n in (live if r % 2 == 0 else list(reversed(live))):
            if n in skipped:
                continue
            t0 = time.perf_counter()
            run(n, warmups + r)
            sync()
            times[n].append((time.perf_counter() - t0) * 1000)
            best = min(statistics.median(t) for t in times.values() if t)
            if times[n][-1] > 2 * best and len(live) > 1:
                skipped[n] = f"over twice the fastest ({times[n][-1]:.1f} ms against {best:.1f} ms)"
    # Batch by batch: each backend's time over the fastest's on the same batch, its median the score. The
    # batches differ in shape (and a busy machine in load): medians of unpaired times can favour the backend
    # that drew the cheap batch, where the one faster on most batches is the one training wants.
    timed = [n for n, t in times.items() if len(t) == reps]  # the others stopped early: over twice the best
    if timed:
        fastest = [min(times[n][r] for n in timed) for r in range(reps)]
        ranked = sorted((statistics.median(times[n][r] / fastest[r] for r in range(reps)), names.index(n), n)
                        for n in timed)
    else:
        ranked = sorted((statistics.median(t), names.index(n), n) for n, t in times.items() if t)
    pick = Pick(ranked[0][2], {n: [round(x, 3) for x in t] for n, t in times.items() if t}, skipped)
    if key is not None:
        _picks[key] = pick
        if store is not None:
            _store_pick(store, key, pick)
    return pick
