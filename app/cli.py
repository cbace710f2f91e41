"""The `adapt` command line. Each package registers its own commands."""

from __future__ import annotations

import importlib

import typer

from app.common import ConfigOpt, JsonOpt, emit, get_config

app = typer.Typer(
    name="adapt",
    help="drafter-adapt: keep a P-EAGLE drafter fast on the traffic your vLLM endpoint serves.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Packages that contribute commands; each module exposes register(app).
COMMAND_MODULES = ["app.commands.doctor", "app.commands.models", "app.commands.capture", "app.commands.serving", "app.commands.train", "app.commands.loop", "app.commands.head", "app.commands.demo"]


@app.command("config")
def show_config(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Print the effective configuration."""
    from settings.config import dump_toml

    cfg = get_config(config)
    emit(cfg.to_json_dict(), json_, human=dump_toml(cfg))


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
