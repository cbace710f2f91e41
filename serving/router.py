"""OpenAI-compatible capturing router in front of the pool.

* ``/v1/chat/completions``, ``/v1/completions``: forwarded to the routable
  replica with the fewest outstanding requests; streams are passed through chunk
  by chunk. A replica that refuses the connection is marked unhealthy and the
  request is sent to another (nothing reached it). A replica that drops a request
  before the client got any byte of the answer (it crashed: a reset or closed
  connection) is marked unhealthy too, and a replica that answers 5xx (vLLM's
  ``EngineDeadError`` answer is a 500) is counted as failing; either way the request
  is retried on another replica after a backoff, each replica at most once and at
  most as many sends as the pool has replicas, as Envoy's retry-on-reset and
  retry-on-5xx do. A whole answer, or a stream's first chunk, is read before anything
  is sent to the client, so a replica that fails before it is a retry; generation
  has no side effect, so running it again is safe. Only streams that had started
  fail with their replica; when every try failed, the client gets the last replica's
  5xx answer as it came, or 502 after a reset.
* ``/v1/models``: from any routable replica.
* Every finished request is offered to the :class:`CaptureWriter` (sampled,
  non-blocking); streamed responses are captured as their SSE body.
* Token-exact capture (``capture_token_ids``): the router asks the replica for vLLM's
  ``return_token_ids``, captures the answer with the prompt's and output's token ids, and gives
  the client the answer it would have had without them (``serving.token_ids``). A replica that
  refuses the field (a 400 or 422 naming it: not vLLM) gets the request again without it, and
  is not asked again for :data:`TOKEN_IDS_RETRY_S`.
* ``/metrics``: router and capture counters (Prometheus).
* ``/admin/*``: bearer-token protected (see ``serving.admin``); the router never
  forwards any other path, so replicas' dev-mode routes (weight updates, ``/collective_rpc``)
  are unreachable here.

Limits (a client must not hold resources for nothing, nor reach the replicas with more
than a request): a body over ``max_body_bytes`` gets 413; headers must arrive within
``header_timeout`` and a body within ``body_timeout`` of them, else 408 and the
connection is closed (:func:`server_config`); a body that is not UTF-8 JSON, or is
nested too deeply to parse, gets 400; only :data:`FORWARD_HEADERS` reach a replica
(no cookies, API keys or forwarding headers); no OpenAPI docs are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable

import httpx
import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.admin import make_auth_dependency
from serving.capture_writer import CaptureWriter
from serving.pool import Pool, Replica
from serving.token_ids import StreamStripper, names_field, strip_json, wants_ids, with_ids
from serving.upstream import UpstreamClient

log = logging.getLogger(__name__)
# Request headers passed to a replica; everything else (cookies, credentials, X-Forwarded-*,
# accept-encoding: capture needs the plain body) stays here.
# What a replica that dies mid-request looks like from here (a reset or closed connection); a
# timeout is not one of them: the replica may just be slow, and a retry would double its work.
RESET_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# The longest backoff before a retry: the first waits retry_backoff (0.5-1x, jittered so that the
# requests of a replica that died do not all land on the next one at the same instant), each next twice.
MAX_RETRY_BACKOFF_S = 2.0
# How long a replica that refused ``return_token_ids`` is sent requests without it before it is asked
# again (it may have been replaced by one that knows the field).
TOKEN_IDS_RETRY_S = 600.0
FORWARD_HEADERS = frozenset({"content-type", "accept", "user-agent", "x-request-id", "traceparent", "tracestate"})


def body_limit(app: Any, max_bytes: int, drain_bytes: int | None = None) -> Any:
    """ASGI wrapper: 413 for a body over ``max_bytes``, declared (Content-Length) or streamed.

    The rest of the body is read and dropped before the 413 goes out (up to ``drain_bytes``,
    default four times the limit and at least 64 MiB; the body deadline bounds the time): a
    server that answers and closes while the client is still sending resets the connection, and
    the client sees that reset instead of the answer. A client that asked ``Expect: 100-continue``
    has sent nothing yet and gets its 413 at once. A streamed body is refused by an
    HTTPException from ``receive``, which FastAPI answers wherever the body is read.
    """
    drain_cap = drain_bytes if drain_bytes is not None else max(4 * max_bytes, 64 << 20)

    async def drain(receive: Callable, seen: int, more: bool) -> None:
        while more and seen <= drain_cap:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)

    async def guarded(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > max_bytes:
            if headers.get(b"expect", b"").lower() != b"100-continue":
                await drain(receive, 0, True)
            await JSONResponse(_too_large(max_bytes), 413, headers={"connection": "close"})(scope, receive, send)
            return
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                await drain(receive, seen, message.get("more_body", False))
                raise HTTPException(413, _too_large(max_bytes)["error"]["message"], headers={"connection": "close"})
            return message

        await app(scope, limited, send)

    return guarded


def hot_routes(app: Any, routes: dict[str, Callable[[Request], Awaitable[Response]]]) -> Any:
    """ASGI wrapper: a POST to one of ``routes`` goes straight to its handler; the rest to ``app``.

    FastAPI's routing, dependency and exception layers cost a request more than a replica's answer
    takes to relay; the forwarded routes need none of them. Their errors are answered as FastAPI
    would: an HTTPException (a body over the limit, raised by ``receive``) as ``{"detail": ...}``, and
    anything else by the server-error middleware outside this one (500).
    """
    async def dispatch(scope: dict, receive: Callable, send: Callable) -> None:
        handler = routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await handler(request)
        except HTTPException as exc:
            response = JSONResponse({"detail": exc.detail}, exc.status_code, headers=exc.headers)
        await response(scope, receive, send)

    return dispatch


def _too_large(max_bytes: int) -> dict:
    return {"error": {"message": f"request body over {max_bytes} bytes", "type": "PayloadTooLarge"}}


class _Deadlines:
    """Mixed into uvicorn's HTTP protocol: a request's headers must arrive within ``header_timeout``
    of its first byte (or of the connection), and its body within ``body_timeout`` of its headers;
    else 408 and the connection is closed. uvicorn has no such limit, so a client sending slowly
    would hold a socket and a task as long as it liked."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._deadline: asyncio.TimerHandle | None = None
        self._awaited: Any = None
        self._arm(self.header_timeout)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._late)
        self._awaited = self.cycle  # headers: a new cycle ends the wait; a body: this cycle's last byte

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if self._deadline is None and idle:
            self._arm(self.header_timeout)  # the next request's first bytes (or a body no one reads)
        super().data_received(data)  # type: ignore[misc]
        c = self.cycle
        if self._deadline is None or c is None:
            return
        if c is not self._awaited:  # headers complete
            if c.more_body and not c.response_complete:
                self._arm(self.body_timeout)
            else:
                self._disarm()
        elif not c.more_body or c.response_complete:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _late(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        c = self.cycle
        if c is None or c.response_complete or not c.response_started:
            msg = b"request not received in time"
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\n"
                                 b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(msg), msg))
        self.transport.close()


