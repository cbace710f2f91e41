"""Admin plane: bearer-token check and the controller's client for replicas' head swaps.

No replica serves vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE``: weight updates,
``/collective_rpc``, sleep, cache reset, all unauthenticated). Every replica the project starts
runs inside the agent that embeds its engine (``serving.embedded``), which calls vLLM's
weight-update protocol in-process (:class:`ReplicaAdmin` over a :class:`WeightSync`) and offers it
only as its ``/agent/*`` routes, behind a bearer token. The pool, the bench and the swap protocol
reach those routes with :class:`AgentAdmin`. Users reach admin actions only through the router's
``/admin/*`` routes, which require ``config.serving.resolved_admin_token()``; with no token
configured every admin route refuses, so weights can never change without authentication.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import json as _json
import ssl
import time
from pathlib import Path
from typing import Any, Protocol

import httpx
from fastapi import Header, HTTPException

from headspec.resolve import is_remote_ref


class RpcError(RuntimeError):
    """A replica refused or failed a call of its weight-update protocol (or an agent its admin call)."""


class ExposureError(RuntimeError):
    """A server would listen beyond loopback without a real admin token."""


MIN_TOKEN_CHARS = 24
# Values that ship in examples and compose files, or that people type: never a token off loopback.
WELL_KNOWN_TOKENS = frozenset({
    "changeme", "admin", "administrator", "password", "passw0rd", "secret", "token", "test", "testing", "default",
    "example", "letmein", "drafter", "drafteradapt", "adapt", "admintoken", "adaptadmintoken", "s3cret", "qwerty",
    "123456", "12345678", "none", "null", "dev", "development", "insecure",
})


def is_loopback(host: str) -> bool:
    """True for addresses only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname or "" (every interface): assume others can reach it


def token_weakness(token: str) -> str | None:
    """Why ``token`` is no real credential, or ``None`` if it may be one."""
    if not token:
        return "is empty"
    plain = "".join(c for c in token.lower() if c.isalnum())
    if plain in WELL_KNOWN_TOKENS or plain.startswith("changeme"):
        return "is a well-known value"
    if len(token) < MIN_TOKEN_CHARS:
        return f"has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}"
    if len(set(token)) < 8:
        return "repeats too few characters"
    return None


def check_exposure(host: str, token: str, what: str = "the router") -> None:
    """Refuse to serve beyond loopback unless the admin token is a real credential.

    On loopback an empty token is fine: every admin route then refuses (see
    :func:`make_auth_dependency`), and only this machine can connect anyway.
    """
    if is_loopback(host):
        return
    weakness = token_weakness(token)
    if weakness:
        raise ExposureError(
            f"refusing to start {what} on {host!r}, which is not loopback: the admin token {weakness}. "
            f"Set ADAPT_ADMIN_TOKEN (or [serving].admin_token) to a random value of at least {MIN_TOKEN_CHARS} "
            "characters, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`, "
            "or bind to 127.0.0.1.")


def url_is_loopback(url: str) -> bool:
    """Whether ``url``'s host is a loopback address."""
    return is_loopback(httpx.URL(url).host)


def bearer_status(authorization: str | None, token: str) -> tuple[int, str] | None:
    """``None`` when ``authorization`` is ``Bearer <token>`` (compared in constant time), else (status, why)."""
    if not token:
        return 403, "admin actions are disabled: no admin token is configured"
    if not authorization or not authorization.lower().startswith("bearer "):
        return 401, "admin bearer token required"
    if not hmac.compare_digest(authorization[7:].strip().encode(), token.encode()):
        return 403, "invalid admin token"
    return None


def make_auth_dependency(token: str):
    """FastAPI dependency that admits only ``Authorization: Bearer <token>``."""

    async def require_admin(authorization: str | None = Header(default=None)) -> None:
        refused = bearer_status(authorization, token)
        if refused:
            raise HTTPException(*refused, headers={"WWW-Authenticate": "Bearer"} if refused[0] == 401 else None)

    return require_admin


