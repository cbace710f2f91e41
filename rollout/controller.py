"""The controller daemon: keeps the pool on the registry's Production version.

Each poll (``[controller].poll_seconds``):

1. reconcile  the registry's champion (``Registry.sync`` first brings the alias
              ``champion`` and the stage Production together, whichever a person
              moved) → if any healthy replica serves another head sha256, ask the
              router to swap (``POST /admin/swap``: validate, canary, one by one,
              roll back on failure).
2. watch      live mean acceptance length over the pool (``/admin/status``,
              pooled over replicas by drafts) against the version's benchmarked
              value (its run's ``replay.candidate.mean_acceptance_length``):
              below ``rollback_fraction`` of it → make the previous champion the
              champion again (once per version); below ``drift_fraction`` →
              trigger the nightly DAG early (with a cooldown) through Airflow's
              REST API, retried ``[airflow] trigger_attempts`` times; a trigger that
              failed them all stays in the health report until one succeeds.

Every decision is one JSON log line (``event`` + fields) and kept in a ring the
health endpoint serves. Failures of MLflow or the router never end the loop: the
next poll is delayed with exponential backoff (capped) and health says degraded.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

import httpx

from rollout import registry as reg_mod
from rollout.airflow import NIGHTLY_DAG, AirflowClient, dag_ids, endpoint_from_config
from serving.admin import check_exposure
from settings.config import Config

log = logging.getLogger("adapt.controller")

BENCH_METRIC = "replay.candidate.mean_acceptance_length"
__all__ = ["BENCH_METRIC", "NIGHTLY_DAG", "Controller", "ControllerError", "airflow_trigger"]


class Controller:
    """Reconcile + watch loop, with a health endpoint. ``reconcile()`` is usable alone (one pass)."""

    def __init__(self, cfg: Config, *, router_url: str | None = None, admin_token: str | None = None,
                 poll_seconds: float | None = None, rollback_fraction: float | None = None,
                 min_live_drafts: float | None = None, max_backoff: float = 60.0,
                 trigger: Callable[[dict[str, Any]], Any] | None = None,
                 health_host: str = "127.0.0.1", health_port: int | None = None,
                 request_timeout: float = 600.0) -> None:
        # Fail fast inside a poll instead of MLflow's minutes of retries; the loop does the retrying.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        self.cfg = cfg
        self.router_url = (router_url or f"http://{cfg.serving.host}:{cfg.serving.router_port}").rstrip("/")
        token = admin_token if admin_token is not None else cfg.serving.resolved_admin_token()
        if health_port is not None:  # its events name versions, replicas and errors
            check_exposure(health_host, token, "the controller's health endpoint")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.poll = poll_seconds or cfg.controller.poll_seconds
        self.rollback_fraction = cfg.controller.rollback_fraction if rollback_fraction is None else rollback_fraction
        self.drift_fraction = cfg.controller.drift_fraction
        self.min_live_drafts = cfg.controller.min_live_drafts if min_live_drafts is None else min_live_drafts
        self.max_backoff = max_backoff
        self.trigger = trigger if trigger is not None else airflow_trigger(cfg)
        self.trigger_cooldown_s = cfg.controller.drift_cooldown_s
        self.trigger_attempts = cfg.airflow.trigger_attempts
        self.trigger_retry_s = cfg.airflow.trigger_retry_s
        # The early trigger in flight or last tried: {"state": "retrying"|"failed"|"ok", "attempts", ...}.
        self.trigger_state: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        self.request_timeout = request_timeout
        self.registry = reg_mod.Registry(cfg)
        self.events: deque[dict[str, Any]] = deque(maxlen=500)
        self.failures = 0
        self.last_ok: float | None = None
        self.last_error: str | None = None
        self.serving_version: str | None = None
        self.rolled_back: set[str] = set()
        self.last_trigger: float = 0.0
        self._bench_cache: dict[str, float | None] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http: ThreadingHTTPServer | None = None
        self.health_host, self.health_port = health_host, health_port
        self.polls = 0

    # -- events ------------------------------------------------------------------------

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        ev = {"ts": round(time.time(), 3), "event": kind, **fields}
        self.events.append(ev)
        log.info(json.dumps(ev, default=str))
        return ev

    # -- router ------------------------------------------------------------------------

    def pool_status(self) -> dict[str, Any]:
        r = httpx.get(self.router_url + "/admin/status", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()

    def _swap(self, version: str, served_before: bool = False) -> dict[str, Any]:
        # A version that already served (a rollback) is not judged on the smoke prompts' acceptance.
        r = httpx.post(self.router_url + "/admin/swap", headers=self.headers, timeout=self.request_timeout,
                       json={"head": self.registry.head_uri(version), "version": str(version),
                             "check_acceptance": not served_before})
        if r.status_code in (401, 403, 501):
            r.raise_for_status()
        return r.json()

    # -- one pass ----------------------------------------------------------------------

    def desired(self) -> Any | None:
        """The champion (alias and stage brought together first), or None when nothing serves."""
        version, moved = self.registry.sync_champion()
        if moved:
            self.event("registry_synced", **moved)
        return self.registry.get(version) if version is not None else None

    def reconcile(self) -> dict[str, Any]:
        """Make every healthy replica serve the Production version's head; returns the decision event."""
        prod = self.desired()
        if prod is None:
            return self.event("no_production", model=self.registry.name)
        version = prod.version
        want = prod.tags.get(reg_mod.T_SHA)
        st = self.pool_status()
        healthy = [r for r in st.get("replicas", []) if r.get("healthy")]
        if not healthy:
            return self.event("no_healthy_replica", version=version)
        stale = [r["url"] for r in healthy if not want or r.get("head_sha256") != want]
        if not stale:
            self.serving_version = version
            if not prod.tags.get(reg_mod.T_SERVED):
                self.registry.set_tags(version, {reg_mod.T_SERVED: "true"})
            return self.event("in_sync", version=version, sha256=want, replicas=len(healthy))
        if prod.tags.get(reg_mod.T_GATE) == "rejected":
            # A person moved a gate-rejected version to Production: the registry decides, but say so loudly.
            self.event("serving_rejected_version", level="warning", version=version,
                       reason=prod.tags.get(reg_mod.T_REASON))
        t0 = time.monotonic()
        rep = self._swap(version, served_before=bool(prod.tags.get(reg_mod.T_SERVED)))
        ev = self.event("swapped" if rep.get("ok") else "swap_failed", version=version, sha256=want,
                        stale=stale, mode=rep.get("mode"), seconds=round(time.monotonic() - t0, 3),
                        error=rep.get("error"), rolled_back=rep.get("rolled_back") or None)
        if rep.get("ok"):
            self.serving_version = version
            self.registry.set_tags(version, {reg_mod.T_SERVED: "true"})
        else:
            raise ControllerError(f"swap to version {version} failed: {rep.get('error')}")
        return ev

    def bench_value(self, version: str) -> float | None:
        """The version's benchmarked mean acceptance length (from its run), cached."""
        if self._bench_cache.get(version) is None:
            # Not cached while absent: a benchmark may be logged to the run later.
            mv = self.registry.get(version)
            if mv.run_id:
                self._bench_cache[version] = self.registry.client.get_run(mv.run_id).data.metrics.get(BENCH_METRIC)
        return self._bench_cache.get(version)

    @staticmethod
    def live_acceptance(status: dict[str, Any]) -> tuple[float | None, float]:
        """Pooled live mean acceptance length over replicas (weighted by drafts) and the drafts behind it."""
        drafts = accepted = 0.0
        for r in status.get("replicas", []):
            la = r.get("live_acceptance") or {}
            drafts += float(la.get("drafts") or 0.0)
            accepted += float(la.get("accepted_tokens") or 0.0)
        return (1.0 + accepted / drafts if drafts > 0 else None), drafts

    def watch(self) -> dict[str, Any] | None:
        """Roll back or trigger adaptation when live acceptance falls against the benchmark."""
        if self.serving_version is None:
            return None
        version = self.serving_version
        bench = self.bench_value(version)
        live, drafts = self.live_acceptance(self.pool_status())
        if bench is None or live is None or drafts < self.min_live_drafts:
            return None
        ratio = live / bench
        if ratio < self.rollback_fraction and version not in self.rolled_back:
            prev = self.registry.previous_production(version)
            self.rolled_back.add(version)
            if prev is None:
                return self.event("rollback_impossible", version=version, live=live, bench=bench,
                                  reason="no previous Production version recorded")
            reason = (f"auto rollback: live mean acceptance length {live:.3f} < "
                      f"{self.rollback_fraction} x benchmarked {bench:.3f}")
            self.registry.set_tags(version, {"adapt.rolled_back": reason})
            self.registry.promote(prev, reason=reason)
            ev = self.event("rollback", version=version, to=prev, live=live, bench=bench, ratio=ratio)
            self.reconcile()
            return ev
        if ratio < self.drift_fraction and time.time() - self.last_trigger > self.trigger_cooldown_s:
            self.last_trigger = time.time()
            ev = {"version": version, "live": live, "bench": bench, "ratio": ratio}
            result = None
            if self.trigger is not None:
                self._pending = {"ev": ev, "attempts": 0, "first_at": time.time()}
                result = self._attempt_trigger()
            return self.event("drift_trigger", **ev, result=result)
        return None

    def _attempt_trigger(self) -> Any:
        """One try of the pending early trigger; a failure is an event and, while tries remain, a retry
        ``trigger_retry_s`` later. Returns the DAG run id, or "trigger failed: ..."."""
        p = self._pending
        assert p is not None and self.trigger is not None
        p["attempts"] += 1
        try:
            run_id = self.trigger(p["ev"])
        except Exception as exc:  # noqa: BLE001 - a failed trigger is reported and retried, never fatal
            error = f"{type(exc).__name__}: {str(exc)[:500]}"
            left = self.trigger_attempts - p["attempts"]
            state = "retrying" if left > 0 else "failed"
            p["next_at"] = time.time() + self.trigger_retry_s
            self.trigger_state = {"state": state, "attempts": p["attempts"], "of": self.trigger_attempts,
                                  "last_error": error, "ts": round(time.time(), 3), "version": p["ev"]["version"]}
            if left > 0:
                self.event("drift_trigger_failed", level="warning", attempt=p["attempts"], of=self.trigger_attempts,
                           error=error, retry_in_s=self.trigger_retry_s)
            else:
                self._pending = None
                self.event("drift_trigger_gave_up", level="error", attempts=p["attempts"], error=error,
                           version=p["ev"]["version"])
            return (f"trigger failed: {error} (attempt {p['attempts']} of {self.trigger_attempts}"
                    + (f"; again in {self.trigger_retry_s:g} s)" if left > 0 else "; giving up)"))
        self._pending = None
        self.trigger_state = {"state": "ok", "attempts": p["attempts"], "dag_run_id": run_id,
                              "ts": round(time.time(), 3), "version": p["ev"]["version"]}
        if p["attempts"] > 1:
            self.event("drift_trigger_retried", attempt=p["attempts"], result=run_id)
        return run_id

    def retry_trigger(self) -> None:
        """Try a failed early trigger again once its retry is due (never raises)."""
        if self._pending is not None and time.time() >= self._pending.get("next_at", 0.0):
            self._attempt_trigger()

    def step(self) -> None:
        """One poll; raises on MLflow/router failures (the loop catches them)."""
        self.retry_trigger()
        self.reconcile()
        self.watch()

    # -- loop --------------------------------------------------------------------------

    def run(self, max_polls: int | None = None) -> None:
        """Poll until :meth:`stop` (or ``max_polls``); never raises out of a poll."""
        self.event("controller_started", router=self.router_url, model=self.registry.name,
                   tracking_uri=self.registry.tracking_uri, poll_seconds=self.poll)
        while not self._stop.is_set():
            self.polls += 1
            try:
                self.step()
                if self.failures:
                    self.event("recovered", after_failures=self.failures)
                self.failures, self.last_ok, self.last_error = 0, time.time(), None
                delay = self.poll
            except Exception as exc:  # noqa: BLE001 - outages must not end the daemon
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {str(exc)[:500]}"
                delay = min(self.max_backoff, self.poll * 2 ** min(self.failures - 1, 10)) * random.uniform(0.8, 1.2)
                self.event("error", level="error", error=self.last_error, failures=self.failures,
                           retry_in_s=round(delay, 2))
            if max_polls is not None and self.polls >= max_polls:
                break
            self._stop.wait(delay)
        self.event("controller_stopped")

    def health(self) -> dict[str, Any]:
        stale_after = max(3 * self.poll, self.max_backoff * 2)
        ok = self.failures == 0 and self.last_ok is not None and time.time() - self.last_ok < stale_after
        warnings = []
        if self.trigger_state and self.trigger_state["state"] != "ok":
            t = self.trigger_state
            warnings.append(f"the early Airflow trigger for version {t['version']} {t['state']} after "
                            f"{t['attempts']} of {t['of']} attempts: {t['last_error']}")
        # A failed trigger is a warning, not "degraded": the pool is still kept on the champion.
        return {"status": "ok" if ok else "degraded", "serving_version": self.serving_version,
                "failures": self.failures, "last_ok": self.last_ok, "last_error": self.last_error,
                "polls": self.polls, "router": self.router_url, "model": self.registry.name,
                "drift_trigger": self.trigger_state, "warnings": warnings,
                "last_event": self.events[-1] if self.events else None}

    def start(self) -> "Controller":
        """Run the loop (and the health server, if a port is set) in background threads."""
        if self.health_port is not None:
            self._http = _health_server(self, self.health_host, self.health_port)
            self.health_port = self._http.server_address[1]
            threading.Thread(target=self._http.serve_forever, name="controller-health", daemon=True).start()
        self._thread = threading.Thread(target=self.run, name="controller", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


class ControllerError(RuntimeError):
    pass


def _health_server(ctl: Controller, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            if self.path.startswith("/health"):
                body = ctl.health()
                code = 200 if body["status"] == "ok" else 503
            elif self.path.startswith("/events"):
                body, code = {"events": list(ctl.events)[-100:]}, 200
            else:
                body, code = {"error": "not found"}, 404
            data = json.dumps(body, default=str).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def airflow_trigger(cfg: Config) -> Callable[[dict[str, Any]], Any] | None:
    """Trigger this endpoint's nightly DAG through Airflow's REST API, when ``[airflow]`` names a server
    (or ``ADAPT_AIRFLOW_URL`` does); None otherwise. The client keeps its JWT fresh from the credentials."""
    endpoint = endpoint_from_config(cfg.airflow)
    if endpoint is None:
        return None
    client = AirflowClient(endpoint)
    dag_id = dag_ids(cfg.airflow.name)[0]

    def trigger(ev: dict[str, Any]) -> Any:
        return client.trigger_dag(dag_id, {"reason": "live acceptance drift", **ev})

    trigger.client = client  # type: ignore[attr-defined] - for status and tests
    return trigger
