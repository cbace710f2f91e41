"""`adapt cycle`, `adapt rollback`, `adapt controller`, `adapt registry list|import`."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from app.common import ConfigOpt, JsonOpt, answer_soon, command_group, emit, error_text, fail, get_config, progress
from loop.steps import STEPS
from settings.config import Config

StepName = Literal[STEPS]  # type: ignore[valid-type] - the choices of --step, from the cycle's own list


def rollback(cfg: Config, to: str | None = None) -> dict:
    """Make version ``to`` (default: the ``previous`` alias) the champion again, alias and stage (the controller
    makes the pool follow)."""
    from rollout.registry import PREVIOUS_ALIAS, Registry, RegistryError

    reg = Registry(cfg)
    if to is None:
        to = reg.alias_version(PREVIOUS_ALIAS)
        if to is None:
            raise RegistryError(f"{reg.name} has no {PREVIOUS_ALIAS!r} version to roll back to "
                                f"(registry {reg.registry_uri}): pass --to N")
    mv = reg.get(to)  # RegistryError for an unknown version
    out = reg.promote(mv.version, reason=f"manual rollback to {mv.version}")
    return {"model": reg.name, "production": out["version"], "previous": out["previous"],
            "head_sha256": mv.tags.get("head_sha256"), "alias": reg.alias_version(), "stages": reg.stages}


def registry_list(cfg: Config) -> dict:
    from rollout.registry import PREVIOUS_ALIAS, Registry

    reg = Registry(cfg)
    champion = reg.champion()
    return {"model": reg.name, "production": champion.version if champion else None,
            "champion": reg.alias_version(), "previous": reg.alias_version(PREVIOUS_ALIAS),
            "stages": reg.stages, "versions": reg.describe_all()}


registry_app = command_group(help="The MLflow model registry of drafter heads.")


def cycle_cmd(
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    cycle_id: Annotated[Optional[str], typer.Option(
        "--cycle-id", help="Run or resume this cycle (default: resume the newest unfinished one, else a new one).")] = None,
    step: Annotated[Optional[StepName], typer.Option(
        help="Run only this step (the ones before it must be done).")] = None,
    live_head: Annotated[Optional[str], typer.Option(
        help="Live head to benchmark against while nothing is in Production.")] = None,
    bench_url: Annotated[Optional[str], typer.Option(help="Existing bench replica URL (default: start one).")] = None,
    nospec_url: Annotated[Optional[str], typer.Option(
        help="Existing replica without speculation: the bench's reference arm.")] = None,
    router_url: Annotated[Optional[str], typer.Option(
        help="Swap the pool behind this router right after promotion.")] = None,
) -> None:
    cfg = get_config(config, json_)
    from loop.cycle import CycleError, CycleOptions, new_cycle_id, run_cycle, run_step, summary

    opts = CycleOptions(live_head=live_head, bench_url=bench_url, nospec_url=nospec_url, router_url=router_url,
                        progress=progress)
    try:
        if step:
            cid = cycle_id or new_cycle_id()
            run_step(cfg, cid, step, opts)
            out = summary(cfg, cid)
        else:
            out = run_cycle(cfg, cycle_id, opts)
    except (CycleError, ValueError, FileNotFoundError) as exc:
        fail(error_text(exc))
    human = (f"cycle {out['cycle_id']}: version {out['version']} {out['verdict']}"
             f"{' and promoted' if out['promoted'] else ''}\n{out['reason']}")
    emit(out, json_, human=human)


CYCLE_HELP = f"One adaptation cycle, resumable: {' → '.join(STEPS)}."


def rollback_cmd(
    to: Annotated[Optional[int], typer.Option(
        "--to", min=1, help="Registered model version to make the champion again (default: the previous alias).")] = None,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Make version N the champion again (alias champion and stage Production; the current one becomes
    previous); the controller swaps the pool."""
    cfg = get_config(config, json_)
    answer_soon()
    from rollout.registry import RegistryError

    try:
        out = rollback(cfg, None if to is None else str(to))
    except RegistryError as exc:
        fail(error_text(exc))
    emit(out, json_, human=f"version {out['production']} is Production (was {out['previous']})")


