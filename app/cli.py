"""The `adapt` command line. Each module of ``app.commands`` holds its commands at module level and
adds them to the root with ``register(app)``."""

from __future__ import annotations

import importlib
import signal
from typing import Annotated

import typer

from app import __version__
from app.common import ConfigOpt, JsonOpt, RootGroup, command_group, emit, get_config

app = command_group(
    name="adapt",
    help="drafter-adapt: keep a P-EAGLE drafter fast on the traffic your vLLM endpoint serves.",
    cls=RootGroup,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules that contribute commands; each exposes register(app).
COMMAND_MODULES = ["app.commands.doctor", "app.commands.models", "app.commands.capture", "app.commands.serving",
                   "app.commands.train", "app.commands.loop", "app.commands.head", "app.commands.demo"]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"drafter-adapt {__version__}")
        raise typer.Exit()


@app.callback()
def root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                               help="Print the version and exit.")] = False) -> None:
    """drafter-adapt: keep a P-EAGLE drafter fast on the traffic your vLLM endpoint serves."""


@app.command("config")
def show_config(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Print the effective configuration (file, ADAPT__SECTION__KEY variables and defaults merged)."""
    from settings.config import dump_toml

    cfg = get_config(config, json_)
    emit(cfg.to_json(mask_secrets=True), json_, human=dump_toml(cfg, mask_secrets=True))


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def _exit_on_sigterm() -> None:
    """SIGTERM (a container stop, an Airflow task killed, ``timeout``) exits like Ctrl-C does.

    Python's default for SIGTERM ends the process at once, skipping every ``finally``: a demo, a
    cycle's bench or ``adapt bench`` killed that way left its vLLM replicas (own process groups,
    so not signalled with it) running and holding their memory. Raising SystemExit in the main
    thread runs those cleanups; a second SIGTERM ends the process at once, as before."""

    def handler(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise SystemExit(128 + signum)

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, handler)


def main() -> None:
    _exit_on_sigterm()  # commands that serve until stopped install their own handler over it
    app(prog_name="adapt")  # the name users type (scripts/adapt, the images' entrypoint), not "python -m app"


if __name__ == "__main__":
    main()
