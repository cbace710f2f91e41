"""The router on several cores: N worker processes on one listening socket, supervised by ``adapt serve``.

``[serving] router_workers = N`` (N > 1): ``adapt serve`` binds the router's address N times with
``SO_REUSEPORT``, one listening socket per worker slot, and starts N processes (``python -m
serving.workers``), each inheriting its slot's socket and running the router app (``serving.router``)
on its own event loop. The kernel spreads new connections over the sockets by a hash of their
addresses, so keep-alive clients that connect at once land on every worker (one socket shared by all
would let whichever worker woke first accept them all). The parent keeps every socket open: while a
worker restarts, the connections that come to its socket wait in its queue for the new worker instead
of being reset. A worker that exits is started again (after 0.2 s, doubling up to 10 s while it keeps
dying young); only the requests it had in flight fail. Another process of the same user could join
the port's ``SO_REUSEPORT`` group: run the router under its own user.

One pool (``serving.poolview``): the pool manager (health checks, crash restarts, the swap controller,
admin actions) runs in the parent only. Each worker talks to it over a private socket pair it inherits
(no listening endpoint, so nothing else can reach the channel; newline-delimited JSON): the parent
pushes the pool's state whenever it changes, the worker reports its counters every
``report_interval`` while they change. A request to ``/admin/*`` or ``/metrics`` on any worker is
passed to the parent, which answers it with its router app (the same routes, the same admin token
check) and acts once on the one pool; ``/metrics`` then holds every worker's request counters (label
``worker``) and the capture counters summed. Inference routes, ``/v1/models`` and ``/health`` are
answered by the worker from its copy of the state.

Capture: each worker writes its own journal files (``serving.capture_journal``), a record before its
answer ends, so a worker killed mid-stream loses no record of a request it had answered, and the
worker that takes its slot publishes what it left (no record twice).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from serving.capture_journal import JournalWriter, Publisher, default_spool_root, recover
from serving.pool import Pool
from serving.poolview import PoolState, SharedPool, WorkerReport, apply, report

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]
# Routes a worker passes to the parent: the admin plane acts on the one pool, and /metrics is the
# whole router's.
PARENT_PATHS = ("/admin/", "/metrics")
LINE_LIMIT = 256 << 20  # a channel message: an admin body (base64) up to max_body_bytes, a status


@dataclass(frozen=True)
class CaptureSpec:
    destination: str
    endpoint: str
    variant: str = "AllTraffic"
    sampling_pct: float = 100.0
    spool_root: str = ""
    s3_client_kwargs: dict[str, Any] | None = None
    batch_size: int = 256
    flush_seconds: float = 1.0

    def journal(self, name: str, alternatives: int = 0) -> JournalWriter:
        """A router process's writer of this capture: spool ``name`` under ``spool_root`` (or the first free of
        ``alternatives`` more beside it)."""
        return JournalWriter(self.destination, self.endpoint, self.variant, spool=Path(self.spool_root) / name,
                             alternatives=alternatives, sampling_pct=self.sampling_pct,
                             s3_client_kwargs=self.s3_client_kwargs, batch_size=self.batch_size,
                             flush_seconds=self.flush_seconds)


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs besides the pool's state (no admin token: admin requests go to the parent)."""

    slot: int = 0
    capture: CaptureSpec | None = None
    max_body_bytes: int = 8 << 20
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    capture_token_ids: bool = True
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    retry_backoff: float = 0.05
    agent_ca_file: str = ""
    no_replica_wait: float = 30.0
    report_interval: float = 0.02
    timeout_keep_alive: int = 30
    log_level: str = "warning"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WorkerSpec":
        d = dict(d)
        cap = d.pop("capture", None)
        return cls(capture=CaptureSpec(**cap) if cap else None, **d)


# -- the channel -------------------------------------------------------------------------------

