"""The agent beside a replica the pool did not start (another host, a Kubernetes pod).

Two ways to run it (docs/deploy.md, "Attached replicas"):

* ``adapt agent --embed -- vllm serve MODEL ...`` (production, ``serving.embedded``): the agent holds
  the engine in its own process and calls vLLM's weight-update protocol on it directly; no dev mode.
* ``adapt agent --replica URL`` (this module's :class:`Agent`): a proxy beside a separate replica
  started with ``VLLM_SERVER_DEV_MODE=1`` on loopback, whose unauthenticated weight-update routes
  (and ``/collective_rpc``) never leave its host or pod; the agent is the only door to it.

Either way the agent serves:

* ``/v1/*``, ``/health``: the router (``serving.router``) over a one-replica pool.
* ``/metrics``: the replica's exposition, then the agent's own counters: the pool that attaches
  the agent reads its spec-decode counters there, as it would on the replica.
* ``/agent/head``, ``/agent/load``, ``/agent/param_digest``: the admin plane, bearer token.
  ``load`` takes ``{"uri", "version", "sha256"}``: the agent fetches ``uri`` (``s3://``,
  ``models:/``, ``runs:/``) into its own heads directory, validates it against its local copy of
  the target (``headspec.validate``), swaps it in place through vLLM's weight-update protocol
  (``ReplicaAdmin``, which also resets the prefix cache) and reports the head. Nothing but the URI crosses the
  network: no path, no shared filesystem. A head the agent already holds (the one the replica
  started with, or one of its last downloads) may be named by ``sha256`` alone: that is how a
  pool rolls an agent back.

With a token, every route but ``/health`` requires ``Authorization: Bearer <token>`` (constant-time
compare); off loopback the agent refuses to start without a real token (``check_exposure``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any, Callable

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from headspec.resolve import is_remote_ref, resolve_head
from serving.admin import (ExposureError, ReplicaAdmin, RpcError, bearer_status, check_exposure,
                           make_auth_dependency, url_is_loopback)
from serving.pool import Pool
from serving.router import create_app, server_config, start_server, stop_server
from serving.serve import LoopService

log = logging.getLogger(__name__)
OPEN_PATHS = frozenset({"/health"})  # probes: no token, and nothing but a replica count in the answer


class LoadRequest(BaseModel):
    uri: str | None = None
    version: str | None = None
    sha256: str | None = None


class AgentError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HeadStore:
    """Heads on this host: fetched by URI, validated, swapped into the replica in place.

    Keeps the replica's first head and the ``keep`` most recently loaded downloads (the current
    one and those a pool may roll back to); older downloads are deleted.
    """

    def __init__(self, admin: ReplicaAdmin, target_dir: str | Path, heads_dir: str | Path, *,
                 tracking_uri: str | None = None, s3_client_kwargs: dict[str, Any] | None = None,
                 keep: int = 3) -> None:
        self.admin = admin
        self.target_dir = Path(target_dir)
        self.heads_dir = Path(heads_dir)
        self.tracking_uri = tracking_uri
        self.s3_client_kwargs = s3_client_kwargs or {}
        self.keep = keep
        self.held: dict[str, dict[str, Any]] = {}  # sha256 -> {"path", "uri"}
        self.recent: list[str] = []  # sha256 of loaded heads, newest last
        self.lock = asyncio.Lock()

    async def info(self) -> dict[str, Any]:
        """The replica's head report, plus the URI it was fetched from (None: the replica's first head)."""
        h = await self.admin.head_info()
        sha = h.get("sha256")
        if sha and h.get("path") and sha not in self.held:
            self.held[sha] = {"path": h["path"], "uri": None}
        h["uri"] = self.held.get(sha, {}).get("uri")
        return h

    async def load(self, req: LoadRequest) -> dict[str, Any]:
        from headspec.errors import HeadError
        from headspec.validate import validate_head

        async with self.lock:
            await self.info()  # learn the head the replica runs now (a rollback target)
            entry = self.held.get(req.sha256) if req.sha256 else None
            sha, version = req.sha256, req.version
            if entry is not None and entry["uri"] is None and req.uri and is_remote_ref(req.uri):
                entry["uri"] = req.uri  # held already (the first head): the pool names where it is from
            if entry is None:
                if not req.uri:
                    raise AgentError(404, f"no head with sha256 {req.sha256} on this agent: give its URI")
                if not is_remote_ref(req.uri):
                    raise AgentError(400, f"an agent fetches heads by URI (s3://bucket/prefix, models:/name/N, "
                                          f"runs:/id/path), not {req.uri!r}")
                self.heads_dir.mkdir(parents=True, exist_ok=True)
                try:
                    path, registered = await asyncio.to_thread(resolve_head, req.uri, self.heads_dir,
                                                               self.tracking_uri, self.s3_client_kwargs)
                    info = await asyncio.to_thread(validate_head, path, self.target_dir)
                except (HeadError, OSError, ValueError) as exc:
                    raise AgentError(422, f"invalid head {req.uri}: {exc}") from exc
                except Exception as exc:  # noqa: BLE001 - S3 or MLflow refused or unreachable
                    raise AgentError(502, f"cannot fetch {req.uri}: {type(exc).__name__}: {exc}") from exc
                if req.sha256 and info.sha256 != req.sha256:
                    raise AgentError(409, f"{req.uri} has sha256 {info.sha256}, not the expected {req.sha256}")
                sha = info.sha256
                version = version or registered or info.manifest.get("version")
                entry = self.held[sha] = {"path": str(info.path), "uri": req.uri}
            try:
                got = await self.admin.load_head(entry["path"], version, sha)
            except RpcError as exc:
                raise AgentError(409, str(exc)) from exc
            entry["version"] = version
            got["uri"] = entry["uri"]
            self._loaded(sha)
            return got

    async def reapply(self) -> bool:
        """Load the head last swapped in again if the replica runs another (it restarted with its first
        head); True if it did. The pool's swaps hold the lock, so this never races one."""
        if not self.recent or self.lock.locked():
            return False
        async with self.lock:
            want = self.recent[-1]
            if (await self.admin.head_info()).get("sha256") == want:
                return False
            entry = self.held[want]
            await self.admin.load_head(entry["path"], entry.get("version"), want)
            return True

    def _loaded(self, sha: str) -> None:
        if sha in self.recent:
            self.recent.remove(sha)
        self.recent.append(sha)
        for old in self.recent[:-self.keep]:
            top = self._download_root(self.held[old]["path"])
            if top is None:
                continue  # not ours (the replica's first head): kept
            if any(self._download_root(self.held[s]["path"]) == top for s in self.recent[-self.keep:]):
                continue
            shutil.rmtree(top, ignore_errors=True)
            del self.held[old]
            self.recent.remove(old)

    def _download_root(self, path: str) -> Path | None:
        try:
            rel = Path(path).relative_to(self.heads_dir)
        except ValueError:
            return None
        return self.heads_dir / rel.parts[0] if rel.parts else None


