"""Admin plane: bearer-token check and the controller's client for replicas' ``/collective_rpc``.

Only the pool controller talks to ``/collective_rpc`` (replicas bind to loopback);
users reach admin actions only through the router's ``/admin/*`` routes, which
require ``config.serving.resolved_admin_token()``. With no token configured every
admin route refuses, so weights can never change without authentication.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any

import httpx
from fastapi import Header, HTTPException


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


def make_auth_dependency(token: str):
    """FastAPI dependency that admits only ``Authorization: Bearer <token>``."""

    async def require_admin(authorization: str | None = Header(default=None)) -> None:
        if not token:
            raise HTTPException(403, "admin actions are disabled: no admin token is configured")
        if not authorization or not authorization.lower().startswith("bearer "):
            raise HTTPException(401, "admin bearer token required", headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(authorization[7:].strip().encode(), token.encode()):
            raise HTTPException(403, "invalid admin token")

    return require_admin


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
        on its own KV (tests/test_gate_e2e.py pins that the first pass after a swap drafts as
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