def tls_verify(ca_file: str = "") -> ssl.SSLContext | bool:
    """What httpx verifies https peers with: ``ca_file``'s CAs, or the system's trust store."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else True


class WeightSync(Protocol):
    """vLLM's weight-update protocol on one replica, called in the process that embeds its engine
    (``serving.embedded.EngineWeightSync``); never over vLLM's dev-mode HTTP routes."""

    async def pause(self) -> None: ...
    async def start_draft(self) -> None: ...
    async def update(self, update_info: dict[str, Any]) -> None: ...
    async def finish(self, weight_version: str) -> None: ...
    async def resume(self) -> None: ...
    async def reset_prefix_cache(self) -> None: ...
    async def weight_version(self) -> str: ...
    async def launch_spec(self) -> dict[str, Any]: ...
    async def target_checksums(self) -> dict[str, str]: ...


def encode_version(head: dict[str, Any]) -> str:
    """The ``weight_version`` a replica carries after a swap: the head's identity, as compact JSON."""
    keys = ("path", "sha256", "version", "swaps", "last_swap_ms")
    return _json.dumps({k: head.get(k) for k in keys}, separators=(",", ":"))


def decode_version(text: str) -> dict[str, Any] | None:
    """The head identity in a ``weight_version``, or None (vLLM's own "default": the launch head)."""
    try:
        got = _json.loads(text)
    except ValueError:
        return None
    return got if isinstance(got, dict) and "sha256" in got else None


@functools.lru_cache(maxsize=64)
def _launch_identity(path: str, size: int, mtime_ns: int) -> tuple[str | None, str | None]:
    from headspec.files import WEIGHTS, sha256_file

    d = Path(path)
    version = None
    try:
        version = _json.loads((d / "manifest.json").read_text()).get("version")
    except (OSError, ValueError):
        pass
    return sha256_file(d / WEIGHTS), version


def launch_identity(path: str) -> tuple[str | None, str | None]:
    """sha256 of a head's weights and its manifest version (hashed once per file size and mtime)."""
    from headspec.files import WEIGHTS

    try:
        st = (Path(path) / WEIGHTS).stat()
    except OSError:
        return None, None
    return _launch_identity(str(path), st.st_size, st.st_mtime_ns)