def controller_cmd(
    config: ConfigOpt = None,
    json_: JsonOpt = False,
    router_url: Annotated[Optional[str], typer.Option(help="Router URL (default from [serving]).")] = None,
    health_host: Annotated[str, typer.Option(help="Health endpoint bind address.")] = "127.0.0.1",
    health_port: Annotated[int, typer.Option(
        min=0, max=65535, help="Health endpoint port (GET /health, /events).")] = 8090,
    once: Annotated[bool, typer.Option("--once", help="One reconcile pass, then exit.")] = False,
) -> None:
    """Run the controller: reconcile the pool to the champion, watch live acceptance, roll back."""
    cfg = get_config(config, json_)
    from rollout.controller import Controller
    from serving.admin import ExposureError

    # Structured events are JSON lines on stderr (stdout stays for --json output).
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    try:
        ctl = Controller(cfg, router_url=router_url, health_host=health_host,
                         health_port=None if once else health_port)
    except ExposureError as exc:
        fail(str(exc), 2)
    if once:
        try:
            ctl.step()
        except Exception as exc:  # noqa: BLE001
            fail(f"reconcile failed (router {ctl.router_url}, registry {ctl.registry.tracking_uri}): "
                 f"{type(exc).__name__}: {exc}")
        emit(ctl.health() | {"events": list(ctl.events)}, json_)
        return
    signal.signal(signal.SIGTERM, lambda *_: ctl._stop.set())
    signal.signal(signal.SIGINT, lambda *_: ctl._stop.set())
    ctl.start()
    emit({"health": f"http://{health_host}:{ctl.health_port}/health", "router": ctl.router_url}, json_)
    while ctl._thread is not None and ctl._thread.is_alive():
        ctl._thread.join(1.0)
    ctl.stop()


@registry_app.command("list")
def list_cmd(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
    """Versions with stage, aliases, head sha256, parent and gate verdict."""
    cfg = get_config(config, json_)
    answer_soon()
    out = registry_list(cfg)
    lines = [f"{out['model']}: champion {out['champion']} (Production {out['production']}, "
             f"previous {out['previous']})"]
    for v in out["versions"]:
        t = v["tags"]
        aliases = ",".join(v["aliases"])
        lines.append(f"  v{v['version']:>3} {v['stage'] or '-':<10} {aliases:<18} sha {t.get('head_sha256', '')[:12]}  "
                     f"parent {t.get('parent_version')}  {t.get('gate_verdict')}: {t.get('gate_reason', '')[:80]}")
    emit(out, json_, human="\n".join(lines))


@registry_app.command("import")
def import_cmd(
    head: Annotated[Path, typer.Argument(help="Head directory to register (e.g. the one the pool serves).")],
    promote: Annotated[bool, typer.Option(
        "--promote", help="Also make it the champion (alias champion, stage Production).")] = False,
    config: ConfigOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Register an existing head as a version (seeds an empty registry)."""
    cfg = get_config(config, json_)
    answer_soon()
    from rollout.registry import Registry, import_head

    if not (head / "config.json").is_file():
        fail(f"no head directory at {head} (no config.json)")
    mv = import_head(cfg, head)
    reg = Registry(cfg)
    if promote:
        promotion = reg.promote(mv.version, reason="imported and promoted")
    out = reg.describe(reg.get(mv.version), aliases=reg.aliases())
    if promote:
        out["promotion"] = promotion
    emit(out, json_, human=f"version {mv.version}" + (" (champion)" if promote else ""))


def register(app: typer.Typer) -> None:
    app.command("cycle", help=CYCLE_HELP)(cycle_cmd)
    app.command("rollback")(rollback_cmd)
    app.command("controller")(controller_cmd)
    app.add_typer(registry_app, name="registry")
