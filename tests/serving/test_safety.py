"""Safe by default (issue #23), serving side: exposure guard, router limits, capture writer isolation.

The router runs on loopback with its real HTTP protocol (serving.router.server_config) in
front of a fake replica that records what reaches it; raw sockets play the slow clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from serving.admin import ExposureError, check_exposure, token_weakness
from serving.capture_writer import CaptureWriter
from settings.config import load_config
from tests.paths import REPO_ROOT
from tests.services import LoopbackServer, free_port
from tests.serving_support import Router, fake_replica

STRONG = "kq3V9-pXo2_LmZr7TbW8yNcE4fHs"


# -- the admin plane is never exposed without a real token --------------------------------------

@pytest.mark.parametrize("token", ["", "change-me", "CHANGE_ME", "changeme-now-please-really", "admin", "secret",
                                   "short-but-random-7Hq", "a" * 40, "abababababababababababab"])
@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "router", ""])
def test_off_loopback_a_weak_token_is_refused(host, token):
    assert token_weakness(token)
    with pytest.raises(ExposureError, match="not loopback"):
        check_exposure(host, token)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_on_loopback_any_token_will_do(host):
    check_exposure(host, "")  # the admin routes then refuse everything (test_serving_units)
    check_exposure("0.0.0.0", STRONG)


def test_serving_stack_refuses_before_starting_anything(tmp_path, monkeypatch):
    from serving import serve

    started = []
    monkeypatch.setattr(serve.ReplicaProcess, "start", lambda self: started.append(self))
    monkeypatch.delenv("ADAPT_ADMIN_TOKEN", raising=False)
    for token in ("", "change-me"):
        cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {"host": "0.0.0.0", "admin_token": token}})
        with pytest.raises(ExposureError):
            serve.ServingStack(cfg, head_dir=tmp_path, target_dir=tmp_path, replicas=1)
    monkeypatch.setenv("ADAPT_ADMIN_TOKEN", STRONG)
    cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {"host": "0.0.0.0"}})
    serve.ServingStack(cfg, head_dir=tmp_path, target_dir=tmp_path, replicas=1)
    cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {"host": "127.0.0.1", "admin_token": ""}})
    monkeypatch.delenv("ADAPT_ADMIN_TOKEN")
    serve.ServingStack(cfg, head_dir=tmp_path, target_dir=tmp_path, replicas=1)
    assert not started


def test_adapt_serve_and_controller_refuse_with_a_clear_error(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from app.cli import app
    from settings.config import dump_toml

    monkeypatch.delenv("ADAPT_ADMIN_TOKEN", raising=False)
    cfg = load_config(overrides={"state_dir": str(tmp_path), "serving": {"host": "0.0.0.0"}})
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(dump_toml(cfg))
    for args in (["serve"], ["controller", "--health-host", "0.0.0.0", "--health-port", "0"]):
        r = CliRunner().invoke(app, [*args, "--config", str(cfg_file)])
        assert r.exit_code == 2 and "admin token is empty" in r.output and "Traceback" not in r.output, r.output


def test_controller_health_endpoint_refuses_off_loopback_with_a_weak_token(tmp_path):
    from rollout.controller import Controller

    cfg = load_config(overrides={"state_dir": str(tmp_path)})
    with pytest.raises(ExposureError, match="health endpoint"):
        Controller(cfg, admin_token="change-me", health_host="0.0.0.0", health_port=0)


# -- the router's limits -----------------------------------------------------------------------

def test_router_limits_body_size_and_rejects_undecodable_or_too_deep_json():
    rep = fake_replica()
    with LoopbackServer(rep, free_port()) as s, Router(s.url, max_body_bytes=16 << 10) as r:
        ok = httpx.post(r.url + "/v1/completions", json={"prompt": "x" * 1000})
        assert ok.status_code == 200
        big = httpx.post(r.url + "/v1/completions", json={"prompt": "x" * (64 << 10)})
        assert big.status_code == 413
        # No Content-Length: the streamed body is counted.
        chunks = (b'{"prompt": "' + b"y" * 4096 for _ in range(8))
        assert httpx.post(r.url + "/v1/completions", content=chunks).status_code == 413
        deep = httpx.post(r.url + "/v1/completions", content=b"[" * 5000 + b"]" * 5000)
        assert deep.status_code == 400 and "nested too deeply" in deep.text
        assert httpx.post(r.url + "/v1/completions", content=b'{"prompt": "\xff"}').status_code == 400
        utf16 = json.dumps({"prompt": "x"}).encode("utf-16")
        assert httpx.post(r.url + "/v1/completions", content=utf16).status_code == 400
        # FastAPI's own body parsing (admin routes) also answers 400, not 500.
        assert httpx.post(r.url + "/admin/drain", content=b"[" * 5000 + b"]" * 5000).status_code in (400, 403)
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(r.url + path).status_code == 404, path
    assert len(rep.state.seen) == 1  # only the request within every limit reached the replica


def test_an_over_limit_body_gets_its_413_not_a_reset():
    """A 20 MB body at the default 8 MiB limit: the client reads a 413, declared or streamed (the router
    reads the rest of the body before answering, else the client's write meets a reset)."""
    rep = fake_replica()
    big = b'{"prompt": "' + b"z" * (20 << 20) + b'"}'
    with LoopbackServer(rep, free_port()) as s, Router(s.url, max_body_bytes=8 << 20) as r:
        for _ in range(2):  # the connection is closed after each: a new one works
            got = httpx.post(r.url + "/v1/completions", content=big, timeout=60)
            assert got.status_code == 413 and "over 8388608 bytes" in got.text
        streamed = httpx.post(r.url + "/v1/completions", content=(big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)),
                              timeout=60)
        assert streamed.status_code == 413
        # curl's way: Expect: 100-continue, so the body is never sent.
        p = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", "content-type: application/json",
                            "--data-binary", "@-", r.url + "/v1/completions"], input=big, capture_output=True, timeout=60)
        assert p.stdout == b"413", p
    assert rep.state.seen == []


