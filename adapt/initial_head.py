"""The head a run starts from: a warm start from an existing head, or a bootstrap from the target.

A warm start keeps the head's shape (so the result still hot-swaps into the
serving replicas) and re-picks its draft vocabulary for the new traffic; a
bootstrap builds a fresh head whose draft vocabulary is the data's most
frequent assistant tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapt.checkpoint import init_output_from_target, load_head, new_head, target_output_layer
from adapt.data import Example, build_draft_vocab, token_counts
from adapt.drafter import PEagleDrafter
from headspec.config import DrafterConfig, shape_differences
from headspec.resolve import resolve_head
from headspec.validate import validate_head
from settings.config import Config, HeadConfig, MlflowConfig, S3Config


class ShapeChangeError(ValueError):
    """The configured head shape differs from the warm-start head's."""


@dataclass
class InitialHead:
    model: PEagleDrafter
    parent_sha: str | None  # the warm-start head's weights (None for a bootstrap)
    vocab_refresh: dict[str, Any] | None  # what :func:`refresh_draft_vocab` changed, when it ran


def initial_head(cfg: Config, target_dir: Path, base_head: str | None, examples: Sequence[Example],
                 eos_id: int | None) -> InitialHead:
    """Warm start from ``base_head`` (shape checked against ``[head]``), else bootstrap one for ``examples``."""
    if not base_head:
        return InitialHead(bootstrap_head(cfg.head, cfg.training.seed, target_dir, examples, eos_id), None, None)
    head_dir = resolve_base(base_head, cfg.head, cfg.mlflow, cfg.s3)
    info = validate_head(head_dir, target_dir)
    model, _ = load_head(head_dir)
    check_same_shape(model.config, configured_head(cfg.head, target_dir))
    refresh = None
    if cfg.training.refresh_draft_vocab:
        refresh = refresh_draft_vocab(model, examples, eos_id, target_output_layer(target_dir)[1])
    return InitialHead(model, info.sha256, refresh)


def resolve_base(base: str, head: HeadConfig, mlflow: MlflowConfig, s3: S3Config) -> Path:
    """A head directory for ``base``: a local directory, an S3 URI or an MLflow ``models:/`` / ``runs:/`` URI
    (downloaded under ``[head].heads_dir/downloaded`` from ``[mlflow].tracking_uri``)."""
    path, _ = resolve_head(base, Path(head.heads_dir) / "downloaded", mlflow.tracking_uri, s3.client_kwargs())
    if not path.is_dir():
        raise FileNotFoundError(f"base head {base!r} is neither a directory nor an MLflow model URI")
    return path


def configured_head(head: HeadConfig, target_dir: Path) -> DrafterConfig:
    return DrafterConfig.from_target(target_dir, head.num_speculative_tokens, head.draft_vocab_size,
                                     head.aux_layer_ids or None, head.num_layers)


# What ``[head]`` and the target decide about a head's shape. The drafter's inner sizes
# (hidden/intermediate size, attention heads, head_dim) and its mask token are the base
# head's own: an imported head (a published P-EAGLE head) need not have the target's
# sizes, and a warm start keeps whatever it has.
CONFIGURED_SHAPE_FIELDS = ("num_hidden_layers", "draft_vocab_size", "aux_layer_ids", "num_speculative_tokens",
                           "vocab_size", "target_hidden_size")


def check_same_shape(head: DrafterConfig, want: DrafterConfig) -> None:
    """Warm start never changes a head's shape: what an in-place swap needs equal (:func:`shape_differences`)
    and the configuration decides (:data:`CONFIGURED_SHAPE_FIELDS`) must be what ``[head]`` asks."""
    diffs = [f"{f}: head has {a}, config asks {b}" for f, (a, b) in shape_differences(head, want).items()
             if f in CONFIGURED_SHAPE_FIELDS]
    if diffs:
        raise ShapeChangeError("warm start cannot change the head's shape (" + "; ".join(diffs)
                               + "); bootstrap a new head (no --base) instead")


def bootstrap_head(head: HeadConfig, seed: int, target_dir: Path, examples: Sequence[Example],
                   eos_id: int | None) -> PEagleDrafter:
    """A fresh head whose draft vocabulary is the most frequent assistant tokens.

    Its final norm and ``lm_head`` start from the target's (the draft vocabulary's
    rows), which after drifted-traffic adaptation accepted more than randomly
    initialised ones at equal steps.
    """
    want = configured_head(head, target_dir)
    model = new_head(target_dir, want.num_speculative_tokens, want.draft_vocab_size,
                     want.aux_layer_ids, want.num_layers, seed=seed)
    counts = token_counts(examples, want.vocab_size)
    specials = [eos_id] if eos_id is not None else []
    d2t, _ = build_draft_vocab(counts, want.draft_vocab_size, special_ids=specials)
    model.set_draft_vocab(d2t + torch.arange(d2t.numel()))
    init_output_from_target(model, target_dir)
    return model


def refresh_draft_vocab(model: PEagleDrafter, examples: Sequence[Example], eos_id: int | None,
                        output_rows: torch.Tensor | None = None) -> dict[str, Any]:
    """Re-pick the draft vocabulary of a warm-started head for ``examples`` (same size).

    Ranked by frequency in the new data (replay included); at equal counts a token
    already in the vocabulary keeps its slot, so a refresh only moves what the
    data asks for; tokens new to it start from ``output_rows`` (the target's output
    embedding) when given. Returns coverage of the tokens to predict before and after.
    """
    cfg = model.config
    counts = token_counts(examples, cfg.vocab_size)
    held = model.t2d.cpu().bool()
    specials = [eos_id] if eos_id is not None else []
    # Doubling counts then adding 1 for held tokens breaks ties towards the current vocabulary.
    d2t, t2d = build_draft_vocab(counts * 2 + held.long(), cfg.draft_vocab_size, special_ids=specials)
    total = max(int(counts.sum()), 1)
    before = int(counts[held].sum()) / total
    added = model.remap_draft_vocab(d2t + torch.arange(d2t.numel()), output_rows)
    return {"added_tokens": added, "coverage_before": round(before, 4),
            "coverage_after": round(int(counts[t2d].sum()) / total, 4)}
