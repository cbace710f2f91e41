"""Options and output helpers shared by every `adapt` command."""

from __future__ import annotations

import json
import os
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from settings.config import Config, load_config

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="TOML config merged over the embedded default (or $ADAPT_CONFIG)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one machine-readable JSON object.")]


ForceOpt = Annotated[bool, typer.Option("--force", help="Replace the output if it exists.")]

# -h as well as --help, on every command (Click passes context settings down to subcommands).
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}
# Set to 1 to see the traceback of an unexpected error instead of its one-line summary.
DEBUG_ENV = "ADAPT_DEBUG"


def command_group(**kwargs: Any) -> typer.Typer:
    """A Typer of this CLI. Rich markup is off: help strings name config sections as ``[section].key``,
    which rich would read as markup and drop."""
    return typer.Typer(rich_markup_mode=None, no_args_is_help=True, context_settings=CONTEXT_SETTINGS, **kwargs)


class RootGroup(TyperGroup):
    """The root command: what a command raises becomes one ``error:`` line (JSON under ``--json``), exit 1.

    Usage errors stay Click's (exit 2, with the usage line); commands end themselves with
    :func:`fail` or ``typer.Exit``. A traceback is for the project's bugs, and only with ``ADAPT_DEBUG=1``."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException, KeyboardInterrupt):  # Click's own (usage errors)
            raise
        except Exception as exc:  # noqa: BLE001 - the user gets a sentence, not a traceback
            if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
                raise
            fail(describe_error(exc))


def error_text(exc: BaseException) -> str:
    """An expected error as a sentence: a missing file as "No such file or directory: PATH", else its message."""
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    return str(exc)


def describe_error(exc: BaseException) -> str:
    """A sentence for an error raised by a command, naming what was tried (the file, the URL)."""
    import httpx

    from headspec.errors import HeadError
    from settings.config import ConfigError

    if isinstance(exc, (HeadError, ConfigError)):
        return str(exc)
    mlflow_errors = sys.modules.get("mlflow.exceptions")  # never imported here: raised only if MLflow was
    if mlflow_errors is not None and isinstance(exc, mlflow_errors.MlflowException):
        return f"MLflow: {exc}"
    if isinstance(exc, OSError) and exc.filename is not None:
        return error_text(exc)
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.request.method} {exc.request.url} answered {exc.response.status_code}: {exc.response.text[:300]}"
    if isinstance(exc, httpx.RequestError):
        try:
            url = str(exc.request.url)
        except RuntimeError:  # raised without its request
            url = "the server"
        return f"nothing answers at {url} ({type(exc).__name__}: {exc})"
    return (f"{type(exc).__name__}: {exc} (this is unexpected: {DEBUG_ENV}=1 prints the traceback; "
            "please report it)")


# Whether the running command was given --json (set by get_config, which every command calls first).
_AS_JSON: ContextVar[bool] = ContextVar("as_json", default=False)


def get_config(path: Optional[Path], as_json: bool = False) -> Config:
    """The config the command runs with; also notes ``--json`` so that :func:`fail` answers in JSON.

    Commands call it first, before their heavy imports: a bad config is refused at once."""
    _AS_JSON.set(as_json)
    try:
        return load_config(path)
    except Exception as exc:  # a bad config is a user error, not a traceback
        fail(f"cannot load config: {exc}", 2)


def answer_soon() -> None:
    """For a command a person waits on: an MLflow server that does not answer fails in seconds (2 retries,
    30 s a request) instead of MLflow's default of minutes of retries. Variables already set win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


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
