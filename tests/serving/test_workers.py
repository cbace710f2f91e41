"""Router workers (serving.workers): two processes on one socket, one pool, capture complete across a kill."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from serving.capture_journal import JournalWriter, Publisher, claim_spool, recover
from serving.poolview import SharedPool
from serving.router import create_app
from serving.serve import LoopService
from serving.workers import CaptureSpec, CaptureTotals, RouterWorkers, WorkerSpec, merge_metrics
from tests.serving_support import fake_replica
from tests.services import LoopbackServer, free_port

TOKEN = "workers-test-admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TAG = re.compile(rb"req-(\d+)-(\d+)")


class Workers(LoopService):
    """The parent of ``adapt serve`` with ``router_workers = n`` over ``replica_urls``: the pool (health
    checks every 0.2 s) and admin app on a private loop, ``n`` worker processes on a loopback port."""

    def __init__(self, replica_urls: list[str], capture_dir: Path, log_dir: Path, n: int = 2) -> None:
        super().__init__(uvloop=True)
        self.urls, self.capture_dir, self.log_dir, self.n = replica_urls, capture_dir, log_dir, n
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool = SharedPool(health_interval=0.2)
        self.workers: RouterWorkers | None = None

    async def _start(self, ready_timeout: float) -> None:
        for u in self.urls:
            self.pool.attach(u)
        await self.pool.start_background()
        app = create_app(self.pool, writer=CaptureTotals(self.pool), admin_token=TOKEN)  # type: ignore[arg-type]
        spec = WorkerSpec(capture=CaptureSpec(str(self.capture_dir), "ep", spool_root=str(self.capture_dir / ".spool"),
                                              flush_seconds=0.2), no_replica_wait=2.0)
        self.workers = RouterWorkers(self.pool, app, spec, "127.0.0.1", self.port, self.n, log_dir=self.log_dir)
        await self.workers.start(timeout=60)

    async def _stop(self) -> None:
        if self.workers is not None:
            await self.workers.stop()
        await self.pool.close()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def served(self) -> dict[int, int]:
        """Requests each live worker has answered (from its last report)."""
        return {slot: sum(c.served for c in rep.replicas.values()) for slot, rep in self.pool.reports.items()}


def settle(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


def captured_tags(capture_dir: Path) -> list[bytes]:
    """The request tag of every published capture record (journals still in a spool are not published)."""
    out = []
    for f in capture_dir.rglob("*.jsonl"):
        for line in f.read_bytes().splitlines():
            m = TAG.search(line)
            assert m, line[:200]
            out.append(m.group(0))
    return out


async def load(url: str, seconds: float, concurrency: int, *, on_tick=None, per_connection: int = 10, run: int = 0
               ) -> tuple[list[bytes], int]:
    """Closed-loop clients, half streaming, each request tagged, a new connection every ``per_connection``
    requests (the kernel spreads connections over the workers); (tags answered whole, failures)."""
    done: list[bytes] = []
    failed = 0

    async def request(c: httpx.AsyncClient, tag: bytes, stream: bool) -> bool:
        body = {"model": "tiny", "stream": stream, "messages": [{"role": "user", "content": tag.decode()}]}
        try:
            if stream:
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    got = b"".join([x async for x in r.aiter_bytes()])
                    return r.status_code == 200 and got.endswith(b"data: [DONE]\n\n")
            return (await c.post(url + "/v1/chat/completions", json=body)).status_code == 200
        except httpx.HTTPError:
            return False

    async def one(k: int) -> None:
        nonlocal failed
        i = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            async with httpx.AsyncClient(timeout=10) as c:
                for _ in range(per_connection):
                    if time.monotonic() >= deadline:
                        break
                    tag = f"req-{run * 1000 + k}-{i}".encode()
                    i += 1
                    if await request(c, tag, stream=i % 2 == 0):
                        done.append(tag)
                    else:
                        failed += 1

    async def ticker() -> None:
        if on_tick is not None:
            await on_tick()

    await asyncio.gather(*(one(k) for k in range(concurrency)), ticker())
    return done, failed


def admin_via(url: str, slot: str, method: str, path: str, **kw) -> httpx.Response:
    """An admin request on a connection worker ``slot`` accepted (new connections until one does)."""
    for _ in range(200):
        with httpx.Client(timeout=30) as c:
            r = c.request(method, url + path, headers=AUTH, **kw)
        if r.headers.get("x-router-worker") == slot:
            return r
    raise AssertionError(f"no connection reached worker {slot}")


@pytest.fixture()
def replicas():
    a, b = fake_replica(), fake_replica()
    with LoopbackServer(a, free_port()) as ra, LoopbackServer(b, free_port()) as rb:
        yield (ra, a), (rb, b)


@pytest.mark.services  # worker processes: seconds each to start
def test_two_workers_answer_share_one_pool_and_capture_all_across_a_kill(tmp_path, replicas):
    """One stack (a worker start costs seconds): both workers answer, every answer is captured once; a
    drain through one is seen by the other; a worker killed under load is started again and every
    request answered whole before, during and after is captured, none twice."""
    (ra, app_a), (rb, _) = replicas
    with Workers([ra.url, rb.url], tmp_path / "capture", tmp_path / "logs").start() as w:
        done, failed = asyncio.run(load(w.url, 2.0, 8))
        assert failed == 0 and len(done) > 30
        settle(lambda: sum(w.served().values()) == len(done))  # reports come every 20 ms
        served = w.served()
        assert sorted(served) == [0, 1] and all(n > 0 for n in served.values()), served  # both workers answered

        # One pool: a drain through worker 0 is seen by worker 1 (its status, and its routing).
        r = admin_via(w.url, "0", "POST", "/admin/drain", json={"url": ra.url, "timeout": 10})
        assert r.status_code == 200 and r.json()["drained"] is True
        st = admin_via(w.url, "1", "GET", "/admin/status").json()
        assert [x["draining"] for x in st["replicas"]] == [True, False]
        assert st["capture"]["written"] == len(done)  # the workers' capture counters, summed
        hits_a, before = app_a.state.hits, w.served()
        done2, failed2 = asyncio.run(load(w.url, 1.0, 8, run=1))
        assert failed2 == 0 and app_a.state.hits == hits_a  # no worker sent the drained replica anything
        settle(lambda: sum(w.served().values()) == len(done) + len(done2))
        assert all(w.served()[s] > before[s] for s in (0, 1))
        admin_via(w.url, "1", "POST", "/admin/undrain", json={"url": ra.url})
        assert [x["draining"] for x in admin_via(w.url, "0", "GET", "/admin/status").json()["replicas"]] == [False, False]
        with httpx.Client() as c:
            assert c.post(w.url + "/admin/drain", json={"url": ra.url}).status_code == 401
            assert c.post(w.url + "/admin/drain", json={"url": ra.url},
                          headers={"Authorization": "Bearer wrong"}).status_code == 403
            metrics = c.get(w.url + "/metrics").text
            # Bad input keeps its answers in a worker.
            assert c.post(w.url + "/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"}).status_code == 400
            assert c.post(w.url + "/v1/chat/completions", content=b"x" * (9 << 20)).status_code == 413
            assert c.post(w.url + "/admin/drain", content=b"x" * (9 << 20), headers=AUTH).status_code == 413
        assert 'worker="0"' in metrics and 'worker="1"' in metrics

        # kill -9 worker 0 while it has requests in flight.
        pid0 = w.workers.workers[0].proc.pid
        killed: dict[str, int] = {}

        async def kill_in_flight() -> None:
            await asyncio.sleep(0.5)
            give_up = time.monotonic() + 1.5
            while sum(c.outstanding for c in w.pool.reports[0].replicas.values()) == 0 and time.monotonic() < give_up:
                await asyncio.sleep(0.005)
            os.kill(pid0, signal.SIGKILL)
            killed["at"] = 1

        done3, failed3 = asyncio.run(load(w.url, 2.5, 8, on_tick=kill_in_flight, run=2))
        assert killed and len(done3) > 10
        settle(lambda: w.workers.restarts[0] == 1 and 0 in w.workers.workers and w.workers.workers[0].ready, 30)
        assert w.workers.workers[0].proc.pid != pid0
        before = w.served().get(0, 0)
        done4, failed4 = asyncio.run(load(w.url, 1.0, 8, run=3))
        assert failed4 == 0
        settle(lambda: w.served().get(0, 0) > before)  # the new worker 0 serves
    tags = captured_tags(tmp_path / "capture")
    assert len(tags) == len(set(tags)), "a record captured twice"
    answered = set(done) | set(done2) | set(done3) | set(done4)
    assert answered <= set(tags), f"{len(answered - set(tags))} answered request(s) not captured"
    # Captured but not answered whole: requests whose record the killed worker had written and whose answer
    # it had not finished sending; each of them failed at its client.
    assert len(set(tags) - answered) <= failed3
    assert not list((tmp_path / "capture" / ".spool").rglob("*.part"))  # all published at stop


def test_journal_recovers_whole_lines_and_publishes_each_once(tmp_path):
    dest, spool = tmp_path / "cap", tmp_path / "cap" / ".spool" / "worker-0"

    async def first() -> JournalWriter:
        w = JournalWriter(str(dest), "ep", spool=spool, batch_size=100, flush_seconds=60)
        w.start()
        for i in range(3):
            assert w.offer(json.dumps({"req": f"req-0-{i}"}))
        assert w.offer("two\nlines") is False and w.counts["dropped_bad_record"] == 1
        return w  # "killed": never closed

    w = asyncio.run(first())
    assert not list(dest.rglob("*.jsonl"))  # in the journal only
    assert w.counts["written"] == 3 and w.counts["published"] == 0  # nothing an ingest can read yet
    # While it lives, no other writer takes its spool (nor publishes its open file); `adapt serve`'s own
    # process takes the next free one beside it.
    with pytest.raises(RuntimeError, match="held by other live router processes"):
        JournalWriter(str(dest), "ep", spool=spool).start()
    other, fd = claim_spool(spool.parent, "worker-0", alternatives=1)
    assert other == spool.parent / "worker-0-1"
    os.close(fd)
    os.close(w._lock_fd)  # the kill: the kernel releases a dead process's lock
    part = next(spool.glob("*.part"))
    with open(part, "ab") as f:
        f.write(b'{"req": "req-0-3", "cut by the ki')  # a record whose request was never answered

    async def second() -> JournalWriter:
        w2 = JournalWriter(str(dest), "ep", spool=spool, flush_seconds=0.1)
        w2.start()  # publishes what the first one left
        assert w2.offer(json.dumps({"req": "req-1-0"}))
        await w2.close()
        return w2

    w2 = asyncio.run(second())
    assert w2.counts["recovered"] == 3 and w2.counts["dropped_partial"] == 1 and w2.counts["written"] == 1
    assert w2.counts["published"] == 4  # the recovered records and its own
    assert sorted(captured_tags(dest)) == [b"req-0-0", b"req-0-1", b"req-0-2", b"req-1-0"]
    assert recover(spool, Publisher(str(dest))) == (0, 0, 0)  # nothing left: a second recovery is a no-op
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in dest.rglob("*.jsonl"))
    del w


def test_a_journal_keeps_every_record_of_a_saturated_loop(tmp_path):
    """A router under load finishes many requests in one turn of its event loop: 64 tasks here each offer a
    record and spend 20 µs of CPU per turn, 40,000 records in all. Every one is published and none dropped:
    the journal writes on the request path and publishes by a rename on the loop, where a queue drained by
    threads (the batching writer) waits for a GIL the busy loop hardly yields, fills, and drops."""
    dest = tmp_path / "cap"

    async def main() -> dict[str, int]:
        w = JournalWriter(str(dest), "ep", spool=dest / ".spool" / "router", flush_seconds=0.05)
        w.start()
        line = json.dumps({"captureData": {"endpointInput": {"data": "x" * 600}}})

        async def producer() -> None:
            for _ in range(625):
                assert w.offer(line)
                until = time.perf_counter() + 20e-6  # the request's own work
                while time.perf_counter() < until:
                    pass
                await asyncio.sleep(0)

        await asyncio.gather(*(producer() for _ in range(64)))
        await w.close(timeout=60)
        return w.counts

    counts = asyncio.run(main())
    assert counts["written"] == counts["published"] == 40_000 and counts["dropped_write_error"] == 0, counts
    assert sum(len(f.read_bytes().splitlines()) for f in dest.rglob("*.jsonl")) == 40_000
    assert not list((dest / ".spool").rglob("*.part"))


def test_metrics_merge_labels_each_worker():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    def expo(n: int) -> bytes:
        reg = CollectorRegistry()
        Counter("adapt_router_requests", "Requests", ["route"], registry=reg).labels("chat").inc(n)
        Counter("adapt_capture_records", "Capture", ["outcome"], registry=reg).labels("written").inc(n)
        return generate_latest(reg)

    parent = CollectorRegistry()
    Counter("adapt_capture_records", "Capture", ["outcome"], registry=parent).labels("written").inc(5)
    text = merge_metrics(generate_latest(parent), {0: expo(2), 1: expo(3)}).decode()
    assert 'adapt_router_requests_total{route="chat",worker="0"} 2.0' in text
    assert 'adapt_router_requests_total{route="chat",worker="1"} 3.0' in text
    assert 'adapt_capture_records_total{outcome="written"} 5.0' in text and 'outcome="written",worker' not in text


def test_journal_to_s3_publishes_each_file_once(tmp_path, s3_server):
    dest = f"s3://{s3_server.bucket}/journal-{tmp_path.name}"
    kw = {"endpoint_url": s3_server.endpoint_url, "aws_access_key_id": s3_server.access_key,
          "aws_secret_access_key": s3_server.secret_key, "region_name": s3_server.region}
    spool = tmp_path / "spool"

    async def killed() -> JournalWriter:
        w = JournalWriter(dest, "ep", spool=spool, s3_client_kwargs=kw, flush_seconds=60)
        w.start()
        for i in range(3):
            w.offer(json.dumps({"req": f"req-0-{i}"}))
        return w

    os.close(asyncio.run(killed())._lock_fd)  # the kill: the kernel releases a dead process's lock
    left = next(spool.glob("*.part"))
    saved = left.read_bytes()
    assert recover(spool, Publisher(dest, kw)) == (1, 3, 0)
    left.write_bytes(saved)  # as if the process died between the upload and the file's removal
    assert recover(spool, Publisher(dest, kw)) == (1, 3, 0)  # uploaded again, to the same key

    async def next_worker() -> None:
        w = JournalWriter(dest, "ep", spool=spool, s3_client_kwargs=kw, flush_seconds=60)
        w.start()
        w.offer(json.dumps({"req": "req-1-0"}))
        await w.close()
        assert w.counts["objects"] == 1 and w.counts["unpublished"] == 0

    asyncio.run(next_worker())
    c = s3_server.client()
    prefix = dest.split("/", 3)[3]
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix)["Contents"]]
    lines = [ln for k in keys for ln in c.get_object(Bucket=s3_server.bucket, Key=k)["Body"].read().splitlines()]
    assert len(keys) == 2 and sorted(TAG.search(ln).group(0) for ln in lines) == [
        b"req-0-0", b"req-0-1", b"req-0-2", b"req-1-0"]
    assert all(k.startswith(f"{prefix}/ep/AllTraffic/") for k in keys)


def test_shared_pool_drain_waits_for_every_worker_and_sums_their_counts():
    from serving.pool import Pool
    from serving.poolview import ReplicaCounts, WorkerReport, apply

    def rep(gen: int, a: tuple[int, int], down: dict | None = None) -> WorkerReport:
        return WorkerReport(gen, {"http://a": ReplicaCounts(a[0], a[1], 0)}, down or {}, {"written": a[1]})

    async def main() -> None:
        pool = SharedPool()
        for u in ("http://a", "http://b"):
            pool.attach(u).healthy = True
        pushed = []
        pool.publish = pushed.append
        pool.live_slots = lambda: {0, 1}
        g0 = pool.push_if_changed()
        pool.take_report(0, rep(g0, (1, 0)))
        pool.take_report(1, rep(g0, (0, 0)))
        drain = asyncio.create_task(pool.drain("http://a", 5))
        await asyncio.sleep(0.1)
        g = pushed[-1].gen
        assert g > g0 and pushed[-1].replicas[0].draining and not drain.done()  # no worker has seen it yet
        pool.take_report(0, rep(g, (1, 3)))  # seen, one request still in flight
        pool.take_report(1, rep(g, (0, 2)))
        await asyncio.sleep(0.1)
        assert not drain.done()
        pool.take_report(0, rep(g, (0, 4)))
        assert await asyncio.wait_for(drain, 1) is True
        assert pool.get("http://a").served == 6 and pool.capture_counts()["written"] == 6
        pool.worker_gone(0)  # what a dead worker served stays counted
        assert pool.get("http://a").served == 6 and pool.capture_counts()["written"] == 6
        # A replica one worker saw refuse a connection is out of rotation for every worker.
        pool.take_report(1, rep(g, (0, 2), {"http://b": "connect: refused"}))
        assert pushed[-1].replicas[1].healthy is False and pool.get("http://b").last_error == "connect: refused"
        # A worker's copy follows the state and keeps its own in-flight count.
        mine = Pool()
        apply(mine, pushed[-1])
        mine.replicas[0].outstanding = 2
        pool.undrain("http://a")
        apply(mine, pushed[-1])
        assert [(r.url, r.draining, r.healthy, r.outstanding) for r in mine.replicas] == [
            ("http://a", False, True, 2), ("http://b", False, False, 0)]

    asyncio.run(main())
