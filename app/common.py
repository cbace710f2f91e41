"""Options and output helpers shared by every `adapt` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from settings.config import Config, load_config

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="TOML config merged over the embedded default (or $ADAPT_CONFIG)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object.")]


def get_config(path: Optional[Path]) -> Config:
    try:
        return load_config(path)
    except Exception as exc:  # a bad config is a user error, not a traceback
        typer.echo(f"error: cannot load config: {exc}", err=True)
        raise typer.Exit(2) from exc


def emit(obj: Any, as_json: bool, human: str | None = None) -> None:
    """Print ``obj`` as JSON, or ``human`` (falling back to indented JSON)."""
    if as_json or human is None:
        sys.stdout.write(json.dumps(obj, indent=None if as_json else 2, default=str, sort_keys=False) + "\n")
    else:
        typer.echo(human)
    sys.stdout.flush()


def fail(message: str, code: int = 1) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