def server_config(app: Any, host: str, port: int, *, header_timeout: float = 10.0, body_timeout: float = 30.0,
                  **kwargs: Any) -> uvicorn.Config:
    """uvicorn settings for the router: its HTTP protocol with the request deadlines of :class:`_Deadlines`."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # httptools is optional for uvicorn; h11 is not
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    protocol = type("RouterHTTP", (_Deadlines, base), {"header_timeout": header_timeout, "body_timeout": body_timeout})
    return uvicorn.Config(app, host=host, port=port, http=protocol, **kwargs)


class _CaptureCollector:
    """Exports the writer's counters at scrape time (no work on the request path)."""

    def __init__(self, writer: CaptureWriter | None) -> None:
        self.writer = writer

    def collect(self):
        c = CounterMetricFamily("adapt_capture_records", "Capture records by outcome", labels=["outcome"])
        q = GaugeMetricFamily("adapt_capture_queue_depth", "Capture records waiting to be written")
        if self.writer is not None:
            for k in ("written", "sampled_out", "dropped_queue_full", "dropped_write_error", "dropped_bad_record"):
                c.add_metric([k], self.writer.counts[k])
            q.add_metric([], self.writer.queue.qsize())
        yield c
        yield q


def _capture_line(payload: dict, response_body: bytes, response_ctype: str) -> str:
    from capture.records import make_capture_record

    # The answer is kept as the replica's text: a record's data is text either way, and parsing a JSON
    # answer only to write it again would be most of the record's cost on the router's event loop.
    rct = "text/event-stream" if response_ctype.startswith("text/event-stream") else "application/json"
    return make_capture_record(payload, response_body.decode("utf-8", "replace"), response_content_type=rct,
                               inference_time=datetime.now(timezone.utc))


