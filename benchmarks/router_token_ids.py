"""Router CPU per request with and without token-exact capture (``return_token_ids``), side by side.

A fake replica that answers at once, as vLLM 0.32 writes its answers: a chat completion of
``--tokens`` tokens, or a stream of one SSE event per ``--per-event`` tokens (each written on its
own), with the prompt's and output's token ids when the request asks for them, ``null`` in their
place when not. Two routers (``serving.router.create_app`` on uvicorn, capture on, every request
sampled) in front of it, one with ``capture_token_ids`` off and one with it on, each in its own
process. Rounds alternate the two, JSON and streamed; a closed-loop keep-alive client sends
``--requests`` requests per round at ``--concurrency``. CPU per request is the router process's
utime+stime over the round (from /proc), until its capture is written, divided by the requests.

On a shared machine other work inflates CPU time: compare the arms' medians over rounds, and the
spread (min..max) the rounds give each arm.

    python benchmarks/router_token_ids.py [--rounds 5] [--requests 400] [--concurrency 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# -- the fake replica --------------------------------------------------------------------------

def _answers(tokens: int, per_event: int) -> dict[str, bytes | list[bytes]]:
    words = [f" w{i % 97}" for i in range(tokens)]
    prompt = list(range(100, 160))
    out = [1000 + i % 500 for i in range(tokens)]

    def ids(xs: list[int], on: bool) -> str:
        return json.dumps(xs, separators=(",", ":")) if on else "null"

    def chat(on: bool) -> bytes:
        text = json.dumps("".join(words))
        return ('{"id":"chatcmpl-b","object":"chat.completion","created":7,"model":"m","choices":[{"index":0,'
                f'"message":{{"role":"assistant","content":{text},"refusal":null,"reasoning":null}},"logprobs":null,'
                f'"finish_reason":"length","stop_reason":null,"token_ids":{ids(out, on)},"routed_experts":null}}],'
                f'"usage":{{"prompt_tokens":{len(prompt)},"completion_tokens":{tokens}}},"prompt_logprobs":null,'
                f'"prompt_token_ids":{ids(prompt, on)},"prompt_text":null,"kv_transfer_params":null}}').encode()

    def events(on: bool) -> list[bytes]:
        head = '{"id":"chatcmpl-b","object":"chat.completion.chunk","created":7,"model":"m","choices":'
        evs = [head + '[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
               f'"prompt_token_ids":{ids(prompt, on)},"prompt_text":null}}']
        for s in range(0, tokens, per_event):
            last = s + per_event >= tokens
            fin = '"finish_reason":"length","stop_reason":null' if last else '"finish_reason":null'
            delta = json.dumps({"content": "".join(words[s:s + per_event])}, separators=(",", ":"))
            evs.append(head + f'[{{"index":0,"delta":{delta},"logprobs":null,{fin},'
                       f'"token_ids":{ids(out[s:s + per_event], on)}}}]}}')
        return [b"data: " + e.encode() + b"\n\n" for e in evs] + [b"data: [DONE]\n\n"]

    def ok(body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)

    def chunked(e: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(e), e)

    return {"json": ok(chat(False)), "json_ids": ok(chat(True)),
            "events": [chunked(e) for e in events(False)], "events_ids": [chunked(e) for e in events(True)],
            "stream_head": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                           b"transfer-encoding: chunked\r\n\r\n",
            "health": ok(b"{}")}


class _Replica(asyncio.Protocol):
    answers: dict = {}

    def connection_made(self, transport) -> None:
        self.t, self.buf, self.busy = transport, b"", False

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(self.buf) < end + 4 + n:
                return
            body, self.buf = self.buf[end + 4:end + 4 + n], self.buf[end + 4 + n:]
            a = self.answers
            if not head.startswith(b"post"):
                self.t.write(a["health"])
                continue
            ids = b'"return_token_ids":true' in body
            if b'"stream":true' in body:
                self.busy = True
                asyncio.get_running_loop().create_task(self.stream(a["events_ids" if ids else "events"]))
            else:
                self.t.write(a["json_ids" if ids else "json"])

    async def stream(self, events: list[bytes]) -> None:
        self.t.write(self.answers["stream_head"])
        for e in events:  # one write per event, as a replica emits them
            self.t.write(e)
            await asyncio.sleep(0)
        self.t.write(b"0\r\n\r\n")
        self.busy = False
        if self.buf:
            self.data_received(b"")


def run_replica(port: int, tokens: int, per_event: int) -> None:
    _Replica.answers = _answers(tokens, per_event)

    async def main() -> None:
        srv = await asyncio.get_running_loop().create_server(_Replica, "127.0.0.1", port, backlog=1024)
        print("ready", flush=True)
        await srv.serve_forever()

    asyncio.run(main())


# -- a router ----------------------------------------------------------------------------------

def run_router(port: int, replica: str, capture: str, token_ids: bool) -> None:
    import uvicorn

    from serving.capture_writer import CaptureWriter
    from serving.pool import Pool
    from serving.router import create_app, server_config

    async def main() -> None:
        pool = Pool(health_interval=5.0)
        pool.attach(replica)
        await pool.start_background()
        writer = CaptureWriter(capture, "bench", flush_seconds=0.1)
        app = create_app(pool, writer=writer, capture_token_ids=token_ids)
        srv = uvicorn.Server(server_config(app, "127.0.0.1", port, log_level="warning"))
        await srv.serve()

    asyncio.run(main())


# -- the client --------------------------------------------------------------------------------

def _request(stream: bool, i: int) -> bytes:
    body = json.dumps({"model": "m", "max_tokens": 200, "temperature": 0, "stream": stream,
                       "messages": [{"role": "user", "content": f"request {i}: the quick brown fox"}]},
                      separators=(",", ":")).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: b\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body))


async def _read(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    i = lower.find(b"content-length:")
    if i >= 0:
        body = await reader.readexactly(int(lower[i + 15:lower.find(b"\r\n", i)]))
    else:
        body = b""
        while size := int((await reader.readuntil(b"\r\n"))[:-2], 16):
            body += (await reader.readexactly(size + 2))[:-2]
        await reader.readexactly(2)
    return int(head[9:12]), body


async def send(url: str, n: int, concurrency: int, stream: bool) -> int:
    """``n`` requests; the number answered 200 (the first failure's status and body are printed)."""
    host, port = url.split("//")[1].split(":")
    left = list(range(n))
    ok = 0

    async def worker() -> None:
        nonlocal ok
        reader, writer = await asyncio.open_connection(host, int(port))
        while left:
            writer.write(_request(stream, left.pop()))
            status, body = await _read(reader)
            if status == 200:
                ok += 1
            elif ok >= 0:
                print(f"{url}: HTTP {status}: {body[:300]!r}", file=sys.stderr)
                ok = -n  # printed once; the count stays short
        writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return max(ok, 0)


# -- the run -----------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lines(d: Path) -> int:
    return sum(f.read_bytes().count(b"\n") for f in d.rglob("*.jsonl"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400, help="requests per round and arm")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--per-event", type=int, default=4, help="tokens per SSE event")
    ap.add_argument("--modes", nargs="+", default=["json", "stream"], choices=["json", "stream"])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--router", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--capture", help=argparse.SUPPRESS)
    ap.add_argument("--ids", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.replica:
        run_replica(args.replica, args.tokens, args.per_event)
        return 0
    if args.router:
        run_router(args.router, args.upstream, args.capture, args.ids)
        return 0

    import httpx

    from serving.replica import free_ports

    work = Path(tempfile.mkdtemp(prefix="router-token-ids-"))
    rport, off_port, on_port = free_ports(3)
    upstream = f"http://127.0.0.1:{rport}"
    procs = []

    def start(*extra: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, __file__, "--tokens", str(args.tokens), "--per-event",
                              str(args.per_event), *extra], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=open(work / f"{len(procs)}.log", "wb"))
        procs.append(p)
        return p

    def healthy(url: str) -> None:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{url} did not start; logs in {work}")

    arms = {}
    try:
        start("--replica", str(rport))
        healthy(upstream)
        for name, port, ids in (("off", off_port, False), ("on", on_port, True)):
            d = work / name
            p = start("--router", str(port), "--upstream", upstream, "--capture", str(d), *(["--ids"] if ids else []))
            arms[name] = (f"http://127.0.0.1:{port}", p, d)
        for url, _, _ in arms.values():
            healthy(url)
            for stream in (False, True):  # warm both paths
                asyncio.run(send(url, 50, 4, stream))
        rows: dict[tuple[str, str], list[float]] = {}
        for mode in args.modes:
            for rnd in range(args.rounds):
                for name in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                    url, p, d = arms[name]
                    done0 = lines(d)
                    c0 = cpu_seconds(p.pid)
                    ok = asyncio.run(send(url, args.requests, args.concurrency, mode == "stream"))
                    deadline = time.monotonic() + 30
                    while lines(d) < done0 + ok and time.monotonic() < deadline:
                        time.sleep(0.05)
                    rows.setdefault((mode, name), []).append(1000 * (cpu_seconds(p.pid) - c0) / max(ok, 1))
                    if ok != args.requests:
                        raise RuntimeError(f"{args.requests - ok} requests failed ({name}, {mode})")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
    out = {"rounds": args.rounds, "requests": args.requests, "concurrency": args.concurrency, "tokens": args.tokens,
           "per_event": args.per_event, "loadavg": Path("/proc/loadavg").read_text().split()[:3], "rows": []}
    for mode in args.modes:
        off, on = rows[(mode, "off")], rows[(mode, "on")]
        out["rows"].append({"mode": mode, "off_ms": statistics.median(off), "on_ms": statistics.median(on),
                            "ratio": statistics.median(on) / statistics.median(off),
                            "off_spread": [min(off), max(off)], "on_spread": [min(on), max(on)]})
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"router CPU ms per request, median of {args.rounds} rounds of {args.requests} requests at c={args.concurrency}"
          f" ({args.tokens} tokens, {args.per_event} per SSE event); load average {' '.join(out['loadavg'])}")
    print(f"{'mode':<7}{'ids off':>9}{'ids on':>9}{'on/off':>8}   spread off / on")
    for r in out["rows"]:
        print(f"{r['mode']:<7}{r['off_ms']:>9.3f}{r['on_ms']:>9.3f}{r['ratio']:>8.3f}   "
              f"{r['off_spread'][0]:.3f}..{r['off_spread'][1]:.3f} / {r['on_spread'][0]:.3f}..{r['on_spread'][1]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
