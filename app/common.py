"""Options and output helpers shared by every `adapt` command."""

from __future__ import annotations

import json
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from settings.config import Config, load_config

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="TOML config merged over the embedded default (or $ADAPT_CONFIG)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object.")]


def command_group(**kwargs: Any) -> typer.Typer:
    """A Typer of this CLI. Rich markup is off: help strings name config sections as ``[section].key``,
    which rich would read as markup and drop."""
    return typer.Typer(rich_markup_mode=None, no_args_is_help=True, **kwargs)


# Whether the running command was given --json (set by get_config, which every command calls first).
_AS_JSON: ContextVar[bool] = ContextVar("as_json", default=False)


def get_config(path: Optional[Path], as_json: bool = False) -> Config:
    """The config the command runs with; also notes ``--json`` so that :func:`fail` answers in JSON."""
    _AS_JSON.set(as_json)
    try:
        return load_config(path)
    except Exception as exc:  # a bad config is a user error, not a traceback
        fail(f"cannot load config: {exc}", 2)


def emit(obj: Any, as_json: bool, human: str | None = None) -> None:
    """Print ``obj`` as JSON, or ``human`` (falling back to indented JSON)."""
    if as_json or human is None:
        sys.stdout.write(json.dumps(obj, indent=None if as_json else 2, default=str, sort_keys=False) + "\n")
    else:
        typer.echo(human)
    sys.stdout.flush()


def fail(message: str, code: int = 1) -> None:
    """Stop the command with ``message``: as ``{"error": ...}`` on stdout under ``--json``, else on stderr."""
    if _AS_JSON.get():
        sys.stdout.write(json.dumps({"error": message, "exit_code": code}) + "\n")
        sys.stdout.flush()
    else:
        typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def progress(msg: str) -> None:
    """A progress line on stderr (stdout stays the command's result)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
