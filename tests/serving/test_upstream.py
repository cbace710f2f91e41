"""serving.upstream: the router's keep-alive connections to replicas, against a raw HTTP/1.1 server on loopback.

The server is an asyncio protocol in the test's own loop, so each behaviour a replica can show (keep the
connection, close it while idle, reset it mid-answer, stall, answer megabytes) is scripted exactly.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from serving.router import RESET_ERRORS
from serving.upstream import HIGH_WATER, PooledTransport


class _Server(asyncio.Protocol):
    """Answers each request per ``script(n, body)`` -> (bytes to write, then what: "keep", "close", "reset",
    "stall"); counts connections and requests."""

    def __init__(self, state: dict) -> None:
        self.state = state
        self.buf = b""

    def connection_made(self, transport) -> None:
        self.t = transport
        self.state["connections"] += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].lower()
            n = int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) if b"content-length: " in head else 0
            if len(self.buf) < end + 4 + n:
                return
            body, self.buf = self.buf[end + 4:end + 4 + n], self.buf[end + 4 + n:]
            self.state["requests"] += 1
            data, then = self.state["script"](self.state["requests"], body)
            self.t.write(data)
            if then == "close":
                self.t.close()
            elif then == "reset":
                self.t.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00"
                                                           b"\x00\x00\x00\x00")
                self.t.close()
            if then != "keep":
                return


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def chunked(parts: list[bytes], end: bool = True) -> bytes:
    out = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    out += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + (b"0\r\n\r\n" if end else b"")


async def _serve(script) -> tuple[asyncio.AbstractServer, dict, str]:
    state = {"connections": 0, "requests": 0, "script": script}
    srv = await asyncio.get_running_loop().create_server(lambda: _Server(state), "127.0.0.1", 0)
    return srv, state, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


def _client(**kw) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=PooledTransport(**kw), timeout=httpx.Timeout(5.0, connect=2.0))


def test_connections_are_kept_and_reused_and_bodies_whole():
    async def main():
        srv, state, url = await _serve(lambda n, body: (ok(b'{"n":%d,"echo":%s}' % (n, body)), "keep"))
        async with _client() as c:
            for i in range(20):
                r = await c.post(url + "/v1/chat/completions", content=b'{"i":%d}' % i)
                assert r.status_code == 200 and r.json()["echo"] == {"i": i}
            assert state["connections"] == 1
            # 16 at once need 16 connections; afterwards they serve one after another again
            got = await asyncio.gather(*(c.post(url + "/x", content=b"1") for _ in range(16)))
            assert all(r.status_code == 200 for r in got) and state["connections"] == 16
            for _ in range(5):
                await c.post(url + "/x", content=b"1")
            assert state["connections"] == 16
        srv.close()
    asyncio.run(main())


def test_a_stream_arrives_in_order_and_its_connection_serves_again():
    events = [b"data: {\"i\": %d}\n\n" % i for i in range(51)] + [b"data: [DONE]\n\n"]

    async def main():
        srv, state, url = await _serve(lambda n, body: (chunked(events), "keep"))
        async with _client() as c:
            for _ in range(3):
                async with c.stream("POST", url + "/v1/chat/completions", content=b"{}") as r:
                    assert r.headers["content-type"] == "text/event-stream"
                    got = b"".join([p async for p in r.aiter_raw()])
                assert got == b"".join(events)
        assert state["connections"] == 1
        srv.close()
    asyncio.run(main())


def test_an_idle_connection_the_replica_closed_is_replaced_not_failed():
    """The replica closes a kept connection while it is idle (its keep-alive timeout): the next request
    goes on a new connection, and the replica sees it once."""
    async def main():
        srv, state, url = await _serve(lambda n, body: (ok(b"{}"), "close" if n == 1 else "keep"))
        async with _client() as c:
            assert (await c.post(url + "/a", content=b"1")).status_code == 200
            await asyncio.sleep(0.05)
            assert (await c.post(url + "/b", content=b"2")).status_code == 200
        assert state["requests"] == 2 and state["connections"] == 2
        srv.close()
    asyncio.run(main())


def test_a_connection_idle_past_its_expiry_is_not_reused():
    async def main():
        srv, state, url = await _serve(lambda n, body: (ok(b"{}"), "keep"))
        async with _client(keepalive_expiry=0.05) as c:
            await c.post(url + "/a", content=b"1")
            await asyncio.sleep(0.1)
            await c.post(url + "/b", content=b"1")
        assert state["connections"] == 2
        srv.close()
    asyncio.run(main())


@pytest.mark.parametrize("how", ["reset", "close"])
def test_a_replica_that_dies_mid_answer_is_a_reset_error(how: str):
    """What the router retries on another replica (before the client got a byte) or aborts the client on."""
    async def main():
        srv, state, url = await _serve(lambda n, body: (chunked([b"data: 1\n\n"], end=False), how))
        async with _client() as c:
            with pytest.raises(RESET_ERRORS):
                async with c.stream("POST", url + "/v1/chat/completions", content=b"{}") as r:
                    async for _ in r.aiter_raw():
                        pass
            # and before any byte of the answer
            state["script"] = lambda n, body: (b"", how)
            with pytest.raises(RESET_ERRORS):
                await c.post(url + "/v1/chat/completions", content=b"{}")
        srv.close()
    asyncio.run(main())


def test_refused_and_silent_replicas():
    async def main():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there
        srv, state, url = await _serve(lambda n, body: (b"", "stall"))
        async with httpx.AsyncClient(transport=PooledTransport(), timeout=httpx.Timeout(0.3, connect=2.0)) as c:
            with pytest.raises(httpx.ConnectError):
                await c.post(f"http://127.0.0.1:{port}/x", content=b"1")
            with pytest.raises(httpx.ReadTimeout):
                await c.post(url + "/x", content=b"1")
        srv.close()
    asyncio.run(main())


def test_a_slow_reader_pauses_the_replica_and_loses_nothing():
    big = [bytes([65 + i % 26]) * (256 << 10) for i in range(16)]  # 4 MiB in 256 KiB chunks

    async def main():
        srv, state, url = await _serve(lambda n, body: (chunked(big), "keep"))
        async with _client() as c:
            async with c.stream("POST", url + "/x", content=b"{}") as r:
                got, most = [], 0
                async for part in r.aiter_raw():
                    got.append(part)
                    most = max(most, len(part))
                    await asyncio.sleep(0.01)
            assert b"".join(got) == b"".join(big)
            assert most <= HIGH_WATER + (256 << 10) + 65536  # reading stopped near the mark, not at 4 MiB
        srv.close()
    asyncio.run(main())


def _self_signed(d) -> tuple[str, str]:
    """A certificate for 127.0.0.1 and its key, as files under ``d``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    (d / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return str(d / "cert.pem"), str(d / "key.pem")


def test_an_https_agent_is_verified_against_its_ca(tmp_path):
    """Agents may serve HTTPS: the connection checks the agent's certificate against the pool's CA, and one
    it cannot verify is a connect error (nothing reached the agent)."""
    import ssl

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)

    async def main():
        state = {"connections": 0, "requests": 0, "script": lambda n, body: (ok(b'{"n":%d}' % n), "keep")}
        srv = await asyncio.get_running_loop().create_server(lambda: _Server(state), "127.0.0.1", 0, ssl=server_ctx)
        url = f"https://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
        async with _client(verify=ssl.create_default_context(cafile=cert)) as c:
            for _ in range(3):
                assert (await c.post(url + "/v1/chat/completions", content=b"{}")).status_code == 200
        assert state["connections"] == 1
        async with _client(verify=True) as c:  # the system's trust store does not know this CA
            with pytest.raises(httpx.ConnectError):
                await c.post(url + "/v1/chat/completions", content=b"{}")
        srv.close()
    asyncio.run(main())
