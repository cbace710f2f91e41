"""A replica killed under load: what the router saves, and what capture keeps.

Starts a pool (router + N vLLM replicas on loopback, capture on), drives it with concurrent chat
clients (every third request streamed), kills one replica, keeps the load on until the pool has
restarted it and it serves again (or, with ``--no-wait-return``, for ``--settle`` seconds more), then
stops. ``--kill process`` (the default) is ``kill -9`` of the replica's process group: its
connections are reset. ``--kill engine`` is ``kill -9`` of its engine core process alone: the API
server that holds the engine answers what it had in flight with vLLM's ``EngineDeadError`` (a 500, or
an error event as a stream's first) and then exits.

Prints the requests answered and failed, split into streams whose client had already received part
of the answer (no proxy can save those: the router retries a request on another replica only while
the client has received nothing) and the rest, the seconds the pool took to bring the replica back,
and the capture records written against the requests answered. The check: 0 failed among the
requests that had not started streaming when the replica died (exit status 1 otherwise).

With ``--router-workers N`` the router is N worker processes on one port (``[serving] router_workers``),
each retrying and capturing on its own, and the capture records counted are their journals, published.

    python benchmarks/crash.py [--target tiny] [--replicas 2] [--clients 16] [--eager] [--router-workers 1]
                               [--kill process|engine] [--no-wait-return] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.pool import free_pool_ports  # noqa: E402
from serving.replica import stat_fields  # noqa: E402
from traffic.loadgen import SteadyLoad  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of load before the kill and after the return")
    ap.add_argument("--eager", action="store_true", help="start replicas with --enforce-eager (faster start-up)")
    ap.add_argument("--kill", choices=("process", "engine"), default="process",
                    help="kill -9 the replica's whole process group, or its engine core process alone")
    ap.add_argument("--no-wait-return", dest="wait_return", action="store_false",
                    help="stop --settle seconds after the kill instead of after the replica's return")
    ap.add_argument("--router-workers", type=int, default=1, help="router processes on the router's port")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from adapt.checkpoint import init_random_head
    from serving.serve import ServingStack
    from settings.config import load_config
    from targets.model_zoo import ensure_target

    work = Path(tempfile.mkdtemp(prefix="crash-bench-"))
    base, router_port = free_pool_ports(args.replicas)
    cfg = load_config(overrides={
        "state_dir": str(work), "target": {"model": args.target},
        "serving": {"replicas": args.replicas, "base_port": base, "router_port": router_port,
                    "admin_token": "bench", "max_model_len": 1024, "max_num_seqs": args.clients + 2,
                    "router_workers": args.router_workers},
        "capture": {"source": str(work / "capture"), "endpoint": "", "redact": False},
    })
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    head = init_random_head(target, work / "head", k=cfg.head.num_speculative_tokens, seed=0)
    stack = ServingStack(cfg, head_dir=head, target_dir=target, writer_kwargs={"flush_seconds": 0.2},
                         replica_extra_args=["--enforce-eager"] if args.eager else None)
    stack.start()

    def published() -> int:
        """Records published so far (router workers' journals too), once what is queued has landed."""
        time.sleep(1.0)
        while stack.capture.queue.qsize():
            time.sleep(0.2)
        time.sleep(1.0)
        return stack.capture.counts["published"]

    try:
        before = published()
        victim = stack.pool.replicas[-1]
        with SteadyLoad(stack.url, stack.model_name, args.clients, max_seconds=3600, max_tokens=args.max_tokens,
                        completions=False) as load:
            time.sleep(args.settle)
            in_flight = victim.outstanding
            t_kill = time.monotonic()
            if args.kill == "engine":
                os.kill(engine_core_pid(victim.proc.proc.pid), signal.SIGKILL)
            else:
                os.killpg(victim.proc.proc.pid, signal.SIGKILL)
            back_s = None
            if args.wait_return:
                while not (victim.restarts >= 1 and victim.healthy):
                    time.sleep(0.5)
                    if time.monotonic() - t_kill > 1800:
                        raise TimeoutError("the pool did not bring the replica back in 30 min")
                back_s = time.monotonic() - t_kill
            time.sleep(args.settle)
        captured = published() - before
        retries = router_retries(stack.url)
    finally:
        stack.stop()
    failed_started = len(load.failed_started)
    failed_otherwise = len(load.failed) - failed_started
    out = {"target": str(target), "replicas": args.replicas, "router_workers": args.router_workers,
           "clients": args.clients, "max_tokens": args.max_tokens,
           "kill": args.kill, "in_flight_on_victim_at_kill": in_flight, "answered": load.ok,
           "failed": len(load.failed), "failed_streams_already_answering": failed_started,
           "failed_otherwise": failed_otherwise, "router_retries": retries,
           "replica_back_s": None if back_s is None else round(back_s, 1), "capture_records": captured,
           "failures": load.failed[:8], "check_passed": failed_otherwise == 0}
    if args.json:
        print(json.dumps(out))
    else:
        what = "engine core process" if args.kill == "engine" else "process group"
        print(f"target {Path(target).name}, {args.replicas} replicas, {args.router_workers} router process(es), "
              f"{args.clients} chat clients (1 in 3 streamed), "
              f"kill -9 of one replica's {what} with {in_flight} requests in flight on it")
        back = f"replica back after {back_s:.0f} s" if back_s is not None else "replica's return not awaited"
        print(f"answered {load.ok}, failed {len(load.failed)} ({failed_started} streams already answering, "
              f"{failed_otherwise} otherwise); router retries {retries}; {back}; "
              f"capture records {captured} for {load.ok} answered")
        print(f"check: 0 failed among requests that had not started streaming when the replica died: "
              f"{'passed' if failed_otherwise == 0 else f'FAILED ({failed_otherwise})'}")
        for f in load.failed[:8]:
            print(f"  failure: {f}")
    return 0 if failed_otherwise == 0 else 1


def router_retries(url: str) -> dict[str, float]:
    """The router's retries so far, by reason (its /metrics; its workers' summed)."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    # With router workers each series also carries its worker="N" label: summed over them.
    for k, v in re.findall(r'adapt_router_retries_total\{reason="(\w+)"[^}]*\} ([0-9.]+)', text):
        out[k] = out.get(k, 0.0) + float(v)
    return out


def engine_core_pid(replica_pid: int) -> int:
    """The engine core process under a replica: the descendant vLLM titles ``VLLM::EngineCore``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields and len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo, found = list(children.get(replica_pid, [])), []
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            cmd = (Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/comm").read_bytes())
        except OSError:
            continue
        if b"EngineCore" in cmd:
            found.append(pid)
    if len(found) != 1:
        raise RuntimeError(f"expected one engine core process under the replica (pid {replica_pid}), found {found}")
    return found[0]


if __name__ == "__main__":
    raise SystemExit(main())