class Channel:
    """Newline-delimited JSON messages over a stream (one end of the socket pair)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, sock: socket.socket) -> "Channel":
        reader, writer = await asyncio.open_connection(sock=sock, limit=LINE_LIMIT)
        return cls(reader, writer)

    def send(self, msg: dict[str, Any]) -> None:
        if not self.writer.is_closing():
            self.writer.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")

    async def recv(self) -> dict[str, Any] | None:
        line = await self.reader.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        self.writer.close()


async def asgi_call(app: Any, method: str, path: str, *, query: bytes = b"", headers: list[list[str]] = (),
                    body: bytes = b"", client: list | None = None) -> tuple[int, list[list[str]], bytes]:
    """One HTTP request to an ASGI app in this process: (status, headers, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": tuple(client) if client else None, "server": ("127.0.0.1", 0), "state": {}}
    done = asyncio.Event()
    sent = False
    status, out_headers, chunks = 500, [], []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, out_headers
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    done.set()
    return status, out_headers, b"".join(chunks)


def merge_metrics(parent: bytes, workers: dict[int, bytes]) -> bytes:
    """The parent's exposition (pool-level, capture summed) with each worker's request metrics, labelled
    ``worker``; the workers' own capture families are left out (the parent's hold their sums)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    fams: dict[str, Any] = {}
    for f in text_string_to_metric_families(parent.decode()):
        fams[f.name] = f
    for slot, text in sorted(workers.items()):
        for f in text_string_to_metric_families(text.decode()):
            if f.name.startswith("adapt_capture"):
                continue
            samples = [s._replace(labels={**s.labels, "worker": str(slot)}) for s in f.samples]
            if f.name in fams:
                fams[f.name].samples.extend(samples)
            else:
                f.samples = samples
                fams[f.name] = f

    class _Merged:
        def collect(self):
            yield from fams.values()

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Merged())
    return generate_latest(reg)


# -- the parent --------------------------------------------------------------------------------

@dataclass
class _Worker:
    slot: int
    proc: subprocess.Popen
    channel: Channel
    started: float
    ready: bool = False
    task: asyncio.Task | None = None


class CaptureTotals:
    """The workers' capture counters summed, where the parent's router app reads its writer's
    (``/admin/status``, ``/metrics``); the parent captures nothing itself."""

    KEYS = ("offered", "sampled_out", "written", "dropped_queue_full", "dropped_write_error",
            "dropped_bad_record", "objects", "published", "recovered", "dropped_partial", "unpublished")

    class _NoQueue:
        @staticmethod
        def qsize() -> int:
            return 0  # a worker's records are written when offered

    queue = _NoQueue()

    def __init__(self, pool: SharedPool) -> None:
        self.pool = pool

    @property
    def counts(self) -> dict[str, int]:
        got = self.pool.capture_counts()
        return {k: got.get(k, 0) for k in self.KEYS}

    @property
    def last_error(self) -> str | None:
        errors = [r.capture_error for r in self.pool.reports.values() if r.capture_error]
        return errors[-1] if errors else None

    def start(self) -> None:
        """Nothing to start: the workers write."""

    def draw(self) -> bool:
        raise RuntimeError("the router's parent routes no request: its workers capture")

    sample = offer = draw


class RouterWorkers:
    """N router worker processes on ``host:port`` (a socket each), supervised; ``admin_app`` (the
    parent's router app over ``pool``) answers the admin requests and /metrics they pass on."""

    def __init__(self, pool: SharedPool, admin_app: Any, spec: WorkerSpec, host: str, port: int, n: int, *,
                 log_dir: str | Path | None = None, backlog: int = 4096) -> None:
        if n < 1:
            raise ValueError("router workers: at least one")
        self.pool, self.admin_app, self.spec = pool, admin_app, spec
        self.host, self.port, self.n, self.backlog = host, port, n, backlog
        self.log_dir = Path(log_dir) if log_dir else None
        self.workers: dict[int, _Worker] = {}
        self.restarts: dict[int, int] = {i: 0 for i in range(n)}
        self.socks: dict[int, socket.socket] = {}  # each slot's listening socket, held here across restarts
        self._tasks: list[asyncio.Task] = []
        self._backoff: dict[int, float] = {i: 0.2 for i in range(n)}
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._bg: set[asyncio.Task] = set()  # admin requests, restarts: held until done
        self.stopping = False

    def _background(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # -- life --------------------------------------------------------------------

    async def start(self, timeout: float = 60.0) -> None:
        # A plain bind first: joining a SO_REUSEPORT group some other router of this user left bound
        # would share its port with it silently.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as exc:
                raise RuntimeError(f"router on {self.host}:{self.port} could not bind: {exc}: is the port in use?") \
                    from None
            self.port = probe.getsockname()[1]
        for slot in range(self.n):
            self.socks[slot] = self._listen()
        self.port = self.socks[0].getsockname()[1]
        self.pool.publish = self._broadcast
        # A starting worker counts: it has the state it was started with, and reports once it serves.
        self.pool.live_slots = lambda: set(self.workers)
        self.pool.push_if_changed(force=True)
        try:
            for slot in range(self.n):
                await self._spawn(slot)
            deadline = time.monotonic() + timeout
            while not all(w.ready for w in self.workers.values()) or len(self.workers) < self.n:
                for w in self.workers.values():
                    if w.proc.poll() is not None:
                        raise RuntimeError(f"router worker {w.slot} exited with {w.proc.returncode} before it "
                                           "served" + self._log_tail(w.slot))
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router workers did not start in {timeout:.0f} s" + self._log_tail(0))
                await asyncio.sleep(0.05)
        except BaseException:
            await self.stop()  # no worker left behind, the port released
            raise
        self._tasks = [asyncio.create_task(self._supervise(), name="router-workers"),
                       asyncio.create_task(self._push_loop(), name="router-workers-state")]

    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            for s in self.socks.values():
                s.close()
            raise RuntimeError(f"router on {self.host}:{self.port} could not bind: {exc}") from None
        sock.listen(self.backlog)
        sock.set_inheritable(True)
        return sock

    def _log_tail(self, slot: int) -> str:
        if self.log_dir is None:
            return ""
        p = self.log_dir / f"router-worker-{slot}.log"
        return f": {p.read_text(errors='replace')[-2000:]}" if p.is_file() else ""

    async def _spawn(self, slot: int) -> None:
        sock = self.socks[slot]
        mine, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        out: Any = subprocess.DEVNULL
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"router-worker-{slot}.log", "ab")
        try:
            # Its own session: a Ctrl-C at the terminal reaches the parent, which stops the workers in order.
            proc = subprocess.Popen([sys.executable, "-m", "serving.workers", "--listen-fd", str(sock.fileno()),
                                     "--channel-fd", str(theirs.fileno())],
                                    pass_fds=(sock.fileno(), theirs.fileno()), env=env, cwd=str(REPO_ROOT),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            theirs.close()
            if out is not subprocess.DEVNULL:
                out.close()
        channel = await Channel.open(mine)
        w = _Worker(slot, proc, channel, time.monotonic())
        self.workers[slot] = w
        channel.send({"t": "spec", "spec": replace(self.spec, slot=slot).to_json(), "state": self.pool.state().to_json()})
        w.task = asyncio.create_task(self._read(w), name=f"router-worker-{slot}")

    async def _read(self, w: _Worker) -> None:
        while True:
            try:
                msg = await w.channel.recv()
            except (ConnectionError, ValueError):
                msg = None
            if msg is None:
                return
            t = msg.get("t")
            if t == "ready":
                w.ready = True
            elif t == "report":
                if self.workers.get(w.slot) is w:
                    self.pool.take_report(w.slot, WorkerReport.from_json(msg["report"]))
            elif t == "admin":
                self._background(self._admin(w, msg))
            elif t == "metrics":
                fut = self._pending.pop(msg["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(base64.b64decode(msg["body"]))

    async def _admin(self, w: _Worker, msg: dict[str, Any]) -> None:
        try:
            status, headers, body = await asgi_call(self.admin_app, msg["method"], msg["path"],
                                                    query=msg["query"].encode("latin-1"), headers=msg["headers"],
                                                    body=base64.b64decode(msg["body"]), client=msg.get("client"))
            if msg["path"] == "/metrics" and status == 200:
                body = merge_metrics(body, await self._worker_metrics())
                headers = [[k, v] for k, v in headers if k.lower() != "content-length"]
        except Exception as exc:  # noqa: BLE001 - the worker's client gets the reason
            log.exception("router worker %d: admin request %s", w.slot, msg.get("path"))
            status, headers, body = 500, [["content-type", "application/json"]], json.dumps(
                {"error": {"message": f"{type(exc).__name__}: {exc}"}}).encode()
        w.channel.send({"t": "reply", "id": msg["id"], "status": status, "headers": headers,
                        "body": base64.b64encode(body).decode()})

    async def _worker_metrics(self, timeout: float = 10.0) -> dict[int, bytes]:
        asks: dict[int, asyncio.Future] = {}
        for w in list(self.workers.values()):
            if not w.ready:
                continue
            self._next_id += 1
            fut = asyncio.get_running_loop().create_future()
            self._pending[self._next_id] = fut
            asks[w.slot] = fut
            w.channel.send({"t": "metrics", "id": self._next_id})
        got: dict[int, bytes] = {}
        for slot, fut in asks.items():
            try:
                got[slot] = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                pass  # a worker that just died: its counters are gone with it
        for k in [k for k, f in self._pending.items() if f in asks.values()]:
            self._pending.pop(k, None)
        return got

    def _broadcast(self, state: PoolState) -> None:
        msg = {"t": "state", "state": state.to_json()}
        for w in list(self.workers.values()):
            w.channel.send(msg)

    async def _push_loop(self) -> None:
        # Health checks and swaps change replicas' fields in place: the state is compared, not hooked.
        while not self.stopping:
            try:
                self.pool.push_if_changed()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("router workers: state push")
            await asyncio.sleep(0.05)

    async def _supervise(self) -> None:
        while not self.stopping:
            for slot, w in list(self.workers.items()):
                if w.proc.poll() is None or self.stopping:
                    continue
                code = w.proc.returncode
                w.channel.close()
                self.workers.pop(slot, None)
                self.pool.worker_gone(slot)
                lived = time.monotonic() - w.started
                if lived > 30:  # not a crash loop: start again at the shortest wait
                    self._backoff[slot] = 0.2
                delay = self._backoff[slot]
                self._backoff[slot] = min(10.0, delay * 2)
                log.warning("router worker %d (pid %d) exited with %s after %.1f s; starting it again in %.1f s",
                            slot, w.proc.pid, code, lived, delay)
                self._background(self._respawn(slot, delay))
            await asyncio.sleep(0.05)

    async def _respawn(self, slot: int, delay: float) -> None:
        await asyncio.sleep(delay)
        if self.stopping:
            return
        try:
            await self._spawn(slot)
            self.restarts[slot] += 1
        except Exception:  # noqa: BLE001 - tried again by the supervisor's next round
            log.exception("router worker %d: could not start", slot)
            await asyncio.sleep(1.0)
            self._background(self._respawn(slot, 0.0))

    def status(self) -> list[dict[str, Any]]:
        return [{"slot": s, "pid": w.proc.pid, "ready": w.ready, "restarts": self.restarts[s]}
                for s, w in sorted(self.workers.items())]

    async def stop(self, timeout: float = 20.0) -> None:
        """Stop the workers (SIGTERM: each finishes its requests and publishes its capture), then publish
        what any of them left, and release the socket."""
        self.stopping = True
        for t in [*self._tasks, *self._bg]:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for w in self.workers.values():
            while w.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if w.proc.poll() is None:
                w.proc.kill()
                await asyncio.to_thread(w.proc.wait)
            w.channel.close()
            if w.task is not None:
                w.task.cancel()
        self.workers.clear()
        cap = self.spec.capture
        if cap is not None:
            publisher = Publisher(cap.destination, cap.s3_client_kwargs)
            for slot in range(self.n):
                await asyncio.to_thread(recover, Path(cap.spool_root) / f"worker-{slot}", publisher)
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()


def capture_spec(cfg: Any, destination: str, **writer_kwargs: Any) -> CaptureSpec:
    """The workers' capture settings from the config (``cfg``: settings.config.Config)."""
    return CaptureSpec(destination=destination, endpoint=cfg.serving.capture_endpoint, variant=cfg.capture.variant,
                       sampling_pct=cfg.serving.capture_sampling_pct,
                       spool_root=str(default_spool_root(destination, cfg.state_dir)),
                       s3_client_kwargs=cfg.s3.client_kwargs(),
                       **{k: v for k, v in writer_kwargs.items() if k in ("batch_size", "flush_seconds")})


# -- a worker ----------------------------------------------------------------------------------

def to_parent(app: Any, channel: Channel, pending: dict[int, asyncio.Future], max_body: int, slot: int = 0) -> Any:
    """ASGI wrapper: requests to :data:`PARENT_PATHS` are answered by the parent; the rest by ``app``."""
    counter = {"id": 0}
    tag = str(slot).encode()

    async def dispatch(scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if not (path.startswith(PARENT_PATHS[0]) or path == PARENT_PATHS[1]):
            await app(scope, receive, send)
            return
        from fastapi.responses import JSONResponse

        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > max_body:
                await JSONResponse({"error": {"message": f"request body over {max_body} bytes"}}, 413,
                                   headers={"connection": "close"})(scope, receive, send)
                return
        counter["id"] += 1
        fut = asyncio.get_running_loop().create_future()
        pending[counter["id"]] = fut
        channel.send({"t": "admin", "id": counter["id"], "method": scope["method"], "path": path,
                      "query": scope.get("query_string", b"").decode("latin-1"),
                      "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
                      "body": base64.b64encode(body).decode(), "client": list(scope["client"] or ()) or None})
        try:
            reply = await fut
        finally:
            pending.pop(counter["id"], None)
        if reply is None:
            await JSONResponse({"error": {"message": "the router's pool manager is gone"}}, 502)(scope, receive, send)
            return
        # Which worker passed it on: an operator (or a test) can tell the processes apart.
        await send({"type": "http.response.start", "status": reply["status"],
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in reply["headers"]]
                    + [(b"x-router-worker", tag)]})
        await send({"type": "http.response.body", "body": base64.b64decode(reply["body"]), "more_body": False})

    return dispatch


async def run_worker(listen_fd: int, channel_fd: int) -> None:
    """Serve the router on the inherited socket until SIGTERM/SIGINT or the parent's channel closes."""
    import uvicorn

    from serving.admin import tls_verify
    from serving.router import create_app, server_config

    channel = await Channel.open(socket.socket(fileno=channel_fd))
    first = await channel.recv()
    if first is None or first.get("t") != "spec":
        raise SystemExit("router worker: no spec from the parent")
    spec = WorkerSpec.from_json(first["spec"])
    pool = Pool(verify=tls_verify(spec.agent_ca_file))
    state = PoolState.from_json(first["state"])
    apply(pool, state)
    writer = spec.capture.journal(f"worker-{spec.slot}") if spec.capture else None
    app = create_app(pool, writer=writer, admin_token="", swap_handler=None, no_replica_wait=spec.no_replica_wait,
                     max_body_bytes=spec.max_body_bytes, capture_token_ids=spec.capture_token_ids,
                     request_timeout=spec.request_timeout, connect_timeout=spec.connect_timeout,
                     retry_backoff=spec.retry_backoff)
    pending: dict[int, asyncio.Future] = {}
    config = server_config(to_parent(app, channel, pending, spec.max_body_bytes, spec.slot), "127.0.0.1", 0,
                           header_timeout=spec.header_timeout, body_timeout=spec.body_timeout,
                           log_level=spec.log_level, lifespan="on", timeout_keep_alive=spec.timeout_keep_alive)
    server = uvicorn.Server(config)
    sock = socket.socket(fileno=listen_fd)
    applied = {"gen": state.gen, "state": state}

    async def read() -> None:
        while True:
            try:
                msg = await channel.recv()
            except (ConnectionError, ValueError):
                msg = None
            if msg is None:  # the parent is gone: nothing supervises this worker any more
                server.should_exit = True
                for fut in pending.values():
                    if not fut.done():
                        fut.set_result(None)
                return
            t = msg["t"]
            if t == "state":
                st = PoolState.from_json(msg["state"])
                if st.gen > applied["gen"]:
                    apply(pool, st)
                    applied.update(gen=st.gen, state=st)
            elif t == "reply":
                fut = pending.get(msg["id"])
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif t == "metrics":
                _, _, body = await asgi_call(app, "GET", "/metrics")
                channel.send({"t": "metrics", "id": msg["id"], "body": base64.b64encode(body).decode()})

    last: Any = None

    def send_report(force: bool = False) -> None:
        nonlocal last
        rep = report(pool, applied["gen"], applied["state"], writer.counts if writer else {},
                     writer.last_error if writer else None)
        js = rep.to_json()
        if force or js != last:
            last = js
            channel.send({"t": "report", "report": js})

    async def reports() -> None:
        while True:
            await asyncio.sleep(spec.report_interval)
            send_report()

    reader = asyncio.create_task(read(), name="pool-state")
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="router")
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if serving.done():
        serving.result()
        raise SystemExit("router worker: the server exited before it started")
    reporter = asyncio.create_task(reports(), name="pool-report")
    send_report(force=True)
    channel.send({"t": "ready", "pid": os.getpid()})
    try:
        await serving
    finally:
        if writer is not None:
            await writer.close()  # every journal file published (else the next worker of this slot does)
        reporter.cancel()
        send_report(force=True)
        try:
            await asyncio.wait_for(channel.writer.drain(), 2.0)
        except Exception:  # noqa: BLE001 - the parent may be gone
            pass
        reader.cancel()
        channel.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m serving.workers", description="one router worker (started by adapt serve)")
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--channel-fd", type=int, required=True)
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"router worker {os.getpid()}: %(levelname)s %(name)s: %(message)s")
    # uvicorn raises the signal that stopped it again once it has stopped, with the handler it found:
    # the default one would end the process before its capture is published.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        import uvloop
    except ImportError:
        asyncio.run(run_worker(opts.listen_fd, opts.channel_fd))
    else:
        uvloop.run(run_worker(opts.listen_fd, opts.channel_fd))


if __name__ == "__main__":
    main()