def bearer_guard(app: Any, token: str) -> Callable:
    """ASGI wrapper: with a token, every route but :data:`OPEN_PATHS` requires it."""

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and token and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1") or None
            refused = bearer_status(auth, token)
            if refused:
                await JSONResponse({"detail": refused[1]}, refused[0])(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded


def add_agent_routes(app: FastAPI, store: HeadStore, token: str) -> None:
    """``/agent/head``, ``/agent/load``, ``/agent/param_digest`` on ``app``, bearer token required."""
    require = make_auth_dependency(token)

    async def answer(coro) -> JSONResponse:
        try:
            return JSONResponse(await coro)
        except AgentError as exc:
            raise HTTPException(exc.status, str(exc)) from None
        except RpcError as exc:
            raise HTTPException(502, str(exc)) from None

    @app.get("/agent/head", dependencies=[Depends(require)])
    async def head() -> JSONResponse:
        return await answer(store.info())

    @app.post("/agent/load", dependencies=[Depends(require)])
    async def load(req: LoadRequest) -> JSONResponse:
        return await answer(store.load(req))

    @app.get("/agent/param_digest", dependencies=[Depends(require)])
    async def param_digest() -> JSONResponse:
        return await answer(store.admin.param_digest())


def create_agent_app(pool: Pool, store: HeadStore, token: str, **router_kw: Any) -> Callable:
    """The router over the agent's one replica, with its metrics passed through and the agent's admin routes."""
    app: FastAPI = create_app(pool, admin_token=token, upstream_metrics=True, **router_kw)
    add_agent_routes(app, store, token)
    return bearer_guard(app, token)


class Agent(LoopService):
    """``adapt agent``: the agent app served on a private event-loop thread."""

    def __init__(self, replica_url: str, *, host: str, port: int, token: str, target_dir: str | Path,
                 heads_dir: str | Path, tracking_uri: str | None = None,
                 s3_client_kwargs: dict[str, Any] | None = None, tls_cert: str = "", tls_key: str = "",
                 max_body_bytes: int = 8 << 20, header_timeout: float = 10.0, body_timeout: float = 30.0,
                 reapply_interval: float = 5.0) -> None:
        super().__init__()
        check_exposure(host, token, "the agent")
        if not url_is_loopback(replica_url):
            raise ExposureError(f"the agent drives its replica over vLLM's dev-mode routes, which must not leave "
                                f"the host: bind the replica to 127.0.0.1, not {replica_url}")
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("TLS needs both a certificate and its key")
        self.replica_url = replica_url.rstrip("/")
        self.host, self.port, self.token = host, port, token
        self.tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert else {}
        self.limits = {"max_body_bytes": max_body_bytes}
        self.deadlines = {"header_timeout": header_timeout, "body_timeout": body_timeout}
        self.store = HeadStore(ReplicaAdmin(self.replica_url), target_dir, heads_dir, tracking_uri=tracking_uri,
                               s3_client_kwargs=s3_client_kwargs)
        # Health every second (it is what /health answers); metrics are read on demand, not sampled.
        self.pool = Pool(metrics_interval=3600.0)
        self.server = self._task = self._watch = None
        self.reapply_interval = reapply_interval

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def _start(self, ready_timeout: float) -> None:
        self.pool.attach(self.replica_url)
        await self.pool.start_background()
        app = create_agent_app(self.pool, self.store, self.token, **self.limits)
        config = server_config(app, self.host, self.port, log_level="warning", lifespan="on",
                               timeout_keep_alive=30, **self.deadlines, **self.tls)
        self.server, self._task = await start_server(config)
        self._watch = asyncio.create_task(self._reapply_loop(), name="agent-reapply")

    async def _reapply_loop(self) -> None:
        """A replica restarted by its host (a crash, a container restart) comes back with its first head:
        put the pool's head back rather than serve an old one until the next swap."""
        while True:
            await asyncio.sleep(self.reapply_interval)
            if not self.pool.replicas[0].healthy:
                continue
            try:
                if await self.store.reapply():
                    log.warning("replica %s had restarted: head %s loaded again", self.replica_url,
                                self.store.recent[-1][:12])
            except Exception as exc:  # noqa: BLE001 - tried again next time
                log.warning("replica %s: reloading the head failed: %s", self.replica_url, exc)

    async def _stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await stop_server(self.server, self._task)
        await self.pool.close()
