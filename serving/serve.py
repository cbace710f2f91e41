"""Assemble a running pool: replicas (started or attached) + swap controller + router.

``ServingStack`` is what ``adapt serve`` runs and what the tests start in-process.
Replicas start in parallel (each engine start is slow); the router is served by
uvicorn on ``serving.host:router_port`` in a background thread with its own loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from serving.admin import ExposureError, check_exposure, tls_verify, token_weakness, url_is_loopback
from serving.capture_journal import JournalWriter
from serving.pool import Pool, head_identity, replica_specs
from serving.poolview import SharedPool
from serving.replica import ReplicaProcess
from serving.router import create_app, server_config, start_server, stop_server
from serving.swap import SwapController
from serving.workers import CaptureTotals, RouterWorkers, WorkerSpec, capture_spec
from settings.config import Config, TargetConfig


def served_name(target: TargetConfig) -> str:
    """The name replicas serve the target as (``model`` of OpenAI requests)."""
    m = target.model
    return m if m in ("smollm2", "tiny") else Path(m).name


def check_attachments(attach_urls: list[str], attach_agents: list[str], agent_token: str) -> None:
    """Refuse bare replicas, and agents without a real token.

    Heads reach a replica only through the agent that holds its engine (no vLLM dev routes
    anywhere), so a replica this pool did not start is attached through its agent, which the pool
    reaches with ``agent_token``.
    """
    if attach_urls:
        raise ExposureError(
            f"attach_urls {attach_urls}: a bare vLLM replica can be swapped only over vLLM's unauthenticated "
            "dev-mode routes, which this project never uses. Run each such replica in `adapt agent --embed` "
            "and list the agents in [serving].attach_agents (`adapt replica command` prints the command lines).")
    if attach_agents:
        weakness = token_weakness(agent_token)
        if weakness and not all(url_is_loopback(u) for u in attach_agents):
            raise ExposureError(f"the agent token {weakness}: set ADAPT_AGENT_TOKEN (or [serving].agent_token) to "
                                "the random token the agents were started with")
        if not agent_token:
            raise ExposureError("attach_agents needs the agents' token: set ADAPT_AGENT_TOKEN or "
                                "[serving].agent_token")


def _uvloop_or_asyncio() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (sockets and callbacks cost the router less CPU there), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopService:
    """A server run on a private event-loop thread: ``start`` runs ``_start`` there, ``stop`` ``_stop``."""

    def __init__(self, uvloop: bool = False) -> None:
        self.loop = _uvloop_or_asyncio() if uvloop else asyncio.new_event_loop()
        self._thread: threading.Thread | None = None

    def run_coro(self, coro, timeout: float | None = None):
        """Run a coroutine on the service's loop from another thread; fails if that loop's thread ends first."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                return fut.result(1.0 if left is None else max(0.0, min(1.0, left)))
            except concurrent.futures.TimeoutError:
                if fut.done():
                    # Done between the wait's end and this check (a busy loop), or the coroutine's own
                    # TimeoutError (the same class since 3.11): its result or its exception, not ours.
                    return fut.result()
                if left is not None and left <= 1.0:
                    raise  # ours: the caller's timeout
                if self._thread is not None and not self._thread.is_alive():
                    fut.cancel()
                    raise RuntimeError(f"{type(self).__name__}'s event loop stopped before the call finished "
                                       "(see the exception printed above)") from None

    def start(self, ready_timeout: float = 900.0):
        self._thread = threading.Thread(target=self.loop.run_forever, name=f"{type(self).__name__}-loop",
                                        daemon=True)
        self._thread.start()
        self.run_coro(self._start(ready_timeout))
        return self

    async def _start(self, ready_timeout: float) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        if self._thread is None:
            return
        try:
            self.run_coro(self._stop(), timeout=120)
        finally:
            try:
                self.run_coro(self._cancel_the_rest(), timeout=30)
            except Exception:  # noqa: BLE001 - the loop stops regardless
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            if not self._thread.is_alive():
                self.loop.close()
            self._thread = None

    async def _cancel_the_rest(self) -> None:
        """Cancel what ``_stop`` left (a server's lifespan, half-open TLS handshakes) while the loop runs,
        as ``asyncio.run`` does, so nothing is finalized later against a stopped loop."""
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        await self.loop.shutdown_asyncgens()


