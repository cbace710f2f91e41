"""Admin plane: bearer-token check and the controller's client for replicas' ``/collective_rpc``.

Only the pool controller talks to ``/collective_rpc`` (replicas bind to loopback);
users reach admin actions only through the router's ``/admin/*`` routes, which
require ``config.serving.resolved_admin_token()``. With no token configured every
admin route refuses, so weights can never change without authentication.
"""

from __future__ import annotations

import hmac
import ipaddress
import ssl
from typing import Any

import httpx
from fastapi import Header, HTTPException

from headspec.resolve import is_remote_ref


class RpcError(RuntimeError):
    """A replica's collective_rpc failed or a worker reported an error."""


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


class ReplicaAdmin:
    """Calls the ``serving.hotswap`` worker methods of one replica over its loopback RPC."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    async def rpc(self, method: str, *args: str | None, client: httpx.AsyncClient | None = None) -> list[Any]:
        body = {"method": method, "args": list(args), "timeout": self.timeout}
        own = client is None
        client = client or httpx.AsyncClient()
        try:
            r = await client.post(self.url + "/collective_rpc", json=body, timeout=self.timeout + 5)
        except httpx.HTTPError as exc:
            raise RpcError(f"{self.url}: collective_rpc {method} failed: {exc}") from exc
        finally:
            if own:
                await client.aclose()
        if r.status_code != 200:
            raise RpcError(f"{self.url}: collective_rpc {method} -> HTTP {r.status_code}: {r.text[:300]}")
        results = r.json().get("results") or []
        for res in results:
            if isinstance(res, dict) and res.get("error"):
                raise RpcError(f"{self.url}: {method}: {res['error']}")
        return results

    async def head_info(self) -> dict[str, Any]:
        return (await self.rpc("drafter_head_info"))[0]

    async def load_head(self, head_dir: str, version: str | None, sha256: str | None) -> dict[str, Any]:
        """Swap the head in place on every worker of the replica; return worker 0's report.

        Then the replica's prefix cache is reset: cached blocks hold KV that the previous
        head's drafter computed, and a new head drafting on them proposes other tokens than
        on its own KV (tests/loop/test_gate_e2e.py pins that the first pass after a swap drafts as
        on a fresh cache). Running requests are preempted and recomputed under the new head
        rather than failed.
        """
        results = await self.rpc("drafter_load_head", str(head_dir), version, sha256)
        shas = {r.get("sha256") for r in results}
        if sha256 and shas != {sha256}:
            raise RpcError(f"{self.url}: workers report sha256 {shas}, expected {sha256}")
        await self.reset_prefix_cache()
        return results[0]

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix block (and recompute running requests) on this replica."""
        try:
            async with httpx.AsyncClient() as client:
                r = await client.post(self.url + "/reset_prefix_cache", params={"reset_running_requests": "true"},
                                      timeout=self.timeout)
        except httpx.HTTPError as exc:
            raise RpcError(f"{self.url}: reset_prefix_cache failed: {exc}") from exc
        if r.status_code != 200 or not r.json().get("success"):
            raise RpcError(f"{self.url}: reset_prefix_cache -> HTTP {r.status_code}: {r.text[:300]}")

    async def param_digest(self) -> dict[str, str]:
        return (await self.rpc("drafter_param_digest"))[0]


class AgentAdmin:
    """The pool's client for an agent (``serving.agent``): bearer token, heads by URI, never by path.

    Same methods as :class:`ReplicaAdmin`, so the pool and the swap protocol treat both alike;
    ``load_head`` takes a URI the agent fetches itself (or ``None`` with the sha256 of a head the
    agent already holds, which is how a swap rolls an agent back).
    """

    def __init__(self, url: str, token: str, verify: ssl.SSLContext | bool = True, timeout: float = 900.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.verify = verify
        self.timeout = timeout

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
        """Have the agent fetch ``uri``, validate it and swap it in place (prefix cache reset)."""
        if uri is not None and not is_remote_ref(uri):
            raise RpcError(f"agent {self.url}: heads are sent to agents as URIs they fetch "
                           f"(models:/name/N, s3://bucket/prefix), not as the path {uri!r}")
        return await self._call("POST", "/agent/load", {"uri": uri, "version": version, "sha256": sha256})

    async def param_digest(self) -> dict[str, str]:
        return await self._call("GET", "/agent/param_digest")
