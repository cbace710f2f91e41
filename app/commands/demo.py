"""`adapt demo`: the main job on the embedded default config."""

from __future__ import annotations

import time

import typer

from app.common import ConfigOpt, JsonOpt, emit, get_config


def demo(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """The loop both ways: bootstrap, a nightly run refused when not better, drift adaptation, hot-swaps
    under traffic, rollback by stage and by alias; which of promotion / refusal / rollback it showed."""
    from app.demo import render, run_demo, stderr_log

    from app.preflight import check

    cfg = get_config(config, json_)
    check(cfg.serving.replicas)  # before anything starts: a machine too small is told so, not OOM-killed later
    report = run_demo(cfg, stderr_log(time.monotonic()))
    emit(report, json_, human=render(report))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
