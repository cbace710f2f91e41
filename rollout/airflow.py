"""Airflow 3's REST API as the controller uses it: a JWT traded for credentials and renewed before it
expires, and DAG runs triggered with it.

Where the API server and the credentials come from (``[airflow]``): ``url`` with ``username`` and
``password``, or ``connection``, the id of an Airflow connection in the environment
(``AIRFLOW_CONN_<ID>``, as a URI ``https://user:password@host:port`` or as JSON with ``host``, ``port``,
``login``, ``password`` and ``schema``), or a fixed ``token`` (which expires: Airflow's
``[api_auth] jwt_expiration_time``, a day by default).
"""

from __future__ import annotations

import base64
import datetime as _dt
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import unquote, urlsplit

import httpx

from settings.config import AirflowConfig

NIGHTLY_DAG = "drafter_nightly_adaptation"
RECONCILE_DAG = "drafter_reconcile"


def dag_ids(name: str = "") -> tuple[str, str]:
    """The nightly and reconcile DAG ids of the endpoint ``name`` ("" = the unsuffixed pair)."""
    suffix = f"_{name}" if name else ""
    return NIGHTLY_DAG + suffix, RECONCILE_DAG + suffix


class AirflowError(RuntimeError):
    pass


@dataclass(frozen=True)
class AirflowEndpoint:
    """An API server and how to authenticate to it (never printed: ``__repr__`` hides the secrets)."""

    url: str
    username: str = ""
    password: str = ""
    token: str = ""

    def __repr__(self) -> str:
        return f"AirflowEndpoint(url={self.url!r}, username={self.username!r}, password=***, token=***)"


def connection_endpoint(conn_id: str, environ: Mapping[str, str] | None = None) -> AirflowEndpoint:
    """The Airflow connection ``conn_id`` from ``AIRFLOW_CONN_<ID>`` (URI or JSON, as Airflow reads it)."""
    environ = os.environ if environ is None else environ
    var = "AIRFLOW_CONN_" + conn_id.upper()
    raw = environ.get(var, "").strip()
    if not raw:
        raise AirflowError(f"[airflow] connection = {conn_id!r}, but {var} is not set")
    if raw.startswith("{"):
        try:
            c = json.loads(raw)
        except ValueError as exc:
            raise AirflowError(f"{var} is neither a connection URI nor valid JSON: {exc}") from None
        host = str(c.get("host") or "")
        if not host:
            raise AirflowError(f"{var} has no host")
        if "://" not in host:
            scheme = c.get("schema") if c.get("schema") in ("http", "https") else (
                "https" if c.get("conn_type") == "https" else "http")
            host = f"{scheme}://{host}"
        url = host.rstrip("/") + (f":{c['port']}" if c.get("port") else "")
        return AirflowEndpoint(url, str(c.get("login") or ""), str(c.get("password") or ""))
    parts = urlsplit(raw)
    if not parts.hostname:
        raise AirflowError(f"{var} is not a connection URI with a host (e.g. https://user:password@host:8080)")
    scheme = "https" if parts.scheme in ("https",) else "http"
    netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
    return AirflowEndpoint(f"{scheme}://{netloc}{parts.path.rstrip('/')}", unquote(parts.username or ""),
                           unquote(parts.password or ""))


def endpoint_from_config(cfg: AirflowConfig, environ: Mapping[str, str] | None = None) -> AirflowEndpoint | None:
    """Where to reach Airflow, or None when nothing is configured (no early trigger)."""
    if cfg.connection:
        conn = connection_endpoint(cfg.connection, environ)
        return AirflowEndpoint(cfg.resolved_url() or conn.url, cfg.resolved_username() or conn.username,
                               cfg.resolved_password() or conn.password, cfg.resolved_token())
    url = cfg.resolved_url()
    if not url:
        return None
    return AirflowEndpoint(url, cfg.resolved_username(), cfg.resolved_password(), cfg.resolved_token())


def jwt_expiry(token: str) -> float | None:
    """The ``exp`` claim of a JWT (seconds since the epoch), read without verifying it; None if absent."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        return float(claims["exp"])
    except (IndexError, ValueError, KeyError, TypeError):
        return None


class AirflowClient:
    """Trigger DAG runs; with credentials, holds a JWT and renews it ``refresh_margin_s`` before it expires
    (or when the server refuses it)."""

    def __init__(self, endpoint: AirflowEndpoint, *, timeout: float = 30.0, refresh_margin_s: float = 60.0) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self.refresh_margin_s = refresh_margin_s
        self._token: str | None = None
        self._expires: float | None = None
        self._lock = threading.Lock()
        self.tokens_issued = 0

    @property
    def url(self) -> str:
        return self.endpoint.url

    def _new_token(self) -> str:
        r = httpx.post(f"{self.url}/auth/token", timeout=self.timeout,
                       json={"username": self.endpoint.username, "password": self.endpoint.password})
        if r.status_code >= 400:
            raise AirflowError(f"POST {self.url}/auth/token refused the credentials of "
                               f"{self.endpoint.username!r}: {r.status_code} {r.text[:200]}")
        try:
            token = r.json()["access_token"]
        except (ValueError, KeyError):
            raise AirflowError(f"POST {self.url}/auth/token answered without an access_token") from None
        self._token, self._expires = token, jwt_expiry(token)
        self.tokens_issued += 1
        return token

    def token(self, renew: bool = False) -> str | None:
        """The bearer token to send: a fresh or cached JWT with credentials, else the fixed one (or None)."""
        if not self.endpoint.username:
            return self.endpoint.token or None
        with self._lock:
            stale = self._expires is not None and time.time() > self._expires - self.refresh_margin_s
            if renew or self._token is None or stale:
                return self._new_token()
            return self._token

    def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        token = self.token()
        r = httpx.post(self.url + path, json=body, timeout=self.timeout,
                       headers={"Authorization": f"Bearer {token}"} if token else {})
        if r.status_code == 401 and self.endpoint.username:  # expired or revoked early: renew once
            token = self.token(renew=True)
            r = httpx.post(self.url + path, json=body, timeout=self.timeout,
                           headers={"Authorization": f"Bearer {token}"})
        return r

    def trigger_dag(self, dag_id: str, conf: dict[str, Any]) -> str:
        """Start a run of ``dag_id`` now with ``conf``; returns its dag_run_id."""
        path = f"/api/v2/dags/{dag_id}/dagRuns"
        r = self._post(path, {"logical_date": _dt.datetime.now(_dt.timezone.utc).isoformat(), "conf": conf})
        if r.status_code >= 400:
            raise AirflowError(f"POST {self.url}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json().get("dag_run_id")

    def health(self) -> dict[str, Any]:
        """The API server's public health route (no token)."""
        r = httpx.get(f"{self.url}/api/v2/monitor/health", timeout=self.timeout)
        r.raise_for_status()
        return r.json()
