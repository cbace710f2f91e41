"""The router's connections to its replicas: HTTP/1.1 keep-alive, a connection taken and returned in O(1).

httpx's own pool (httpcore's ``AsyncConnectionPool``) looks at every connection it holds on each
request and on each response closed, and asks each idle one's socket whether it is readable: a
cost per request that grows with the requests in flight, which a router in front of a fleet has by
the hundred. Its HTTP/1.1 layers (h11, anyio) then cost every SSE event of a stream several
coroutine switches and a parse in Python.

:class:`PooledTransport` keeps each replica's idle connections on a stack instead: a request takes
the most recently used one, a response read to its end and closed puts its connection back, and
a new connection is opened when none is idle; nothing caps the connections in use (the router's
own clients bound them). Each connection is an asyncio protocol with httptools' C parser: the
body arrives as the bytes received since the reader last asked (several SSE events at once when
they came together), and reading stops while more than :data:`HIGH_WATER` bytes wait for a slow
reader, so the replica feels the client's pace as it would through a socket.

Used as ``httpx.AsyncClient(transport=PooledTransport(...))``: requests, responses, timeouts and
exceptions are httpx's own, as with the default transport. A connection that was idle in the
stack and turns out closed by the replica before any byte of the answer is replaced by a new one
once, as a browser or urllib3 does: the request never reached the replica.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import typing

import httptools
import httpx

HIGH_WATER = 1 << 20
_DEFAULT_PORT = {b"http": 80, b"https": 443}


class _Stale(Exception):
    """A reused connection closed before the answer's first byte: the request is sent on a new one."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection to a replica, one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self.parser: httptools.HttpResponseParser | None = None
        self._start()

    def _start(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = self.complete = self.keep_alive = self.paused = False
        self.got_bytes = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.error: Exception | None = None
        self.waiter: asyncio.Future | None = None

    # -- asyncio protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)  # type: ignore[union-attr]
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response from the replica: {exc}"))
            self.transport.close()  # type: ignore[union-attr]
            return
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def eof_received(self) -> bool | None:
        return None  # close: a response ends by its length or its last chunk, never by EOF

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            if self.reused and not self.got_bytes:
                self._fail(_Stale())
            elif exc is not None:
                self._fail(httpx.ReadError(f"{type(exc).__name__}: {exc}"))
            else:
                self._fail(httpx.RemoteProtocolError("the replica closed the connection before the answer's end"))

    # -- httptools callbacks -------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()  # type: ignore[union-attr]
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # type: ignore[union-attr]
        self.complete = True
        self._wake()

    # -- the reader's side ---------------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    async def _wait(self, timeout: float | None) -> None:
        if self.error is not None:
            raise self.error
        self.waiter = w = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._late, w) if timeout else None
        try:
            await w
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _late(w: asyncio.Future) -> None:
        if not w.done():
            w.set_exception(httpx.ReadTimeout("the replica sent nothing within the read timeout"))

    async def send(self, data: bytes, timeout: float | None) -> None:
        """Write a request and wait for its answer's headers."""
        self._start()
        self.transport.write(data)  # type: ignore[union-attr]
        while not self.headers_done:
            await self._wait(timeout)
        if self.status < 200:  # an interim answer (100 Continue): the real one follows
            raise httpx.RemoteProtocolError(f"unexpected interim answer {self.status} from the replica")

    async def body(self, timeout: float | None) -> typing.AsyncIterator[bytes]:
        while True:
            if self.chunks:
                data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks.clear()
                self.buffered = 0
                if self.paused:
                    self.paused = False
                    self.transport.resume_reading()  # type: ignore[union-attr]
                yield data
                continue
            if self.complete:
                return
            await self._wait(timeout)

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and not self.chunks

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection; closing it returns the connection when it can serve again."""

    def __init__(self, conn: _Connection, owner: "PooledTransport", key: tuple, timeout: float | None) -> None:
        self._conn: _Connection | None = conn
        self._owner, self._key, self._timeout = owner, key, timeout

    async def __aiter__(self) -> typing.AsyncIterator[bytes]:
        if self._conn is None:
            raise httpx.StreamClosed()
        try:
            async for part in self._conn.body(self._timeout):
                yield part
        except _Stale:  # cannot happen once headers came; kept as a reset for the router
            raise httpx.RemoteProtocolError("the replica closed the connection") from None

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._owner._put_back(self._key, conn)


class PooledTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 keep-alive connections per replica on a LIFO stack (see the module doc).

    ``verify``: as httpx's (a bool, a CA bundle path or an ``ssl.SSLContext``), for https replicas;
    ``keepalive_expiry``: an idle connection older than this is closed rather than reused (below the
    replica's own idle timeout: uvicorn's, vLLM's server, is 5 s); ``max_idle``: idle connections kept
    per replica.
    """

    def __init__(self, *, verify: typing.Any = True, keepalive_expiry: float = 4.0, max_idle: int = 1024) -> None:
        self._verify = verify
        self._ssl: ssl.SSLContext | None = None
        self._expiry = keepalive_expiry
        self._max_idle = max_idle
        self._idle: dict[tuple, list[_Connection]] = {}
        self._closed = False

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = httpx.create_ssl_context(verify=self._verify)
        return self._ssl

    async def _connect(self, key: tuple, timeout: float | None) -> _Connection:
        scheme, host, port = key
        loop = asyncio.get_running_loop()
        conn = _Connection(loop)
        tls = {"ssl": self._ssl_context(), "server_hostname": host} if scheme == b"https" else {}
        try:
            await asyncio.wait_for(loop.create_connection(lambda: conn, host, port, **tls), timeout)
        except asyncio.TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{type(exc).__name__}: {exc}") from None
        return conn

    def _take(self, key: tuple) -> _Connection | None:
        stack = self._idle.get(key)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            if not conn.closed and now - conn.idle_since < self._expiry:
                conn.reused = True
                return conn
            conn.close()
        return None

    def _put_back(self, key: tuple, conn: _Connection) -> None:
        stack = self._idle.setdefault(key, [])
        if self._closed or not conn.reusable or len(stack) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        stack.append(conn)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.raw_scheme
        key = (scheme, url.host, url.port or _DEFAULT_PORT.get(scheme, 80))
        timeouts = request.extensions.get("timeout", {})
        try:
            content = request.content
        except httpx.RequestNotRead:
            content = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        head = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), url.raw_path)]
        head += [b"%s: %s\r\n" % (k, v) for k, v in request.headers.raw]
        if content and "content-length" not in request.headers:
            head.append(b"content-length: %d\r\n" % len(content))
        data = b"".join(head) + b"\r\n" + content
        while True:
            conn = self._take(key) or await self._connect(key, timeouts.get("connect"))
            try:
                await conn.send(data, timeouts.get("read"))
            except _Stale:
                conn.close()
                continue  # a reused connection the replica had closed: nothing reached it
            except BaseException:
                conn.close()
                raise
            break
        return httpx.Response(status_code=conn.status, headers=conn.headers,
                              stream=_Body(conn, self, key, timeouts.get("read")),
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        self._closed = True
        stacks, self._idle = self._idle, {}
        for stack in stacks.values():
            for conn in stack:
                conn.close()


class UpstreamClient(httpx.AsyncClient):
    """httpx's client over a :class:`PooledTransport`, without the per-request layers a router has no use for.

    The router sends to replicas with no auth, no redirects and no cookies, to a handful of URLs: a
    request is built from a cached parsed URL, the router's headers and the client's timeouts (not the
    client's default headers: no ``accept-encoding``, as capture wants the plain body), and sent
    straight to the transport. Anything else (auth, redirects, other arguments) takes httpx's path.
    """

    def __init__(self, *, timeout: httpx.Timeout, verify: typing.Any = True, **transport_kw: typing.Any) -> None:
        super().__init__(timeout=timeout, transport=PooledTransport(verify=verify, **transport_kw))
        self._pooled = typing.cast(PooledTransport, self._transport)
        self._timeouts = self.timeout.as_dict()
        self._urls: dict[str, httpx.URL] = {}

    def build_request(self, method: str, url: typing.Any, *, content: typing.Any = None,  # type: ignore[override]
                      headers: typing.Any = None, **kw: typing.Any) -> httpx.Request:
        if kw or not isinstance(url, str) or not isinstance(content, (bytes, type(None))):
            return super().build_request(method, url, content=content, headers=headers, **kw)
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = httpx.URL(url)
            if len(self._urls) < 1024:
                self._urls[url] = parsed
        return httpx.Request(method, parsed, content=content, headers=headers, extensions={"timeout": self._timeouts})

    async def send(self, request: httpx.Request, *, stream: bool = False,  # type: ignore[override]
                   auth: typing.Any = httpx.USE_CLIENT_DEFAULT,
                   follow_redirects: typing.Any = httpx.USE_CLIENT_DEFAULT) -> httpx.Response:
        if auth is not httpx.USE_CLIENT_DEFAULT or follow_redirects not in (httpx.USE_CLIENT_DEFAULT, False):
            return await super().send(request, stream=stream, auth=auth, follow_redirects=follow_redirects)
        response = await self._pooled.handle_async_request(request)
        response.request = request
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response