class ReplicaAdmin:
    """Swaps one replica's head in place through vLLM's weight-update protocol and reports it.

    ``load_head``: pause (mode keep) → start_draft_weight_update → update_weights with the head's
    path and sha256 (``serving.head_transfer`` loads it in every worker) → finish_weight_update with
    the head's identity as ``weight_version`` → reset the prefix cache → resume (always). The head a
    replica serves is read back from its ``weight_version``; vLLM's ``"default"`` means the head it
    was launched with (read from its config).
    """

    def __init__(self, sync: WeightSync) -> None:
        if isinstance(sync, str):
            raise TypeError("a replica's weight-update protocol is reached through its agent (AgentAdmin), "
                            "never over vLLM's dev-mode HTTP routes")
        self.sync = sync
        self.url = getattr(self.sync, "url", "engine")

    async def head_info(self) -> dict[str, Any]:
        raw = await self.sync.weight_version()
        head = decode_version(raw)
        launch = await self.sync.launch_spec()
        if head is None:
            path = launch.get("model")
            sha, version = launch_identity(path) if path else (None, None)
            head = {"path": path, "sha256": sha, "version": version, "swaps": 0, "last_swap_ms": None}
        head["num_speculative_tokens"] = launch.get("num_speculative_tokens")
        return head

    async def load_head(self, head_dir: str, version: str | None, sha256: str | None) -> dict[str, Any]:
        """Swap the head in place on every worker of the replica; return what it now serves.

        The prefix cache is reset before requests go on: cached blocks hold KV that the previous
        head's drafter computed, and a new head drafting on them proposes other tokens than on its
        own KV (tests/loop/test_gate_e2e.py pins that the first pass after a swap drafts as on a
        fresh cache). Running requests are recomputed under the new head rather than failed.
        """
        from headspec.files import WEIGHTS, sha256_file

        steps: dict[str, float] = {}

        async def step(name: str, coro) -> Any:
            t = time.perf_counter()
            try:
                return await coro
            finally:
                steps[name] = round((time.perf_counter() - t) * 1000.0, 1)

        # Only the swap count is read before (vLLM's "default": the launch head, no swap yet).
        before = decode_version(await step("weight_info", self.sync.weight_version())) or {}
        sha = sha256 or await asyncio.to_thread(sha256_file, Path(head_dir) / WEIGHTS)
        await step("pause", self.sync.pause())
        try:
            try:
                await step("start_draft_weight_update", self.sync.start_draft())
            except RpcError as exc:
                if "already active" not in str(exc):
                    raise
                # A session an earlier caller left open (it died mid-swap): close it and start again.
                await self.sync.finish(encode_version(before) if before else "default")
                await step("start_draft_weight_update", self.sync.start_draft())
            await step("update_weights", self.sync.update({"path": str(head_dir), "sha256": sha}))
            head = {"path": str(head_dir), "sha256": sha, "version": version,
                    "swaps": int(before.get("swaps") or 0) + 1, "last_swap_ms": steps["update_weights"]}
            await step("finish_weight_update", self.sync.finish(encode_version(head)))
            await step("reset_prefix_cache", self.sync.reset_prefix_cache())
        finally:
            await step("resume", self.sync.resume())
        # What the replica now reports is read back by the caller (the swap protocol checks it).
        return {**head, "steps_ms": steps}

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix block (and recompute running requests) on this replica."""
        await self.sync.reset_prefix_cache()

    async def param_digest(self) -> dict[str, str]:
        """One sha256 over the target's per-tensor checksums (vLLM's weight checker)."""
        sums = await self.sync.target_checksums()
        h = hashlib.sha256()
        for k in sorted(sums):
            h.update(f"{k}={sums[k]};".encode())
        return {"target": h.hexdigest()}


class AgentAdmin:
    """The client of an agent's ``/agent/*`` routes (``serving.agent``, ``serving.embedded``): bearer token.

    Same methods as :class:`ReplicaAdmin`, so the pool and the swap protocol treat every replica
    alike. An agent on another host (``local=False``) takes heads by URI, which it fetches itself,
    never by path (or ``None`` with the sha256 of a head it already holds, which is how a swap rolls
    it back). A replica this host started (``local=True``: the pool's, the bench's) shares the
    filesystem and takes the head directory's path.
    """

    def __init__(self, url: str, token: str, verify: ssl.SSLContext | bool = True, timeout: float = 900.0,
                 local: bool = False) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.verify = verify
        self.timeout = timeout
        self.local = local

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            async with httpx.AsyncClient(verify=self.verify) as client:
                r = await client.request(method, self.url + path, json=body, headers=self.headers,
                                         timeout=self.timeout)
        except httpx.HTTPError as exc:
            raise RpcError(f"agent {self.url}: {path} failed: {exc}") from exc
        if r.status_code != 200:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise RpcError(f"agent {self.url}: {path} -> HTTP {r.status_code}: {str(detail)[:500]}")
        return r.json()

    async def head_info(self) -> dict[str, Any]:
        return await self._call("GET", "/agent/head")

    async def load_head(self, uri: str | None, version: str | None, sha256: str | None) -> dict[str, Any]:
        """Have the agent fetch ``uri`` (a local replica: load the directory ``uri``), validate it and swap it
        in place (prefix cache reset)."""
        if uri is not None and not self.local and not is_remote_ref(uri):
            raise RpcError(f"agent {self.url}: heads are sent to agents as URIs they fetch "
                           f"(models:/name/N, s3://bucket/prefix), not as the path {uri!r}")
        return await self._call("POST", "/agent/load", {"uri": uri, "version": version, "sha256": sha256})

    async def param_digest(self) -> dict[str, str]:
        return await self._call("GET", "/agent/param_digest")

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix block (and recompute running requests) on the agent's replica."""
        await self._call("POST", "/agent/reset_prefix_cache")
