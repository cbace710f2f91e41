"""Serving pieces without vLLM: metrics parsing, capture writer, router balancing/draining/auth.

Upstream replicas are small fake OpenAI servers on loopback, so these run in seconds.
"""

from __future__ import annotations

import asyncio
import re
import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from serving.capture_writer import CaptureWriter
from serving.metrics import SpecSnapshot
from serving.pool import Pool
from serving.router import create_app
from tests.services import LoopbackServer, free_port
from tests.serving_support import Router, fake_replica

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="tiny",position="2"} 1.7e9
"""


def test_spec_metrics_delta():
    a = SpecSnapshot.from_text(METRICS, t=0.0)
    b = SpecSnapshot.from_text(METRICS.replace(" 10.0", " 20.0").replace(" 12.0", " 27.0")
                               .replace("\"0\"} 7.0", "\"0\"} 15.0"), t=5.0)
    d = b.minus(a)
    assert (a.drafts, a.draft_tokens, a.accepted, a.per_pos) == (10, 30, 12, [7, 4, 1])
    assert d.drafts == 10 and d.accepted == 15
    assert d.mean_acceptance_length == pytest.approx(2.5)
    assert d.acceptance_per_pos == pytest.approx([0.8, 0.0, 0.0])


# -- capture writer -------------------------------------------------------------------

def test_capture_writer_local_layout_sampling_and_drops(tmp_path: Path):
    async def main():
        w = CaptureWriter(str(tmp_path), "ep", "AllTraffic", flush_seconds=0.05)
        w.start()
        for i in range(5):
            assert w.sample()
            w.offer(json.dumps({"i": i}))
        await w.close()
        files = list(tmp_path.rglob("*.jsonl"))
        assert files, "nothing written"
        rel = files[0].relative_to(tmp_path).parts
        assert rel[:2] == ("ep", "AllTraffic") and len(rel) == 7  # ep/variant/yyyy/mm/dd/hh/file
        lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
        assert sorted(x["i"] for x in lines) == list(range(5))
        assert w.counts["written"] == w.counts["published"] == 5 and w.dropped == 0

        # 0 % sampling captures nothing.
        w0 = CaptureWriter(str(tmp_path / "none"), "ep", sampling_pct=0)
        assert not any(w0.sample() for _ in range(50))
        assert w0.counts["sampled_out"] == 50

        # A full queue drops without blocking.
        wq = CaptureWriter(str(tmp_path / "q"), "ep", max_queue=2)
        assert [wq.offer("{}") for _ in range(4)] == [True, True, False, False]
        assert wq.counts["dropped_queue_full"] == 2

        # A destination that cannot be written drops the batch, counted, and the writer lives on.
        blocker = tmp_path / "blocker"
        blocker.write_text("a file, not a directory")
        wf = CaptureWriter(str(blocker), "ep", flush_seconds=0.01)
        wf.start()
        t = time.perf_counter()
        wf.offer("{}")
        assert time.perf_counter() - t < 0.01
        for _ in range(100):
            await asyncio.sleep(0.02)
            if wf.counts["dropped_write_error"]:
                break
        assert wf.counts["dropped_write_error"] == 1 and wf.last_error
        await wf.close()

    asyncio.run(main())


# -- router with fake replicas ------------------------------------------------------------

def test_router_balances_drains_skips_and_guards_admin(tmp_path: Path):
    a, b = fake_replica("A", delay=0.2), fake_replica("B", delay=0.2)
    with LoopbackServer(a, free_port()) as sa, LoopbackServer(b, free_port()) as sb:
        async def swap_handler(body):
            return {"ok": True, "head": body["head"]}

        writer_dir = tmp_path / "cap"
        dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        with Router([sa.url, sb.url, dead_url], capture_dir=writer_dir, admin_token="s3cret",
                    swap_handler=swap_handler) as router:
            ra, rb, dead = router.pool.replicas
            url = router.url
            assert not dead.healthy and ra.healthy and rb.healthy

            async def load(n):
                async with httpx.AsyncClient(timeout=30) as c:
                    rs = await asyncio.gather(*(c.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
                                                for _ in range(n)))
                return [r.json()["choices"][0]["text"] for r in rs]

            # 8 concurrent slow requests spread over both healthy replicas, none to the dead one.
            texts = asyncio.run(load(8))
            assert sorted(set(texts)) == ["A", "B"] and abs(texts.count("A") - texts.count("B")) <= 2

            # Streaming passes through chunk by chunk.
            with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                body = b"".join(r.iter_raw())
            assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")

            # Admin: no token, wrong token, right token.
            assert httpx.post(url + "/admin/drain", json={"url": sa.url}).status_code == 401
            assert httpx.post(url + "/admin/drain", json={"url": sa.url},
                              headers={"Authorization": "Bearer nope"}).status_code == 403
            assert httpx.post(url + "/admin/swap", json={"head": "/x"}).status_code == 401
            assert httpx.post(url + "/collective_rpc", json={"method": "x"}).status_code in (404, 405)
            auth = {"Authorization": "Bearer s3cret"}
            assert httpx.post(url + "/admin/drain", json={"url": sa.url}, headers=auth).json()["drained"]
            hits_a = a.state.hits
            assert set(asyncio.run(load(4))) == {"B"} and a.state.hits == hits_a
            httpx.post(url + "/admin/undrain", json={"url": sa.url}, headers=auth)
            assert "A" in asyncio.run(load(6))

            st = httpx.get(url + "/admin/status", headers=auth).json()
            assert {r["url"]: r["healthy"] for r in st["replicas"]} == {sa.url: True, sb.url: True, dead.url: False}
            m = httpx.get(url + "/metrics").text
            assert 'adapt_capture_records_total{outcome="written"}' in m
            assert 'adapt_router_requests_total{outcome="ok",route="completions"}' in m
        lines = [json.loads(x) for f in writer_dir.rglob("*.jsonl") for x in f.read_text().splitlines()]
        assert len(lines) == 8 + 1 + 4 + 6
        streamed = [x for x in lines if x["captureData"]["endpointOutput"]["observedContentType"] == "text/event-stream"]
        assert len(streamed) == 1 and "data: [DONE]" in streamed[0]["captureData"]["endpointOutput"]["data"]


class CrashingReplica:
    """A raw HTTP server that answers /health but drops every POST: with ``after_first_chunk``, a stream's
    first chunk goes out before the connection is reset (a replica killed mid-stream)."""

    def __init__(self, after_first_chunk: bool = False) -> None:
        import socket as socketlib

        self.after_first_chunk = after_first_chunk
        self.hits = 0
        self.sock = socketlib.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import socket as socketlib
        import struct

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                if not data.startswith(b"POST "):  # /health (and the pool's /metrics sampling)
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                    continue
                self.hits += 1
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(re.search(rb"content-length: *(\d+)", head, re.I)[1])
                while len(body) < length:
                    body += conn.recv(65536)
                if self.after_first_chunk and json.loads(body).get("stream"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n"
                                 b"1a\r\ndata: {\"choices\": [{}]}\n\n\r\n")
                    time.sleep(0.05)
                # SO_LINGER 0: close with a reset, as the kernel does for a killed process's sockets.
                conn.setsockopt(socketlib.SOL_SOCKET, socketlib.SO_LINGER, struct.pack("ii", 1, 0))

    def close(self) -> None:
        self.sock.close()


def test_router_retries_a_request_its_replica_dropped_once_on_another_and_captures_it_once(tmp_path: Path):
    good = fake_replica("B", delay=0.05)
    crash, crash2, midstream = CrashingReplica(), CrashingReplica(), CrashingReplica(after_first_chunk=True)
    with LoopbackServer(good, free_port()) as sg:
        def serve(urls, writer_dir, fn):
            with Router(urls, capture_dir=writer_dir) as router:
                return fn(router.url)

        def records(d: Path) -> int:
            return sum(len(f.read_text().splitlines()) for f in d.rglob("*.jsonl"))

        async def load(url, n, stream):
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(*(c.post(url + "/v1/completions", json={"prompt": "x", "stream": stream})
                                              for _ in range(n)))

        # A replica that drops every request: each one it got is retried on the good replica; nothing fails
        # and every answer is captured once.
        def both(url):
            rs = asyncio.run(load(url, 12, False)) + asyncio.run(load(url, 6, True))
            m = httpx.get(url + "/metrics").text
            return rs, m
        rs, m = serve([crash.url, sg.url], tmp_path / "a", both)
        assert [r.status_code for r in rs] == [200] * 18 and crash.hits > 0
        assert all(r.json()["choices"][0]["text"] == "B" for r in rs[:12])
        assert all(r.content.endswith(b"data: [DONE]\n\n") for r in rs[12:])
        retried = {k: float(v) for k, v in re.findall(r'adapt_router_retries_total\{reason="(\w+)"\} ([0-9.]+)', m)}
        assert sum(retried.values()) == crash.hits and retried["reset"] > 0, (retried, crash.hits)
        assert records(tmp_path / "a") == 18

        # Each replica at most once: two dropping replicas fail the request with 502 after two tries.
        hits = crash.hits + crash2.hits
        rs = serve([crash.url, crash2.url], tmp_path / "b", lambda url: asyncio.run(load(url, 1, False)))
        assert rs[0].status_code == 502 and "upstream error" in rs[0].text
        assert crash.hits + crash2.hits == hits + 2 and records(tmp_path / "b") == 0

        # A stream that had started when its replica died fails (its client holds a part), and is not captured.
        def started(url):
            with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as r:
                got = b""
                with pytest.raises(httpx.HTTPError):
                    for chunk in r.iter_raw():
                        got += chunk
            return got
        got = serve([midstream.url], tmp_path / "c", started)
        assert got.startswith(b"data: ") and midstream.hits == 1 and records(tmp_path / "c") == 0
    for c in (crash, crash2, midstream):
        c.close()


def test_router_refuses_admin_without_configured_token():
    pool = Pool()
    app = create_app(pool, admin_token="")
    from fastapi.testclient import TestClient

    with TestClient(app) as c:
        r = c.post("/admin/swap", json={"head": "/x"}, headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403 and "disabled" in r.json()["detail"]


def test_capture_writer_s3_is_read_back_by_capture(s3_server, tmp_path: Path):
    """Batches land in S3 in the Data Capture layout and capture.ingest turns them into conversations."""
    from capture.ingest import ingest
    from capture.records import make_capture_record
    from capture.warehouse import Warehouse
    from settings.config import load_config

    dest = f"s3://{s3_server.bucket}/router-capture"
    cfg = load_config(overrides={"state_dir": str(tmp_path), "s3": {"endpoint_url": s3_server.endpoint_url},
                                 "capture": {"source": dest, "endpoint": "", "redact": False}})

    async def main():
        w = CaptureWriter(dest, "s3-ep", "AllTraffic", flush_seconds=0.05, s3_client_kwargs=cfg.s3.client_kwargs())
        w.start()
        for i in range(3):
            w.offer(make_capture_record({"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]},
                                        {"choices": [{"message": {"role": "assistant", "content": f"a{i}"}}]}))
        sse = "".join(f"data: {json.dumps({'choices': [{'delta': {'content': p}}]})}\n\n" for p in ("st", "ream"))
        w.offer(make_capture_record({"messages": [{"role": "user", "content": "qs"}], "stream": True},
                                    sse + "data: [DONE]\n\n", response_content_type="text/event-stream"))
        await w.close()
        assert w.counts["written"] == 4 and w.dropped == 0, w.last_error

    asyncio.run(main())
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=s3_server.bucket,
                                                                  Prefix="router-capture/")["Contents"]]
    assert keys and all(k.split("/")[1:3] == ["s3-ep", "AllTraffic"] and len(k.split("/")) == 8 for k in keys)
    res = ingest(cfg, source=dest)
    assert res.normalized == 4, res.summary()
    pairs = {tuple(t["value"] for t in c["conversations"]) for c in Warehouse(cfg).read_conversations().to_pylist()}
    assert pairs == {("q0", "a0"), ("q1", "a1"), ("q2", "a2"), ("qs", "stream")}


def test_steady_load_counts_every_request_and_names_failures():
    from traffic.loadgen import SteadyLoad

    app = fake_replica("x", fail_every=4)
    with LoopbackServer(app, free_port()) as s:
        with SteadyLoad(s.url, "m", workers=2, max_requests=12) as load:
            for t in load.threads:
                t.join(30)
    assert load.ok + len(load.failed) == 24 == app.state.hits
    assert len(load.failed) == 6 and set(load.failed) == {"HTTP 503"}


def test_swap_smoke_and_bench_wait_for_a_slow_metrics_endpoint(monkeypatch, tmp_path: Path):
    """On a loaded CPU host /metrics can take seconds: a measurement's snapshot waits MEASURE_TIMEOUT, not 5 s."""
    from evaluation import bench
    from serving import swap
    from serving.metrics import MEASURE_TIMEOUT

    seen: list[tuple[str, float]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.extensions["timeout"]["read"]))
        if request.url.path == "/metrics":
            return httpx.Response(200, text="")
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    sw = swap.SwapController(None, target_dir=tmp_path, num_speculative_tokens=3, served_model_name="m", smoke_prompts=["a"])
    got = asyncio.run(sw.smoke("http://replica"))
    assert got["texts"] == ["ok"]
    assert [t for p, t in seen if p == "/metrics"] == [MEASURE_TIMEOUT, MEASURE_TIMEOUT]
    seen.clear()
    asyncio.run(bench.run_block("http://replica", [], concurrency=2))
    assert [t for p, t in seen if p == "/metrics"] == [MEASURE_TIMEOUT, MEASURE_TIMEOUT]
    assert MEASURE_TIMEOUT >= 30