def test_router_forwards_only_allowed_headers():
    rep = fake_replica()
    with LoopbackServer(rep, free_port()) as s, Router(s.url) as r:
        sent = {"Cookie": "session=abc", "X-Api-Key": "k-123", "X-Forwarded-For": "10.0.0.1",
                "Authorization": "Bearer user-token", "X-Request-Id": "req-7", "Forwarded": "for=1.2.3.4",
                "X-Real-IP": "1.2.3.4", "Proxy-Authorization": "Basic eA=="}
        assert httpx.post(r.url + "/v1/completions", json={"prompt": "x"}, headers=sent).status_code == 200
    got = rep.state.seen[0]["headers"]
    assert got["x-request-id"] == "req-7" and got["content-type"] == "application/json"
    for name in ("cookie", "x-api-key", "x-forwarded-for", "authorization", "forwarded", "x-real-ip",
                 "proxy-authorization"):
        assert name not in got, name


def _read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    t0 = time.monotonic()
    sock.settimeout(limit)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (TimeoutError, socket.timeout):
        raise AssertionError(f"connection still open after {limit} s; got {data[:200]!r}") from None
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def test_slow_clients_are_cut_off_with_408():
    rep = fake_replica()
    with LoopbackServer(rep, free_port()) as s, Router(s.url, header_timeout=0.5, body_timeout=1.0) as r:
        # Nothing at all, then partial headers, then a partial body: each connection is closed in time.
        idle = socket.create_connection(("127.0.0.1", r.port))
        partial_headers = socket.create_connection(("127.0.0.1", r.port))
        partial_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")
        partial_body = socket.create_connection(("127.0.0.1", r.port))
        partial_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"prompt\": \"")
        for sock, within in ((idle, 3), (partial_headers, 3), (partial_body, 4)):
            data, took = _read_until_closed(sock, within)
            sock.close()
            assert data.startswith(b"HTTP/1.1 408"), data[:200]
        # A client that keeps a request going but too slowly is cut off too.
        trickle = socket.create_connection(("127.0.0.1", r.port))
        start, cut = time.monotonic(), False
        try:
            for ch in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
                trickle.sendall(bytes([ch]))
                time.sleep(0.1)
        except (BrokenPipeError, ConnectionResetError):
            cut = True
        trickle.close()
        assert cut and time.monotonic() - start < 3
        # A normal request still works, on a kept-alive connection too.
        with httpx.Client() as c:
            for _ in range(2):
                assert c.post(r.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
                time.sleep(0.7)  # longer than the header deadline: idle keep-alive is not a slow request
    assert not rep.state.seen[:-2]


# -- the capture writer ---------------------------------------------------------------------------

def test_one_bad_record_cannot_drop_the_others(tmp_path: Path):
    """A lone surrogate in one request's body used to fail the whole batch (one .encode of all records)."""
    from capture.records import make_capture_record

    good = make_capture_record({"prompt": "fine"}, {"choices": [{"text": "a"}]})
    lone = make_capture_record({"prompt": "bad \ud800 body"}, {"choices": [{"text": "b"}]})

    async def main():
        w = CaptureWriter(str(tmp_path), "ep", flush_seconds=0.05)
        w.start()
        for line in (good, lone, None, "two\nlines", good):
            w.offer(line)  # type: ignore[arg-type]
        await w.close()
        return w

    w = asyncio.run(main())
    assert w.counts["written"] == 3 and w.counts["dropped_bad_record"] == 2 and w.counts["dropped_write_error"] == 0
    lines = [ln for f in tmp_path.rglob("*.jsonl") for ln in f.read_bytes().splitlines()]
    assert len(lines) == 3 and all(ln.isascii() or ln.decode("utf-8") for ln in lines)
    prompts = [json.loads(json.loads(ln)["captureData"]["endpointInput"]["data"])["prompt"] for ln in lines]
    assert sorted(prompts) == ["bad \ud800 body", "fine", "fine"]  # the escape round-trips


def test_capture_files_are_owner_only(tmp_path: Path):
    old = os.umask(0o022)
    try:
        async def main():
            w = CaptureWriter(str(tmp_path / "cap"), "ep", flush_seconds=0.01)
            w.start()
            w.offer('{"x": 1}')
            await w.close()

        asyncio.run(main())
    finally:
        os.umask(old)
    files = list((tmp_path / "cap").rglob("*.jsonl"))
    assert files
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    d = files[0].parent
    while d != tmp_path:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        d = d.parent


def test_a_failed_write_leaves_no_partial_file(tmp_path: Path):
    """A write that runs out of space (here: RLIMIT_FSIZE, EFBIG) is counted and leaves no *.jsonl.part."""
    code = textwrap.dedent(f"""
        import asyncio, json, resource, signal
        from serving.capture_writer import CaptureWriter
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        async def main():
            w = CaptureWriter({str(tmp_path)!r}, "ep", flush_seconds=0.05)
            w.start()
            for i in range(20):
                w.offer(json.dumps({{"i": i, "pad": "x" * 1000}}))
            await asyncio.sleep(0.5)
            w.offer(json.dumps({{"small": 1}}))
            await w.close()
            print(json.dumps(dict(w.counts, last_error=w.last_error)))
        asyncio.run(main())
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT)
    assert p.returncode == 0, p.stderr
    counts = json.loads(p.stdout.splitlines()[-1])
    assert counts["dropped_write_error"] == 20 and counts["written"] == 1, counts
    assert "File too large" in counts["last_error"]
    assert not list(tmp_path.rglob("*.part"))
    assert len(list(tmp_path.rglob("*.jsonl"))) == 1
