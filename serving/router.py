"""OpenAI-compatible capturing router in front of the pool.

* ``/v1/chat/completions``, ``/v1/completions``: forwarded to the routable
  replica with the fewest outstanding requests; streams are passed through chunk
  by chunk. A replica that refuses the connection is marked unhealthy and the
  request is retried on another (nothing was sent, so this is safe).
* ``/v1/models``: from any routable replica.
* Every finished request is offered to the :class:`CaptureWriter` (sampled,
  non-blocking); streamed responses are captured as their SSE body.
* ``/metrics``: router and capture counters (Prometheus).
* ``/admin/*``: bearer-token protected (see ``serving.admin``); the router never
  forwards any other path, so replicas' ``/collective_rpc`` is unreachable here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable

import httpx
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.admin import make_auth_dependency
from serving.capture_writer import CaptureWriter
from serving.pool import Pool

log = logging.getLogger(__name__)
HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
               "authorization", "accept-encoding"}


class _CaptureCollector:
    """Exports the writer's counters at scrape time (no work on the request path)."""

    def __init__(self, writer: CaptureWriter | None) -> None:
        self.writer = writer

    def collect(self):
        c = CounterMetricFamily("adapt_capture_records", "Capture records by outcome", labels=["outcome"])
        q = GaugeMetricFamily("adapt_capture_queue_depth", "Capture records waiting to be written")
        if self.writer is not None:
            for k in ("written", "sampled_out", "dropped_queue_full", "dropped_write_error"):
                c.add_metric([k], self.writer.counts[k])
            q.add_metric([], self.writer.queue.qsize())
        yield c
        yield q


def _capture_line(payload: dict, response_body: bytes, response_ctype: str) -> str:
    from capture.records import make_capture_record

    if response_ctype.startswith("text/event-stream"):
        response: Any = response_body.decode("utf-8", "replace")
        rct = "text/event-stream"
    else:
        try:
            response = json.loads(response_body)
        except ValueError:
            response = response_body.decode("utf-8", "replace")
        rct = "application/json"
    return make_capture_record(payload, response, response_content_type=rct,
                               inference_time=datetime.now(timezone.utc))


