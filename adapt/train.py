"""Train a head: the one call the CLI, the nightly cycle and the benchmarks make.

:func:`train` runs :class:`adapt.recipe.TrainRecipe` through its phases (setup,
train, save, cleanup); the recipe's module says what each phase does.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adapt.initial_head import ShapeChangeError
from adapt.recipe import AfterExport, TrainRecipe, TrainResult
from settings.config import Config

__all__ = ["ShapeChangeError", "TrainResult", "train"]


def train(
    cfg: Config,
    conversations: Sequence[dict[str, Any]],
    base_head: str | None,
    out_dir: str | Path,
    replay_conversations: Sequence[dict[str, Any]] | None = None,
    *,
    target_dir: str | Path | None = None,
    run_dir: str | Path | None = None,
    progress: bool = True,
    after_export: AfterExport | None = None,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Fine-tune (``base_head``: a directory, S3 or MLflow URI) or bootstrap (None) a head on
    ``conversations`` plus a replayed share of ``replay_conversations``; export it to ``out_dir``.

    ``run_dir`` (default: ``<out_dir>.run``) keeps the resumable checkpoint; a
    run with the same config, data and parent resumes from it. ``stop_after_steps``
    interrupts the loop early (after checkpointing) without counting as the end of
    the schedule, which is what resuming is for. ``after_export`` runs on rank 0
    with the exported head and the loaded target; its result is the ``acceptance``.
    """
    recipe = TrainRecipe(cfg, out_dir, target_dir=target_dir, run_dir=run_dir, progress=progress,
                         stop_after_steps=stop_after_steps)
    try:
        recipe.setup(conversations, base_head, replay_conversations)
        recipe.train()
        recipe.save(after_export)
    finally:
        recipe.cleanup()
    return recipe.result()
