"""`adapt serve`, `adapt swap`, `adapt bench`, `adapt pool status`."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from app.common import ConfigOpt, JsonOpt, command_group, emit, fail, get_config, progress
from settings.config import Config


def _router_url(cfg: Config, url: Optional[str]) -> str:
    return (url or f"http://{cfg.serving.host}:{cfg.serving.router_port}").rstrip("/")


def _admin_headers(cfg: Config) -> dict[str, str]:
    token = cfg.serving.resolved_admin_token()
    if not token:
        fail("no admin token: set [serving].admin_token or ADAPT_ADMIN_TOKEN", 2)
    return {"Authorization": f"Bearer {token}"}


def _current_head(cfg: Config, head: Optional[str]) -> Path:
    if head:
        return Path(head)
    cur = Path(cfg.head.heads_dir) / "current"
    if not (cur / "config.json").is_file():
        fail(f"no head given and {cur} does not exist: pass --head DIR", 2)
    return cur.resolve()


def _production_warnings(cfg: Config) -> list[str]:
    """What the registry knows against the Production head (today: slower than no speculation somewhere)."""
    from loop.registry import Registry, slower_than_nospec

    try:
        prod = Registry(cfg).production()
    except Exception as exc:  # noqa: BLE001 - the pool's status must not depend on the registry
        return [f"registry unreachable ({type(exc).__name__}): the Production head's benchmark is unknown"]
    return slower_than_nospec(prod.version, prod.tags) if prod is not None else []


def register(app: typer.Typer) -> None:
    pool_app = command_group(help="Inspect the serving pool.")
    app.add_typer(pool_app, name="pool")

    @app.command("serve")
    def serve(
        config: ConfigOpt = None,
        json_: JsonOpt = False,
        head: Annotated[Optional[str], typer.Option(help="Head directory (default: {heads_dir}/current).")] = None,
        replicas: Annotated[Optional[int], typer.Option(help="Replicas to start (default [serving].replicas).")] = None,
        attach: Annotated[Optional[list[str]], typer.Option(help="Replica URL to attach (repeatable).")] = None,
        router_port: Annotated[Optional[int], typer.Option(help="Router port.")] = None,
    ) -> None:
        """Start N vLLM replicas with the P-EAGLE head and the capturing router; run until Ctrl-C."""
        from serving.admin import ExposureError, check_exposure
        from serving.serve import ServingStack
        from targets.model_zoo import ensure_target

        cfg = get_config(config, json_)
        try:  # before the model is fetched: a refusal should come at once
            check_exposure(cfg.serving.host, cfg.serving.resolved_admin_token())
        except ExposureError as exc:
            fail(str(exc), 2)
        target = ensure_target(cfg.target.model, cfg.target.model_cache)
        stack = ServingStack(cfg, head_dir=_current_head(cfg, head), target_dir=target, replicas=replicas,
                             attach_urls=attach, router_port=router_port)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        try:
            stack.start()
            emit({"router": stack.url, "replicas": [r.url for r in stack.pool.replicas],
                  "head": stack.pool.current_head}, json_,
                 human=f"router {stack.url} serving {len(stack.pool.replicas)} replica(s); Ctrl-C stops")
            stop.wait()
        finally:
            stack.stop()

    @app.command("swap")
    def swap(
        head: Annotated[str, typer.Argument(help="Head directory or MLflow model URI (models:/name/N).")],
        config: ConfigOpt = None,
        json_: JsonOpt = False,
        version: Annotated[Optional[str], typer.Option(help="Version label reported by replicas.")] = None,
        restart: Annotated[bool, typer.Option("--restart", help="Force a rolling restart.")] = False,
        url: Annotated[Optional[str], typer.Option(help="Router URL (default from config).")] = None,
    ) -> None:
        """Swap the pool to HEAD: validate, canary, then one by one; roll back on failure."""
        import httpx

        cfg = get_config(config, json_)
        if "://" not in head and not head.startswith(("models:/", "runs:/")):
            head = str(Path(head).absolute())
        try:
            r = httpx.post(_router_url(cfg, url) + "/admin/swap", headers=_admin_headers(cfg),
                           json={"head": head, "version": version, "restart": restart}, timeout=3600)
        except httpx.HTTPError as exc:
            fail(f"cannot reach the router: {exc}")
        if r.status_code in (401, 403):
            fail(f"refused: {r.json().get('detail')}", 3)
        rep = r.json()
        human = (f"swap {'ok' if rep.get('ok') else 'FAILED'} ({rep.get('mode')}): "
                 f"{rep.get('head', {}).get('sha256')}" + (f"\n{rep.get('error')}" if rep.get("error") else ""))
        emit(rep, json_, human=human)
        if not rep.get("ok"):
            raise typer.Exit(1)

    @pool_app.command("status")
    def status(
        config: ConfigOpt = None,
        json_: JsonOpt = False,
        url: Annotated[Optional[str], typer.Option(help="Router URL (default from config).")] = None,
    ) -> None:
        """Each replica's URL, health, head sha256/version and live acceptance."""
        import httpx

        cfg = get_config(config, json_)
        try:
            r = httpx.get(_router_url(cfg, url) + "/admin/status", headers=_admin_headers(cfg), timeout=60)
        except httpx.HTTPError as exc:
            fail(f"cannot reach the router: {exc}")
        if r.status_code != 200:
            fail(f"router answered {r.status_code}: {r.text[:300]}")
        st = r.json()
        st["warnings"] = _production_warnings(cfg)
        lines = []
        for rep in st["replicas"]:
            acc = (rep.get("live_acceptance") or {}).get("mean_acceptance_length")
            lines.append(f"{rep['url']}  {'healthy' if rep['healthy'] else 'DOWN'}"
                         f"{' draining' if rep['draining'] else ''}  head {str(rep['head_sha256'])[:12]} "
                         f"v{rep['head_version']}  acceptance {acc if acc is None else round(acc, 3)}")
        lines += [f"WARNING: {w}" for w in st["warnings"]]
        emit(st, json_, human="\n".join(lines))

    @app.command("bench")
    def bench(
        candidate: Annotated[str, typer.Option(help="Candidate head (dir or MLflow URI).")],
        live: Annotated[str, typer.Option(help="Live head (dir or MLflow URI).")],
        config: ConfigOpt = None,
        json_: JsonOpt = False,
        heldout: Annotated[Optional[str], typer.Option(help="Held-out capture (dir/JSONL); default [capture].source.")] = None,
        url: Annotated[Optional[str], typer.Option(help="Use this bench replica instead of starting one.")] = None,
        out: Annotated[Optional[Path], typer.Option(help="Output directory for bench.json and bench.png.")] = None,
        concurrency: Annotated[Optional[list[int]], typer.Option(help="Concurrency levels (repeatable).")] = None,
        rounds: Annotated[Optional[int], typer.Option(help="Counterbalanced rounds (each arm once per round).")] = None,
        max_prompts: Annotated[Optional[int], typer.Option(help="Prompts per round.")] = None,
        nospec: Annotated[Optional[bool], typer.Option(
            "--nospec/--no-nospec", help="Also measure a replica without speculation (default: bench.nospec_reference).")] = None,
        nospec_url: Annotated[Optional[str], typer.Option(help="Use this replica without speculation as the reference.")] = None,
        train: Annotated[Optional[str], typer.Option(
            help="Training conversations (JSONL): count held-out prompts that repeat them, and drop those.")] = None,
        seed: Annotated[Optional[int], typer.Option(help="Seed of the arms' order and the bootstrap.")] = None,
    ) -> None:
        """Replay held-out traffic: candidate, live and an A/A control in counterbalanced order; JSON + plot."""
        from evaluation.bench import run_bench_cli

        cfg = get_config(config, json_)
        try:
            result = run_bench_cli(cfg, candidate=candidate, live=live, heldout=heldout, url=url, out=out,
                                   concurrencies=concurrency, rounds=rounds, max_prompts=max_prompts,
                                   nospec=nospec, nospec_url=nospec_url, seed=seed, train=train, progress=progress)
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            fail(str(exc))
        s = result["summary"]
        human = json.dumps(s, indent=2) + f"\nJSON: {result['json_path']}\nplot: {result['plot_path']}"
        emit(result, json_, human=human)
