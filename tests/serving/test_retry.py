"""The router's retries: a request a replica failed before the client got any byte goes to another replica.

Each replica is a raw HTTP/1.1 server on loopback whose answer to every POST is scripted: vLLM's answer
when its engine died (a 500 with a JSON error), a connection reset before any byte, or a stream's first
chunk and then a reset. ``/health`` always answers 200, so only the router's own retry path decides.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import threading
import time

import httpx
import pytest

from tests.serving_support import Router, fake_replica
from tests.services import LoopbackServer, free_port

# vLLM's answer to a request its dead engine could not serve (EngineDeadError: the API server's handler).
ENGINE_DEAD = json.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the "
                                               "root cause.", "type": "InternalServerError", "code": 500}}).encode()


class ScriptedReplica:
    """Answers every POST with ``how``: "500" (``ENGINE_DEAD``), "stream_500" (a stream: a 200 whose first
    event is that error, as vLLM streams an engine that died before the first token; else the 500), "reset"
    (before any byte),
    or "midstream" (a stream's headers and first event, then a reset); counts the POSTs it got."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.hits = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                n = int(m[1]) if m else 0
                while len(buf) < n:
                    buf += conn.recv(65536)
                body, buf = buf[:n], buf[n:]
                if not head.startswith(b"POST "):  # the pool's health checks
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    continue
                self.hits += 1
                if self.how == "500" or (self.how == "stream_500" and not json.loads(body).get("stream")):
                    conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(ENGINE_DEAD), ENGINE_DEAD))
                    continue
                if self.how == "stream_500":
                    event = b"data: %s\n\ndata: [DONE]\n\n" % ENGINE_DEAD
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(event), event))
                    continue
                if self.how == "midstream":
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n1a\r\ndata: {\"choices\": [{}]}\n\n\r\n")
                    time.sleep(0.05)
                # SO_LINGER 0: close with a reset, as the kernel does for a killed process's sockets.
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                return

    def close(self) -> None:
        self.sock.close()


def _retries(url: str) -> dict[str, float]:
    m = httpx.get(url + "/metrics").text
    return {k: float(v) for k, v in re.findall(r'adapt_router_retries_total\{reason="(\w+)"\} ([0-9.]+)', m)}


def _post(url: str, stream: bool = False) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "x", "stream": stream}, timeout=30)


@pytest.fixture
def good():
    with LoopbackServer(fake_replica("B"), free_port()) as s:
        yield s


@pytest.mark.parametrize("how", ["500", "stream_500", "reset"])
def test_a_replica_5xx_or_reset_before_the_answer_is_retried_on_another(good, how: str):
    """vLLM's EngineDeadError answer (500, or a stream's first event), or a replica that drops the request,
    costs a retry on the other replica: every request is answered by it, streamed or not, and the
    retries are counted."""
    bad = ScriptedReplica(how)
    with Router([bad.url, good.url], retry_backoff=0.01) as router:
        rs = [_post(router.url, stream=i % 2 == 1) for i in range(6)]
        retried = _retries(router.url)
    bad.close()
    assert [r.status_code for r in rs] == [200] * 6
    assert all(r.json()["choices"][0]["text"] == "B" for r in rs[::2])
    assert all(r.content.endswith(b"data: [DONE]\n\n") for r in rs[1::2])
    reason = "reset" if how == "reset" else "http_5xx"
    assert bad.hits >= 1 and retried.get(reason) == bad.hits, (retried, bad.hits)


def test_a_stream_that_died_after_its_first_byte_is_not_retried(good):
    """The client holds part of the answer: the stream fails (its connection is aborted), and no other
    replica gets the request."""
    mid = ScriptedReplica("midstream")
    with Router([mid.url, good.url], retry_backoff=0.01) as router:
        failed, answered = 0, 0
        for _ in range(4):
            got = b""
            try:
                with httpx.stream("POST", router.url + "/v1/completions", json={"prompt": "x", "stream": True},
                                  timeout=30) as r:
                    for chunk in r.iter_raw():
                        got += chunk
                assert got.endswith(b"data: [DONE]\n\n")
                answered += 1
            except httpx.HTTPError:
                assert got.startswith(b"data: {\"choices\"")
                failed += 1
            time.sleep(0.3)  # the health check puts the replica back in rotation
        retried = _retries(router.url)
    mid.close()
    assert failed == mid.hits >= 1 and answered == 4 - failed
    assert sum(retried.values()) == 0, retried


@pytest.mark.parametrize("how", ["500", "reset"])
def test_retries_stop_at_the_pool_size(how: str):
    """Three replicas that all fail: the request is sent three times (once to each), not more; the client
    gets the last replica's own 500 answer, or 502 after a reset."""
    bad = [ScriptedReplica(how) for _ in range(3)]
    with Router([b.url for b in bad], retry_backoff=0.01) as router:
        r = _post(router.url)
        retried = _retries(router.url)
    for b in bad:
        b.close()
    assert [b.hits for b in bad] == [1, 1, 1]
    if how == "500":
        assert r.status_code == 500 and r.content == ENGINE_DEAD
        assert retried == {"http_5xx": 2.0}
    else:
        assert r.status_code == 502 and "upstream error" in r.text
        assert retried == {"reset": 2.0}


def test_one_replica_is_not_retried_and_backoff_is_waited():
    """A pool of one: its 500 goes to the client at once. Of two failing replicas, the retry waits about
    the configured backoff (jittered to half of it at least)."""
    one = ScriptedReplica("500")
    with Router([one.url], retry_backoff=5.0) as router:
        t0 = time.monotonic()
        r = _post(router.url)
        assert r.status_code == 500 and one.hits == 1 and time.monotonic() - t0 < 2.0
    two = ScriptedReplica("500")
    with Router([one.url, two.url], retry_backoff=0.4) as router:
        t0 = time.monotonic()
        r = _post(router.url)
        took = time.monotonic() - t0
    one.close()
    two.close()
    assert r.status_code == 500 and one.hits + two.hits == 3 and 0.2 <= took < 5.0, took
