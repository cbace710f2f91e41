"""`adapt cycle`, `adapt rollback`, `adapt controller`, `adapt registry list|import|promote`."""

from __future__ import annotations

import logging
import signal
import sys
from typing import Annotated, Optional

import typer

from app.common import ConfigOpt, JsonOpt, command_group, emit, fail, get_config, progress
from settings.config import Config


def rollback(cfg: Config, to: str) -> dict:
    """Move version ``to`` back to Production (the controller makes the pool follow)."""
    from rollout.registry import Registry

    reg = Registry(cfg)
    mv = reg.get(to)  # raises for an unknown version
    out = reg.promote(mv.version, reason=f"manual rollback to {mv.version}")
    return {"model": reg.name, "production": out["version"], "previous": out["previous"],
            "head_sha256": mv.tags.get("head_sha256"), "alias": reg.alias_version()}


def registry_list(cfg: Config) -> dict:
    from rollout.registry import Registry

    reg = Registry(cfg)
    prod = reg.production()
    return {"model": reg.name, "production": prod.version if prod else None, "champion": reg.alias_version(),
            "versions": reg.describe_all()}


def register(app: typer.Typer) -> None:
    reg_app = command_group(help="The MLflow model registry of drafter heads.")
    app.add_typer(reg_app, name="registry")

    @app.command("cycle")
    def cycle_cmd(
        config: ConfigOpt = None,
        json_: JsonOpt = False,
        cycle_id: Annotated[Optional[str], typer.Option("--cycle-id", help="Run or resume this cycle (default: resume the newest unfinished one, else a new one).")] = None,
        step: Annotated[Optional[str], typer.Option(help="Run only this step (the ones before it must be done).")] = None,
        live_head: Annotated[Optional[str], typer.Option(help="Live head to benchmark against while nothing is in Production.")] = None,
        bench_url: Annotated[Optional[str], typer.Option(help="Existing bench replica URL (default: start one).")] = None,
        nospec_url: Annotated[Optional[str], typer.Option(help="Existing replica without speculation: the bench's reference arm.")] = None,
        router_url: Annotated[Optional[str], typer.Option(help="Swap the pool behind this router right after promotion.")] = None,
    ) -> None:
        """One adaptation cycle: ingest → snapshot → train → eval → bench → gate → register → promote."""
        from loop.cycle import CycleError, CycleOptions, new_cycle_id, run_cycle, run_step, summary

        cfg = get_config(config, json_)
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
            fail(str(exc))
        human = (f"cycle {out['cycle_id']}: version {out['version']} {out['verdict']}"
                 f"{' and promoted' if out['promoted'] else ''}\n{out['reason']}")
        emit(out, json_, human=human)

    @app.command("rollback")
    def rollback_cmd(
        to: Annotated[str, typer.Option("--to", help="Registered model version to put back in Production.")],
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Move version N to Production (archiving the current one); the controller swaps the pool."""
        cfg = get_config(config, json_)
        try:
            out = rollback(cfg, to)
        except Exception as exc:  # noqa: BLE001 - MLflow errors are user-facing here
            fail(f"rollback failed: {exc}")
        emit(out, json_, human=f"version {out['production']} is Production (was {out['previous']})")

    @app.command("controller")
    def controller_cmd(
        config: ConfigOpt = None,
        json_: JsonOpt = False,
        router_url: Annotated[Optional[str], typer.Option(help="Router URL (default from [serving]).")] = None,
        health_host: Annotated[str, typer.Option(help="Health endpoint bind address.")] = "127.0.0.1",
        health_port: Annotated[int, typer.Option(help="Health endpoint port (GET /health, /events).")] = 8090,
        once: Annotated[bool, typer.Option("--once", help="One reconcile pass, then exit.")] = False,
    ) -> None:
        """Run the controller: reconcile the pool to Production, watch live acceptance, roll back."""
        from rollout.controller import Controller
        from serving.admin import ExposureError

        cfg = get_config(config, json_)
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
                fail(f"reconcile failed: {exc}")
            emit(ctl.health() | {"events": list(ctl.events)}, json_)
            return
        signal.signal(signal.SIGTERM, lambda *_: ctl._stop.set())
        signal.signal(signal.SIGINT, lambda *_: ctl._stop.set())
        ctl.start()
        emit({"health": f"http://{health_host}:{ctl.health_port}/health", "router": ctl.router_url}, json_)
        while ctl._thread is not None and ctl._thread.is_alive():
            ctl._thread.join(1.0)
        ctl.stop()

    @reg_app.command("list")
    def list_cmd(config: ConfigOpt = None, json_: JsonOpt = False) -> None:
        """Versions with stage, aliases, head sha256, parent and gate verdict."""
        cfg = get_config(config, json_)
        out = registry_list(cfg)
        lines = [f"{out['model']}: Production {out['production']} (champion {out['champion']})"]
        for v in out["versions"]:
            t = v["tags"]
            lines.append(f"  v{v['version']:>3} {v['stage']:<10} sha {t.get('head_sha256', '')[:12]}  "
                         f"parent {t.get('parent_version')}  {t.get('gate_verdict')}: {t.get('gate_reason', '')[:80]}")
        emit(out, json_, human="\n".join(lines))

    @reg_app.command("import")
    def import_cmd(
        head: Annotated[str, typer.Argument(help="Head directory to register (e.g. the one the pool serves).")],
        promote: Annotated[bool, typer.Option("--promote", help="Also move it to Production.")] = False,
        config: ConfigOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        """Register an existing head as a version (seeds an empty registry)."""
        from rollout.registry import Registry, import_head

        cfg = get_config(config, json_)
        mv = import_head(cfg, head)
        reg = Registry(cfg)
        out = reg.describe(mv, reg.alias_version())
        if promote:
            out["promotion"] = reg.promote(mv.version, reason="imported and promoted")
        emit(out, json_, human=f"version {mv.version}" + (" (Production)" if promote else ""))
