"""Test configs: the one builder the tests use (a support module: test modules import it, never each other)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from settings.config import Config, load_config

# A few-step CPU training run of a small head: seconds on the tiny target.
TINY_TRAINING = {"max_steps": 6, "batch_tokens": 320, "max_seq_len": 160, "warmup_steps": 2, "learning_rate": 2e-3,
                 "checkpoint_steps": 3, "replay_ratio": 0.3}


def merged(base: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A copy of the overrides ``base`` with each keyword applied: a dict is merged key by key into that
    section, anything else (a path is written as a string) sets the top-level key."""
    out = copy.deepcopy(base)
    for key, value in sections.items():
        if isinstance(value, dict):
            out.setdefault(key, {}).update(value)
        else:
            out[key] = str(value) if isinstance(value, Path) else value
    return out


def config_overrides(tmp: Path, **sections: Any) -> dict[str, Any]:
    """Overrides for ``load_config``: the state directory ``tmp/state`` (``state_dir=`` names another),
    then the sections as :func:`merged` applies them."""
    return merged({"state_dir": str(Path(tmp) / "state")}, **sections)


def make_cfg(tmp: Path, **sections: Any) -> Config:
    """The typed config of :func:`config_overrides` (defaults for everything not named)."""
    return load_config(overrides=config_overrides(tmp, **sections))


def tiny_training(model: Path, *, base: dict[str, Any] = TINY_TRAINING, head: dict[str, Any] | None = None,
                  **training: Any) -> dict[str, dict[str, Any]]:
    """The sections of a training run of ``base`` (:data:`TINY_TRAINING` unless named; ``training``
    overrides it) of a head with a 256-token draft vocabulary (``head`` overrides that section) for the
    target ``model``: ``make_cfg(tmp, **tiny_training(model, max_steps=2))``."""
    return {"target": {"model": str(model)}, "head": {"draft_vocab_size": 256, **(head or {})},
            "training": {**base, **training}}