def create_app(pool: Pool, *, writer: CaptureWriter | None = None, admin_token: str = "",
               swap_handler: Callable[[dict], Awaitable[dict]] | None = None,
               request_timeout: float = 600.0, connect_timeout: float = 5.0, retry_backoff: float = 0.05,
               status_window_s: float = 300.0, no_replica_wait: float = 30.0, max_body_bytes: int = 8 << 20,
               upstream_metrics: bool = False, capture_token_ids: bool = True) -> FastAPI:
    """Build the router app. ``swap_handler(body)`` runs the swap protocol (``serving.swap``).

    ``request_timeout``: seconds a replica may send nothing (before its answer's headers, or between
    two parts of it) before the request fails; ``connect_timeout``: seconds to open a connection.
    ``retry_backoff``: the wait before the first retry of a request a replica dropped or answered
    5xx (see the module doc); a replica that refuses the connection is skipped at once, since
    nothing reached it.

    ``upstream_metrics``: ``/metrics`` starts with the replicas' own expositions (an agent's one
    replica: the pool that attaches the agent reads its spec-decode counters there).

    ``capture_token_ids``: ask replicas for token ids on the requests the writer may capture (see the
    module doc); nothing changes for a router without a writer.

    Serve it with :func:`server_config` for the header and body deadlines.
    """
    reg = CollectorRegistry()
    requests_total = Counter("adapt_router_requests", "Requests by route and outcome", ["route", "outcome"],
                             registry=reg)
    retries_total = Counter("adapt_router_retries", "Requests retried on another replica, by why",
                            ["reason"], registry=reg)
    latency = Histogram("adapt_router_request_seconds", "Request latency through the router", ["route"],
                        registry=reg)
    outstanding = Gauge("adapt_router_outstanding", "Outstanding requests per replica", ["replica"],
                        registry=reg)
    reg.register(_CaptureCollector(writer))
    require_admin = make_auth_dependency(admin_token)
    state: dict[str, Any] = {"client": None}
    # Replica URL -> when it may be asked for token ids again, for replicas that refused the field.
    no_token_ids: dict[str, float] = {}
    ask_ids = capture_token_ids and writer is not None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        # Connections taken in O(1), requests sent without httpx's client layers (serving.upstream):
        # httpx's own pool costs more per request the more requests are in flight.
        state["client"] = UpstreamClient(timeout=httpx.Timeout(request_timeout, connect=connect_timeout),
                                         verify=pool.verify)
        if writer is not None:
            writer.start()
        try:
            yield
        finally:
            await state["client"].aclose()

    # No /docs, /redoc or /openapi.json: they map the admin plane for anyone who asks.
    app = FastAPI(title="drafter-adapt router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    hot: dict[str, Callable[[Request], Awaitable[Response]]] = {}  # filled below, once the handlers exist
    app.add_middleware(hot_routes, routes=hot)
    app.add_middleware(body_limit, max_bytes=max_body_bytes)  # added last: outside hot_routes

    def _offer_capture(payload: dict, body: bytes, ctype: str, ok: bool, drawn: bool) -> None:
        # Never let capture affect the user request: sampling and record building
        # are cheap and guarded; writing happens on the writer's own task.
        if writer is None or not ok:
            return
        try:
            if writer.sample(drawn):
                writer.offer(_capture_line(payload, body, ctype))
        except Exception:  # noqa: BLE001
            writer.counts["dropped_write_error"] += 1

    async def _forward(request: Request, path: str, route: str) -> Response:
        raw = await request.body()
        try:
            payload = json.loads(raw.decode("utf-8"))  # UTF-8 only: json.loads(bytes) would take UTF-16/32
            if not isinstance(payload, dict):
                raise ValueError("body must be a JSON object")
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            requests_total.labels(route, "bad_request").inc()
            why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            return JSONResponse({"error": {"message": f"invalid JSON body: {why}", "type": "BadRequest"}}, 400)
        stream = bool(payload.get("stream"))
        # Sampled when it arrives: only a request to be captured asks the replica for token ids; the
        # replica's answer is then captured whole and the client's has them stripped.
        drawn = writer is not None and writer.draw()
        ids_body = with_ids(raw, payload) if ask_ids and drawn and wants_ids(payload) else None
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        client: httpx.AsyncClient = state["client"]
        tried: set[str] = set()
        retries = 0
        # What the client gets if no other replica may be tried: the last failure's own answer.
        give_up: Response | None = None
        t0 = time.perf_counter()
        wait_until = time.monotonic() + no_replica_wait

        def _drop(r: Replica, why: str) -> None:
            r.outstanding -= 1
            outstanding.labels(r.url).set(r.outstanding)
            r.failures += 1
            r.last_error = why

        def _retry(reason: str) -> bool:
            """A replica failed the request before the client got a byte: True if it may go to another
            (at most one send per replica of the pool)."""
            nonlocal retries
            if retries + 1 >= len(pool.replicas):
                return False
            retries += 1
            retries_total.labels(reason).inc()
            return True

        def _reset(r: Replica, exc: Exception) -> bool:
            # It dropped the request (it crashed): out of rotation until its health check says otherwise.
            _drop(r, f"reset: {type(exc).__name__}: {exc}")
            r.healthy = False
            return _retry("reset")

        def _bad_gateway(exc: Exception) -> JSONResponse:
            requests_total.labels(route, "upstream_error").inc()
            return _bad_gateway_answer(exc)

        while True:
            r = pool.pick(tried)
            if r is None:
                if give_up is not None:  # a retry is due but no other replica is routable
                    requests_total.labels(route, "upstream_error" if give_up.status_code == 502
                                          else f"http_{give_up.status_code}").inc()
                    return give_up
                # Briefly hold the request (e.g. the only other replica is mid-restart or
                # flapping) rather than fail it; retry replicas that recovered meanwhile.
                if time.monotonic() < wait_until:
                    await asyncio.sleep(0.2)
                    tried.clear()
                    continue
                requests_total.labels(route, "no_replica").inc()
                return JSONResponse({"error": {"message": "no healthy replica", "type": "ServiceUnavailable"}},
                                    503)
            if give_up is not None:  # a retry: back off first
                await asyncio.sleep(min(retry_backoff * 2 ** (retries - 1), MAX_RETRY_BACKOFF_S)
                                    * random.uniform(0.5, 1.0))
                give_up = None
            tried.add(r.url)
            r.outstanding += 1
            outstanding.labels(r.url).set(r.outstanding)
            injected = ids_body is not None and no_token_ids.get(r.url, 0.0) <= time.monotonic()
            prefetched: bytes | None = None
            try:
                upstream = await client.send(client.build_request("POST", r.url + path,
                                                                  content=ids_body if injected else raw,
                                                                  headers={**headers, **r.headers}), stream=True)
                if injected and upstream.status_code in (400, 422):
                    prefetched = await upstream.aread()
                    if names_field(prefetched):
                        # Maybe a replica that does not know the field: ask again without it. The client
                        # gets that answer, whatever it is, as it would have without the router's field.
                        await upstream.aclose()
                        injected, prefetched = False, None
                        upstream = await client.send(client.build_request(
                            "POST", r.url + path, content=raw, headers={**headers, **r.headers}), stream=True)
                        retries_total.labels("token_ids_refused").inc()
                        if upstream.status_code < 400:  # it was the field: leave this replica alone for a while
                            no_token_ids[r.url] = time.monotonic() + TOKEN_IDS_RETRY_S
                            log.warning("replica %s refused return_token_ids: its requests are captured without "
                                        "token ids for %.0f s", r.url, TOKEN_IDS_RETRY_S)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                # Nothing reached the replica: always safe to send elsewhere.
                r.outstanding -= 1
                outstanding.labels(r.url).set(r.outstanding)
                r.healthy = False
                r.failures += 1
                r.last_error = f"connect: {exc}"
                retries_total.labels("connect").inc()
                continue
            except RESET_ERRORS as exc:
                if _reset(r, exc):
                    give_up = _bad_gateway_answer(exc)
                    continue
                return _bad_gateway(exc)
            except httpx.HTTPError as exc:
                r.outstanding -= 1
                outstanding.labels(r.url).set(r.outstanding)
                r.failures += 1
                return _bad_gateway(exc)
            # Read the whole answer (or a stream's first chunk) before the client gets any byte of
            # it, so a replica that dies meanwhile, or answers 5xx, costs a retry, not the request.
            failing = upstream.status_code >= 500
            chunks = upstream.aiter_raw() if prefetched is None and not failing else _no_chunks()
            try:
                if prefetched is not None:
                    first = body = prefetched
                elif stream and not failing:
                    first = await anext(chunks, b"")
                    if first.startswith(b'data: {"error"') and (code := _stream_error_code(first)) >= 500:
                        # vLLM's stream whose engine died before its first token: a 200 whose first
                        # event is the error; the client has nothing yet, so it is a 5xx like another.
                        failing, body = True, first
                else:
                    first = body = await upstream.aread()
            except RESET_ERRORS as exc:
                await upstream.aclose()
                if _reset(r, exc):
                    give_up = _bad_gateway_answer(exc)
                    continue
                return _bad_gateway(exc)
            except httpx.HTTPError as exc:
                await upstream.aclose()
                r.outstanding -= 1
                outstanding.labels(r.url).set(r.outstanding)
                r.failures += 1
                return _bad_gateway(exc)
            if failing:
                status = upstream.status_code if upstream.status_code >= 500 else code
                why = f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"
                if _retry("http_5xx"):
                    await upstream.aclose()
                    _drop(r, why)
                    give_up = (Response(body, status_code=status, media_type=upstream.headers.get(
                        "content-type", "application/json")) if upstream.status_code >= 500
                        else _stream_error_answer(body, status))
                    continue
                r.failures += 1  # the last try: its answer goes to the client as it came
                r.last_error = why
            break

        ctype = upstream.headers.get("content-type", "application/json")
        # Only a successful answer carries ids; an error is passed on as it came.
        strip = injected and upstream.status_code == 200

        def _done(ok: bool, body: bytes) -> None:
            r.outstanding -= 1
            r.served += 1
            outstanding.labels(r.url).set(r.outstanding)
            requests_total.labels(route, "ok" if ok else f"http_{upstream.status_code}").inc()
            latency.labels(route).observe(time.perf_counter() - t0)
            _offer_capture(payload, body, ctype, ok, drawn)

        if not stream:
            await upstream.aclose()
            _done(upstream.status_code == 200, body)
            return Response(strip_json(body) if strip else body, status_code=upstream.status_code, media_type=ctype)

        stripper = StreamStripper(drop_held_back=route == "chat") if strip else None

        async def relay():
            got: list[bytes] = [first] if first else []
            ok = upstream.status_code == 200 and not failing
            try:
                if stripper is None:
                    if first:
                        yield first
                    async for chunk in chunks:
                        got.append(chunk)
                        yield chunk
                else:
                    if first and (out := stripper.feed(first)):
                        yield out
                    async for chunk in chunks:
                        got.append(chunk)
                        if out := stripper.feed(chunk):
                            yield out
                    if out := stripper.flush():
                        yield out
            except httpx.HTTPError:
                ok = False
                r.failures += 1
                # Abort the client's connection: a stream that simply ended would pass for a whole one.
                raise
            finally:
                await upstream.aclose()
                _done(ok, b"".join(got))

        return StreamingResponse(relay(), status_code=upstream.status_code, media_type=ctype,
                                 headers={"cache-control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _forward(request, "/v1/chat/completions", "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(request, "/v1/completions", "completions")

    hot.update({"/v1/chat/completions": chat, "/v1/completions": completions})

    @app.get("/v1/models")
    async def models() -> Response:
        client: httpx.AsyncClient = state["client"]
        tried: set[str] = set()
        while (r := pool.pick(tried)) is not None:
            tried.add(r.url)
            try:
                up = await client.get(r.url + "/v1/models", timeout=10.0, headers=r.headers)
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
        own = generate_latest(reg)
        if not upstream_metrics:
            return Response(own, media_type="text/plain; version=0.0.4")
        client: httpx.AsyncClient = state["client"]
        parts = []
        for r in pool.replicas:
            try:
                up = await client.get(r.url + "/metrics", timeout=30.0, headers=r.headers)
                up.raise_for_status()
            except httpx.HTTPError as exc:  # no counters rather than counters that read as zero
                return JSONResponse({"error": {"message": f"replica metrics unavailable: {exc}"}}, 502)
            parts.append(up.content.rstrip(b"\n") + b"\n")
        return Response(b"".join(parts) + own, media_type="text/plain; version=0.0.4")

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


def _stream_error_code(first: bytes) -> int:
    """The ``code`` of a stream's first event when it is vLLM's error event (``{"error": {..., "code": N}}``)."""
    try:
        return int(json.loads(first[6:first.find(b"\n")])["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return 0


def _stream_error_answer(first: bytes, status: int) -> JSONResponse:
    # A stream's error event, given as the JSON error answer vLLM sends for a stream refused at once.
    return JSONResponse(json.loads(first[6:first.find(b"\n")]), status)


def _bad_gateway_answer(exc: Exception) -> JSONResponse:
    return JSONResponse({"error": {"message": f"upstream error: {type(exc).__name__}: {exc}", "type": "BadGateway"}},
                        502)


async def _no_chunks():
    return
    yield b""  # an async generator that yields nothing: the answer was read whole


async def start_server(config: uvicorn.Config, timeout: float = 30.0) -> tuple[uvicorn.Server, asyncio.Task]:
    """Serve ``config`` on the running loop (no signal handlers); return once it accepts connections."""
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]

    async def serve() -> None:
        try:
            await server.serve()
        except SystemExit as exc:  # uvicorn exits the process when it cannot bind; in a task that would
            # escape the event loop and leave whoever waits on the loop's thread waiting forever
            raise RuntimeError(f"server on {config.host}:{config.port} could not start (uvicorn exit code "
                               f"{exc.code}): is the port in use? (see the log above)") from None

    task = asyncio.create_task(serve())
    deadline = time.monotonic() + timeout
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError(f"server on {config.host}:{config.port} exited before it started")
        if time.monotonic() > deadline:
            raise TimeoutError(f"server on {config.host}:{config.port} did not start")
        await asyncio.sleep(0.05)
    return server, task


async def stop_server(server: uvicorn.Server | None, task: asyncio.Task | None, timeout: float = 15.0) -> None:
    """Ask ``server`` to exit and wait (at most ``timeout`` s) for it."""
    if server is None or task is None:
        return
    server.should_exit = True
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:  # a client holds a connection open: close it rather than leave the lifespan pending
        server.force_exit = True
        done, _ = await asyncio.wait({task}, timeout=5.0)
    if not done:
        task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - cancelled, or what made it exit
        pass