class ServingStack(LoopService):
    """Pool + router running on a private event loop thread."""

    def __init__(self, cfg: Config, *, head_dir: str | Path, target_dir: str | Path, replicas: int | None = None,
                 attach_urls: list[str] | None = None, router_port: int | None = None,
                 base_port: int | None = None, capture_dest: str | None = None,
                 log_dir: str | Path | None = None, writer_kwargs: dict[str, Any] | None = None,
                 replica_extra_args: list[str] | None = None, attach_agents: list[str] | None = None) -> None:
        # Before anything starts: off loopback, the admin plane needs a real token.
        check_exposure(cfg.serving.host, cfg.serving.resolved_admin_token())
        super().__init__(uvloop=True)
        self.cfg = cfg
        self.head_dir = Path(head_dir).absolute()
        self.target_dir = Path(target_dir).absolute()
        self.n = cfg.serving.replicas if replicas is None else replicas
        self.attach_urls = list(cfg.serving.attach_urls if attach_urls is None else attach_urls)
        self.attach_agents = list(cfg.serving.attach_agents if attach_agents is None else attach_agents)
        check_attachments(self.attach_urls, self.attach_agents, cfg.serving.resolved_agent_token())
        self.router_port = cfg.serving.router_port if router_port is None else router_port
        self.base_port = base_port
        self.capture_dest = capture_dest if capture_dest is not None else cfg.capture.source
        self.log_dir = Path(log_dir or Path(cfg.state_dir) / "serving" / "logs")
        self.writer_kwargs = writer_kwargs or {}
        self.replica_extra_args = list(replica_extra_args or [])
        self.model_name = served_name(cfg.target)
        # Router workers (serving.workers) route in their own processes: the pool sums their counters.
        self.pool = (SharedPool if cfg.serving.router_workers > 1 else Pool)(verify=tls_verify(cfg.serving.agent_ca_file))
        self.workers: RouterWorkers | None = None
        self.writer: JournalWriter | None = None
        # What the router captured, however it routes: this process's writer, or its workers' counts summed.
        # ``counts["published"]`` is what an ingest can read.
        self.capture: JournalWriter | CaptureTotals | None = None
        self.controller: SwapController | None = None
        self.server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://{self.cfg.serving.host}:{self.router_port}"

    async def _start(self, ready_timeout: float) -> None:
        from headspec.validate import validate_head

        cfg = self.cfg
        # The first head is checked like every swapped-in one, before any replica loads it.
        await asyncio.to_thread(validate_head, self.head_dir, self.target_dir)
        specs = replica_specs(cfg.serving, cfg.head.num_speculative_tokens, self.target_dir, self.head_dir, self.n,
                              self.model_name, self.base_port, self.replica_extra_args)
        procs = [ReplicaProcess(s, self.log_dir / f"replica-{s.port}.log") for s in specs]
        for p in procs:
            p.start()
            self.pool.add_started(p)
        for u in self.attach_urls:
            self.pool.attach(u)
        for u in self.attach_agents:
            self.pool.attach(u, agent_token=cfg.serving.resolved_agent_token())
        try:
            await asyncio.gather(*(asyncio.to_thread(p.wait_healthy, ready_timeout) for p in procs))
        except Exception:
            await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs))
            raise
        self.pool.current_head = head_identity(self.head_dir)
        await self.pool.start_background()
        await asyncio.gather(*(self.pool.refresh_head(r) for r in self.pool.replicas))
        if self.pool.current_head.get("sha256") is None and self.pool.replicas:
            self.pool.current_head["sha256"] = self.pool.replicas[0].head.get("sha256")
        n_workers = cfg.serving.router_workers
        if self.capture_dest and n_workers == 1:
            # A journal, as each worker's: every record is in the kernel before its answer ends, and a loop
            # saturated with requests cannot starve it (a queue drained by threads waits for the GIL, which
            # a busy loop hardly yields, and drops what overflows). A second `adapt serve` on the same
            # destination and state takes a spool of its own beside this one.
            self.writer = capture_spec(cfg, self.capture_dest, **self.writer_kwargs).journal("router", alternatives=7)
        self.controller = SwapController(
            self.pool, target_dir=self.target_dir, num_speculative_tokens=cfg.head.num_speculative_tokens,
            served_model_name=self.model_name, smoke_prompts=cfg.serving.smoke_prompts or None,
            download_dir=Path(cfg.head.heads_dir) / "downloaded",
            tracking_uri=cfg.mlflow.tracking_uri, s3_client_kwargs=cfg.s3.client_kwargs(),
            registry_uri=cfg.mlflow.registry_uri)

        async def swap_handler(body: dict) -> dict:
            rep = await self.controller.swap(str(body["head"]), version=body.get("version"),
                                             force_restart=bool(body.get("restart", False)),
                                             check_acceptance=bool(body.get("check_acceptance", True)))
            return rep.to_json()

        # With workers, this app answers their admin requests: capture counts are theirs, summed.
        totals = CaptureTotals(self.pool) if n_workers > 1 and self.capture_dest else None  # type: ignore[arg-type]
        self.capture = self.writer or totals
        app = create_app(self.pool, writer=self.capture,  # type: ignore[arg-type]
                         admin_token=cfg.serving.resolved_admin_token(),
                         swap_handler=swap_handler, capture_token_ids=cfg.serving.capture_token_ids,
                         request_timeout=cfg.serving.upstream_read_timeout_s,
                         connect_timeout=cfg.serving.upstream_connect_timeout_s,
                         retry_backoff=cfg.serving.upstream_retry_backoff_s,
                         max_body_bytes=cfg.serving.max_body_bytes or cfg.capture.max_line_bytes)
        if n_workers > 1:
            # This process keeps the pool and answers the admin requests the workers pass on; they serve the port.
            spec = WorkerSpec(
                capture=capture_spec(cfg, self.capture_dest, **self.writer_kwargs) if self.capture_dest else None,
                max_body_bytes=cfg.serving.max_body_bytes or cfg.capture.max_line_bytes,
                header_timeout=cfg.serving.header_timeout_s, body_timeout=cfg.serving.body_timeout_s,
                capture_token_ids=cfg.serving.capture_token_ids, request_timeout=cfg.serving.upstream_read_timeout_s,
                connect_timeout=cfg.serving.upstream_connect_timeout_s,
                retry_backoff=cfg.serving.upstream_retry_backoff_s, agent_ca_file=cfg.serving.agent_ca_file)
            self.workers = RouterWorkers(self.pool, app, spec, cfg.serving.host, self.router_port,  # type: ignore[arg-type]
                                         n_workers, log_dir=self.log_dir)
            await self.workers.start()
            return
        config = server_config(app, cfg.serving.host, self.router_port, header_timeout=cfg.serving.header_timeout_s,
                               body_timeout=cfg.serving.body_timeout_s, log_level="warning", lifespan="on",
                               timeout_keep_alive=30)
        self.server, self._serve_task = await start_server(config)

    async def _stop(self) -> None:
        if self.workers is not None:
            await self.workers.stop()
        await stop_server(self.server, self._serve_task)
        if self.writer is not None:
            await self.writer.close()
        await self.pool.close()