def create_app(pool: Pool, *, writer: CaptureWriter | None = None, admin_token: str = "",
               swap_handler: Callable[[dict], Awaitable[dict]] | None = None,
               request_timeout: float = 600.0, status_window_s: float = 300.0,
               no_replica_wait: float = 30.0) -> FastAPI:
    """Build the router app. ``swap_handler(body)`` runs the swap protocol (``serving.swap``)."""
    reg = CollectorRegistry()
    requests_total = Counter("adapt_router_requests", "Requests by route and outcome", ["route", "outcome"],
                             registry=reg)
    retries_total = Counter("adapt_router_retries", "Requests retried on another replica", registry=reg)
    latency = Histogram("adapt_router_request_seconds", "Request latency through the router", ["route"],
                        registry=reg)
    outstanding = Gauge("adapt_router_outstanding", "Outstanding requests per replica", ["replica"],
                        registry=reg)
    reg.register(_CaptureCollector(writer))
    require_admin = make_auth_dependency(admin_token)
    state: dict[str, Any] = {"client": None}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=5.0), limits=limits)
        if writer is not None:
            writer.start()
        try:
            yield
        finally:
            await state["client"].aclose()

    app = FastAPI(title="drafter-adapt router", lifespan=lifespan)

    def _offer_capture(payload: dict, body: bytes, ctype: str, ok: bool) -> None:
        # Never let capture affect the user request: sampling and record building
        # are cheap and guarded; writing happens on the writer's own task.
        if writer is None or not ok:
            return
        try:
            if writer.sample():
                writer.offer(_capture_line(payload, body, ctype))
        except Exception:  # noqa: BLE001
            writer.counts["dropped_write_error"] += 1

    async def _forward(request: Request, path: str, route: str) -> Response:
        raw = await request.body()
        try:
            payload = json.loads(raw)
            if not isinstance(payload, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            requests_total.labels(route, "bad_request").inc()
            return JSONResponse({"error": {"message": f"invalid JSON body: {exc}", "type": "BadRequest"}}, 400)
        stream = bool(payload.get("stream"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        client: httpx.AsyncClient = state["client"]
        tried: set[str] = set()
        t0 = time.perf_counter()
        wait_until = time.monotonic() + no_replica_wait
        while True:
            r = pool.pick(tried)
            if r is None:
                # Briefly hold the request (e.g. the only other replica is mid-restart or
                # flapping) rather than fail it; retry replicas that recovered meanwhile.
                if time.monotonic() < wait_until:
                    await asyncio.sleep(0.2)
                    tried.clear()
                    continue
                requests_total.labels(route, "no_replica").inc()
                return JSONResponse({"error": {"message": "no healthy replica", "type": "ServiceUnavailable"}},
                                    503)
            tried.add(r.url)
            r.outstanding += 1
            outstanding.labels(r.url).set(r.outstanding)
            try:
                upstream = await client.send(client.build_request("POST", r.url + path, content=raw,
                                                                  headers=headers), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                r.outstanding -= 1
                r.healthy = False
                r.failures += 1
                r.last_error = f"connect: {exc}"
                retries_total.inc()
                continue
            except httpx.HTTPError as exc:
                r.outstanding -= 1
                r.failures += 1
                requests_total.labels(route, "upstream_error").inc()
                return JSONResponse({"error": {"message": f"upstream error: {exc}", "type": "BadGateway"}}, 502)
            break

        ctype = upstream.headers.get("content-type", "application/json")

        def _done(ok: bool, body: bytes) -> None:
            r.outstanding -= 1
            r.served += 1
            outstanding.labels(r.url).set(r.outstanding)
            requests_total.labels(route, "ok" if ok else f"http_{upstream.status_code}").inc()
            latency.labels(route).observe(time.perf_counter() - t0)
            _offer_capture(payload, body, ctype, ok)

        if not stream:
            try:
                body = await upstream.aread()
            except httpx.HTTPError as exc:
                r.outstanding -= 1
                r.failures += 1
                await upstream.aclose()
                requests_total.labels(route, "upstream_error").inc()
                return JSONResponse({"error": {"message": f"upstream error: {exc}", "type": "BadGateway"}}, 502)
            await upstream.aclose()
            _done(upstream.status_code == 200, body)
            return Response(body, status_code=upstream.status_code, media_type=ctype)

        async def relay():
            chunks: list[bytes] = []
            ok = upstream.status_code == 200
            try:
                async for chunk in upstream.aiter_raw():
                    chunks.append(chunk)
                    yield chunk
            except httpx.HTTPError:
                ok = False
                r.failures += 1
            finally:
                await upstream.aclose()
                _done(ok, b"".join(chunks))

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type=ctype,
                                 headers={"cache-control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _forward(request, "/v1/chat/completions", "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(request, "/v1/completions", "completions")

    @app.get("/v1/models")
    async def models() -> Response:
        client: httpx.AsyncClient = state["client"]
        tried: set[str] = set()
        while (r := pool.pick(tried)) is not None:
            tried.add(r.url)
            try:
                up = await client.get(r.url + "/v1/models", timeout=10.0)
                return Response(up.content, status_code=up.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return JSONResponse({"error": {"message": "no healthy replica"}}, 503)

    @app.get("/health")
    async def health() -> Response:
        n = sum(r.routable for r in pool.replicas)
        return JSONResponse({"routable_replicas": n}, 200 if n else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(reg), media_type="text/plain; version=0.0.4")

    # -- admin (token required) ---------------------------------------------------

    @app.get("/admin/status", dependencies=[Depends(require_admin)])
    async def admin_status() -> JSONResponse:
        await asyncio.gather(*(pool.refresh_head(r) for r in pool.replicas if r.healthy))
        st = pool.status(status_window_s)
        st["capture"] = dict(writer.counts, last_error=writer.last_error) if writer else None
        return JSONResponse(st)

    @app.post("/admin/drain", dependencies=[Depends(require_admin)])
    async def admin_drain(body: dict) -> JSONResponse:
        try:
            done = await pool.drain(body["url"], float(body.get("timeout", 120)))
        except KeyError:
            raise HTTPException(404, f"no replica {body.get('url')}") from None
        return JSONResponse({"url": body["url"], "drained": done})

    @app.post("/admin/undrain", dependencies=[Depends(require_admin)])
    async def admin_undrain(body: dict) -> JSONResponse:
        try:
            pool.undrain(body["url"])
        except KeyError:
            raise HTTPException(404, f"no replica {body.get('url')}") from None
        return JSONResponse({"url": body["url"], "draining": False})

    @app.post("/admin/swap", dependencies=[Depends(require_admin)])
    async def admin_swap(body: dict) -> JSONResponse:
        if swap_handler is None:
            raise HTTPException(501, "this router has no swap controller")
        report = await swap_handler(body)
        return JSONResponse(report, 200 if report.get("ok") else 409)

    return app
