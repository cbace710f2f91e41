"""The capturing router at fleet rates: requests per second and router CPU per request, direct vs router.

A fake replica that answers at once (a vLLM-shaped chat completion of ~200 tokens, or 51 SSE
events when streamed, each written on its own; it answers an agent's ``/agent/head`` too), the real
`adapt serve` attaching it as an agent (capture on, every request sampled), and closed-loop keep-alive clients at each concurrency, JSON and
streamed. Each case runs the clients against the replica directly and then through the router,
side by side in one run. The router is pinned to one core (``--router-core``); the replica and
the clients share the others (``--client-cores``).

``--workers 1 2`` starts a router of each size and runs every case through each in turn, right after
the direct arm (``[serving] router_workers``:
1 = the router in `adapt serve` itself, N > 1 = N worker processes on its port, ``serving.workers``),
with ``--router-core`` naming as many cores as the largest; its CPU is then the sum over `adapt serve`
and its workers. On a machine with few cores, the clients and the fake replica share the router's
cores when ``--client-cores`` overlaps them: say so with the figures.

Per case: requests per second, p50/p99 latency added by the router (router minus direct),
router CPU per answered request (utime+stime of the router's process from /proc, from the
case's start until its capture is written), requests failed, and capture records written
against requests answered. The load average is printed with the figures: on a shared machine
other work on the router's core inflates its CPU time per request and lowers its rate.

    python benchmarks/router_rate.py [--seconds 5] [--concurrency 1 8 32 128] [--modes json stream] [--json]
    python benchmarks/router_rate.py --workers 1 2 --router-core 0-1 --client-cores 0-1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"
COMPLETION_TOKENS = 200
EVENTS = 51  # 50 deltas of 4 tokens, then [DONE]


# -- the fake replica --------------------------------------------------------------------------

def _replica_bodies(head: str) -> dict[str, bytes]:
    """Precomputed answers: a chat completion, the SSE events of the same, with and without token ids."""
    words = [f"w{i % 97}" for i in range(COMPLETION_TOKENS)]
    prompt_ids = list(range(100, 120))
    ids = [1000 + i % 500 for i in range(COMPLETION_TOKENS)]

    def completion(with_ids: bool) -> bytes:
        choice = {"index": 0, "message": {"role": "assistant", "content": " ".join(words), "tool_calls": [],
                                          "reasoning_content": None}, "logprobs": None,
                  "finish_reason": "length", "stop_reason": None}
        body = {"id": "chatcmpl-bench", "object": "chat.completion", "created": 1764230400, "model": MODEL,
                "choices": [choice], "service_tier": None, "system_fingerprint": None,
                "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + COMPLETION_TOKENS,
                          "completion_tokens": COMPLETION_TOKENS, "prompt_tokens_details": None},
                "prompt_logprobs": None, "kv_transfer_params": None}
        if with_ids:
            choice["token_ids"] = ids
            body["prompt_token_ids"] = prompt_ids
        return json.dumps(body).encode()

    def events(with_ids: bool) -> list[bytes]:
        out = []
        per = COMPLETION_TOKENS // (EVENTS - 1)
        for e in range(EVENTS - 1):
            delta = {"content": " ".join(words[e * per:(e + 1) * per])}
            if e == 0:
                delta = {"role": "assistant", **delta}
            choice = {"index": 0, "delta": delta, "logprobs": None,
                      "finish_reason": "length" if e == EVENTS - 2 else None}
            if with_ids:
                choice["token_ids"] = ids[e * per:(e + 1) * per]
            ev = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1764230400, "model": MODEL,
                  "choices": [choice]}
            if with_ids and e == 0:
                ev["prompt_token_ids"] = prompt_ids
            out.append(b"data: " + json.dumps(ev).encode() + b"\n\n")
        out.append(b"data: [DONE]\n\n")
        return out

    def chunked(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def ok(body: bytes, ctype: bytes = b"application/json") -> bytes:
        return (b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                % (ctype, len(body), body))

    agent_head = json.dumps({"path": head, "sha256": None, "version": None, "swaps": 0, "last_swap_ms": None,
                             "num_speculative_tokens": 3})
    return {
        "chat": ok(completion(False)), "chat_ids": ok(completion(True)),
        "stream_head": b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                       b"transfer-encoding: chunked\r\n\r\n",
        "events": [chunked(e) for e in events(False)], "events_ids": [chunked(e) for e in events(True)],
        "health": ok(b"", b"text/plain"), "metrics": ok(b"# no spec-decode counters here\n", b"text/plain"),
        "models": ok(json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()),
        "agent_head": ok(agent_head.encode()),
        "missing": b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n",
    }


class _Replica(asyncio.Protocol):
    bodies: dict = {}

    def connection_made(self, transport) -> None:
        self.t = transport
        self.buf = b""
        self.streaming: asyncio.Task | None = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.streaming is None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            n = 0
            i = head.lower().find(b"content-length:")
            if i >= 0:
                j = head.find(b"\r\n", i)
                n = int(head[i + 15:j if j >= 0 else len(head)])
            if len(self.buf) < end + 4 + n:
                return
            body = self.buf[end + 4:end + 4 + n]
            self.buf = self.buf[end + 4 + n:]
            path = head.split(b" ", 2)[1].split(b"?")[0]
            self.answer(path, body)

    def answer(self, path: bytes, body: bytes) -> None:
        b = self.bodies
        if path in (b"/v1/chat/completions", b"/v1/completions"):
            ids = b'"return_token_ids": true' in body or b'"return_token_ids":true' in body
            if b'"stream": true' in body or b'"stream":true' in body:
                self.streaming = asyncio.get_running_loop().create_task(
                    self.stream(b["events_ids" if ids else "events"]))
            else:
                self.t.write(b["chat_ids" if ids else "chat"])
            return
        key = {b"/health": "health", b"/metrics": "metrics", b"/v1/models": "models",
               b"/agent/head": "agent_head"}.get(path, "missing")
        self.t.write(b[key])

    async def stream(self, events: list[bytes]) -> None:
        # Each event written on its own, as a replica emits them: the router sees them one by one.
        self.t.write(self.bodies["stream_head"])
        for e in events:
            if self.t.is_closing():
                return
            self.t.write(e)
            await asyncio.sleep(0)
        self.t.write(b"0\r\n\r\n")
        self.streaming = None
        if self.buf:
            self.data_received(b"")

    def connection_lost(self, exc) -> None:
        if self.streaming is not None:
            self.streaming.cancel()


def run_replica(port: int, head: str) -> None:
    import uvloop

    _Replica.bodies = _replica_bodies(head)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(_Replica, "127.0.0.1", port, backlog=4096)
        print("ready", flush=True)
        await srv.serve_forever()

    uvloop.run(main())


# -- the clients -------------------------------------------------------------------------------

def _request(path: str, stream: bool, i: int) -> bytes:
    body = json.dumps({"model": MODEL, "max_tokens": COMPLETION_TOKENS, "temperature": 0, "stream": stream,
                       "messages": [{"role": "user", "content": f"request {i}: the quick brown fox, in 200 words"}]},
                      separators=(",", ":")).encode()
    return (b"POST %s HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\naccept: */*\r\n"
            b"content-length: %d\r\n\r\n%s" % (path.encode(), len(body), body))


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one HTTP/1.1 response (content-length or chunked); its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    lower = head.lower()
    i = lower.find(b"content-length:")
    if i >= 0:
        await reader.readexactly(int(lower[i + 15:lower.find(b"\r\n", i)]))
    elif b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


def run_clients(url: str, concurrency: int, seconds: float, stream: bool) -> dict:
    """Closed-loop keep-alive clients for ``seconds``; latencies (ms) and failures."""
    import uvloop

    host, port = url.split("//")[1].split(":")
    lat: list[float] = []
    failed = {"n": 0, "why": {}}

    async def one(k: int, deadline: float) -> None:
        reader = writer = None
        i = 0
        while time.perf_counter() < deadline:
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, int(port))
                t0 = time.perf_counter()
                writer.write(_request("/v1/chat/completions", stream, k * 10_000_000 + i))
                status = await _read_response(reader)
                t1 = time.perf_counter()
                i += 1
                if status != 200:
                    raise RuntimeError(f"http {status}")
                lat.append((t1 - t0) * 1000.0)
            except Exception as exc:  # noqa: BLE001 - counted, and the connection is opened anew
                failed["n"] += 1
                why = f"{type(exc).__name__}: {str(exc)[:80]}"
                failed["why"][why] = failed["why"].get(why, 0) + 1
                if writer is not None:
                    writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    async def main() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(k, t0 + seconds) for k in range(concurrency)))
        return time.perf_counter() - t0

    wall = uvloop.run(main())
    return {"lat_ms": lat, "failed": failed["n"], "why": failed["why"], "wall_s": wall}


# -- the run -----------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """:func:`cpu_seconds` of ``pid`` and its live children (`adapt serve` and its router workers)."""
    total = cpu_seconds(pid)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                total += cpu_seconds(int(d.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return total


def captured(capture_dir: Path) -> int:
    n = 0
    for f in capture_dir.rglob("*.jsonl"):
        with open(f, "rb") as fh:
            n += sum(1 for _ in fh)
    return n


def client_case(url: str, c: int, seconds: float, stream: bool, cores: str) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        out = subprocess.run(["taskset", "-c", cores, sys.executable, __file__, "--client", url, "--concurrency",
                              str(c), "--seconds", str(seconds), "--result", f.name,
                              *(["--stream"] if stream else [])], capture_output=True, text=True,
                             timeout=seconds + 120)
        if out.returncode != 0:
            raise RuntimeError(f"clients failed: {out.stderr[-2000:]}")
        return json.loads(Path(f.name).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds per case and arm")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--modes", nargs="+", default=["json", "stream"], choices=["json", "stream"])
    ap.add_argument("--target", default=MODEL, help="the target the router's head is checked against (a name or directory)")
    ap.add_argument("--router-core", default="0", help="the router's cores (taskset -c), e.g. 0 or 0-1")
    ap.add_argument("--workers", type=int, nargs="+", default=[1],
                    help="router processes ([serving] router_workers); several: a router of each size, "
                         "every case through each in turn")
    ap.add_argument("--client-cores", default="1", help="the replica's and the clients' cores (taskset -c)")
    ap.add_argument("--router-only", action="store_true", help="skip the direct arm (profiling runs)")
    ap.add_argument("--hold", type=float, default=0.0, help="keep everything up this long after the run")
    ap.add_argument("--json", action="store_true")
    # internal: the subprocesses
    ap.add_argument("--replica", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--head", help=argparse.SUPPRESS)
    ap.add_argument("--client", help=argparse.SUPPRESS)
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.replica:
        run_replica(args.replica, args.head)
        return 0
    if args.client:
        Path(args.result).write_text(json.dumps(run_clients(args.client, args.concurrency[0], args.seconds,
                                                            args.stream)))
        return 0

    import httpx

    from adapt.checkpoint import init_random_head
    from serving.replica import free_ports
    from settings.config import dump_toml, load_config
    from targets.model_zoo import ensure_target

    os.sched_setaffinity(0, {c for part in args.client_cores.split(",") for a, _, b in [part.partition("-")]
                             for c in range(int(a), int(b or a) + 1)})
    work = Path(tempfile.mkdtemp(prefix="router-rate-"))
    replica_port, *router_ports = free_ports(1 + len(args.workers))
    replica_url = f"http://127.0.0.1:{replica_port}"

    def config(workers: int, port: int) -> Path:
        cfg = load_config(overrides={
            "state_dir": str(work / f"router-{workers}"), "target": {"model": args.target},
            "capture": {"source": str(work / f"capture-{workers}"), "endpoint": "", "redact": False},
            "serving": {"replicas": 0, "router_port": port, "attach_agents": [replica_url],
                        "capture_sampling_pct": 100, "router_workers": workers}})
        path = work / f"adapt-{workers}.toml"
        path.write_text(dump_toml(cfg))
        return path

    cfg = load_config(overrides={"state_dir": str(work), "target": {"model": args.target}})
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    head = init_random_head(target, work / "head", k=cfg.head.num_speculative_tokens, seed=0)
    env = dict(os.environ, ADAPT_ADMIN_TOKEN="", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               ADAPT_AGENT_TOKEN="router-rate-bench-token-0123456789abcdef")
    procs: list[subprocess.Popen] = []

    def wait_health(url: str, p: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + 300
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(url)
            time.sleep(0.3)

    def stop(p: subprocess.Popen) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)

    rows = []
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    try:
        rlog = work / "replica.log"
        procs.append(subprocess.Popen(["taskset", "-c", args.client_cores, sys.executable, __file__, "--replica",
                                       str(replica_port), "--head", str(head)], stdout=open(rlog, "wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
        wait_health(replica_url, procs[-1], rlog)
        # Every router size up at once, each case run through each in turn right after the direct arm:
        # load from other work on the machine falls on all of them alike.
        routers: dict[int, tuple[subprocess.Popen, str, Path]] = {}
        for workers, port in zip(args.workers, router_ports):
            slog = work / f"router-{workers}.log"
            # `adapt serve` stops its workers itself (they run in sessions of their own).
            router = subprocess.Popen(["taskset", "-c", args.router_core, sys.executable, "-m", "app", "serve",
                                       "--head", str(head)], env=dict(env, ADAPT_CONFIG=str(config(workers, port))),
                                      cwd=REPO, stdout=open(slog, "wb"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
            procs.append(router)
            url = f"http://127.0.0.1:{port}"
            wait_health(url, router, slog)
            routers[workers] = (router, url, work / f"capture-{workers}")
            print(f"router ({workers} worker(s)) pid {router.pid}, log {slog}", file=sys.stderr, flush=True)
        for workers, (router, url, capture_dir) in routers.items():
            warm = captured(capture_dir) + sum(len(client_case(url, 8, 1.0, stream, args.client_cores)["lat_ms"])
                                               for stream in (False, True))  # both paths warm, their capture written
            deadline = time.monotonic() + 30
            while captured(capture_dir) < warm and time.monotonic() < deadline:
                time.sleep(0.1)
        for mode in args.modes:
            stream = mode == "stream"
            for c in args.concurrency:
                direct = None if args.router_only else client_case(replica_url, c, args.seconds, stream,
                                                                   args.client_cores)
                for workers, (router, url, capture_dir) in routers.items():
                    cap0 = captured(capture_dir)
                    cpu0 = tree_cpu_seconds(router.pid)
                    via = client_case(url, c, args.seconds, stream, args.client_cores)
                    answered = len(via["lat_ms"])
                    deadline = time.monotonic() + 30
                    while (got := captured(capture_dir) - cap0) < answered and time.monotonic() < deadline:
                        time.sleep(0.1)
                    time.sleep(0.3)  # a duplicate would show here
                    got = captured(capture_dir) - cap0
                    cpu = tree_cpu_seconds(router.pid) - cpu0
                    row = {"workers": workers, "mode": mode, "concurrency": c,
                           "direct_rps": round(len(direct["lat_ms"]) / direct["wall_s"]) if direct else None,
                           "router_rps": round(answered / via["wall_s"]),
                           "router_p50_ms": round(pct(via["lat_ms"], 0.5), 2),
                           "router_p99_ms": round(pct(via["lat_ms"], 0.99), 2),
                           "router_cpu_ms_per_req": round(1000 * cpu / max(answered, 1), 3),
                           "failed": via["failed"] + (direct["failed"] if direct else 0),
                           "failures": {**(direct["why"] if direct else {}), **via["why"]},
                           "answered": answered, "captured": got}
                    if direct:
                        row["added_p50_ms"] = round(row["router_p50_ms"] - pct(direct["lat_ms"], 0.5), 2)
                        row["added_p99_ms"] = round(row["router_p99_ms"] - pct(direct["lat_ms"], 0.99), 2)
                    rows.append(row)
                    if not args.json:
                        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.hold:
            time.sleep(args.hold)
    finally:
        for p in reversed(procs):
            stop(p)
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    out = {"seconds": args.seconds, "router_core": args.router_core, "workers": args.workers, "client_cores": args.client_cores,
           "loadavg_before": load_before, "loadavg_after": load_after, "cores": os.cpu_count(), "rows": rows}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"router on core {args.router_core}, replica and clients on {args.client_cores}; {args.seconds:g} s per "
          f"case and arm; load average {' '.join(load_before)} before, {' '.join(load_after)} after "
          f"({os.cpu_count()} cores)")
    print(f"{'wk':>2} {'mode':<6} {'c':>4} {'direct/s':>9} {'router/s':>9} {'+p50 ms':>8} {'+p99 ms':>8} {'cpu ms/req':>10} "
          f"{'failed':>6} {'captured/answered':>18}")
    for r in rows:
        d = "-" if r["direct_rps"] is None else str(r["direct_rps"])
        a50 = r.get("added_p50_ms", r["router_p50_ms"])
        a99 = r.get("added_p99_ms", r["router_p99_ms"])
        print(f"{r['workers']:>2} {r['mode']:<6} {r['concurrency']:>4} {d:>9} {r['router_rps']:>9} {a50:>8.2f} {a99:>8.2f} "
              f"{r['router_cpu_ms_per_req']:>10.3f} {r['failed']:>6} {r['captured']:>8}/{r['answered']:<9}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
