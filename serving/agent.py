"""The agent: the door of a replica, embedding its engine (``serving.embedded``).

Every replica the project starts runs inside it: the pool's and the bench's (on this host's
loopback, started by ``serving.replica``) and attached ones on other hosts or Kubernetes pods
(``adapt agent --embed -- vllm serve MODEL ...``, docs/deploy.md "Attached replicas"). It holds
vLLM's engine in-process and calls vLLM's weight-update protocol on it directly: no
``VLLM_SERVER_DEV_MODE``, so vLLM's unauthenticated dev routes (``/collective_rpc``, the
weight-update, sleep and cache routes) exist nowhere. Besides vLLM's own OpenAI app it serves:

* ``/agent/head``, ``/agent/load``, ``/agent/param_digest``, ``/agent/reset_prefix_cache``: the
  admin plane, bearer token (constant-time compare). ``load`` takes ``{"uri", "version", "sha256"}``:
  an attached agent fetches ``uri`` (``s3://``, ``models:/``, ``runs:/``) into its own heads
  directory, validates it against its local copy of the target (``headspec.validate``), swaps it in
  place through vLLM's weight-update protocol (``ReplicaAdmin``, which also resets the prefix cache)
  and reports the head. Nothing but the URI crosses the network: no path, no shared filesystem. A
  head the agent already holds (the one the replica started with, or one of its last downloads)
  may be named by ``sha256`` alone: that is how a pool rolls an agent back. A replica this host
  started (``local_paths``) takes the head directory's path instead, which the pool validated.

An attached agent requires ``Authorization: Bearer <token>`` on every route but ``/health``, and
off loopback refuses to start without a real token (``check_exposure``); a replica of this host's
pool binds loopback and requires the token on its admin routes.
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
from serving.admin import ReplicaAdmin, RpcError, bearer_status, make_auth_dependency

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
    one and those a pool may roll back to); older downloads are deleted. ``local_paths``: a replica
    of this host's pool, which also takes a head directory by absolute path (the pool validated it;
    the engine checks its sha256 and shapes before writing anything).
    """

    def __init__(self, admin: ReplicaAdmin, target_dir: str | Path, heads_dir: str | Path, *,
                 tracking_uri: str | None = None, s3_client_kwargs: dict[str, Any] | None = None,
                 keep: int = 3, local_paths: bool = False, registry_uri: str | None = None) -> None:
        self.admin = admin
        self.local_paths = local_paths
        self.target_dir = Path(target_dir)
        self.heads_dir = Path(heads_dir)
        self.tracking_uri = tracking_uri
        self.registry_uri = registry_uri or None
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
            if self.local_paths and req.uri and not is_remote_ref(req.uri):
                return await self._load_path(req)
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
                                                               self.tracking_uri, self.s3_client_kwargs,
                                                               self.registry_uri)
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

    async def _load_path(self, req: LoadRequest) -> dict[str, Any]:
        path = Path(str(req.uri))
        if not path.is_absolute() or not path.is_dir():
            raise AgentError(400, f"a head is loaded by the absolute path of its directory on this host, "
                                  f"not {req.uri!r}")
        try:
            got = await self.admin.load_head(str(path), req.version, req.sha256)
        except RpcError as exc:
            raise AgentError(409, str(exc)) from exc
        got["uri"] = None
        return got

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
    """``/agent/head``, ``/agent/load``, ``/agent/param_digest``, ``/agent/reset_prefix_cache`` on ``app``,
    bearer token required (with no token, every one refuses)."""
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

    @app.post("/agent/reset_prefix_cache", dependencies=[Depends(require)])
    async def reset_prefix_cache() -> JSONResponse:
        async def reset() -> dict[str, bool]:
            await store.admin.reset_prefix_cache()
            return {"success": True}
        return await answer(reset())
