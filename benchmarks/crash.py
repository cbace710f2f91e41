"""A replica killed under load: what the router saves, and what capture keeps.

Starts a pool (router + N vLLM replicas on loopback, capture on), drives it with concurrent chat
clients (every third request streamed), `kill -9`s one replica's process group, keeps the load on
until the pool has restarted it and it serves again, then stops. Prints the requests answered and
failed, split into streams whose client had already received part of the answer (no proxy can
save those: the router retries a request once on another replica only while the client has
received nothing) and the rest, the seconds the pool took to bring the replica back, and the
capture records written against the requests answered.

    python benchmarks/crash.py [--target tiny] [--replicas 2] [--clients 16] [--eager] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.replica import free_ports  # noqa: E402
from traffic.loadgen import SteadyLoad  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds of load before the kill and after the return")
    ap.add_argument("--eager", action="store_true", help="start replicas with --enforce-eager (faster start-up)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from adapt.checkpoint import init_random_head
    from serving.serve import ServingStack
    from settings.config import load_config
    from targets.model_zoo import ensure_target

    work = Path(tempfile.mkdtemp(prefix="crash-bench-"))
    base, router_port = free_ports(2)
    cfg = load_config(overrides={
        "state_dir": str(work), "target": {"model": args.target},
        "serving": {"replicas": args.replicas, "base_port": base, "router_port": router_port,
                    "admin_token": "bench", "max_model_len": 1024, "max_num_seqs": args.clients + 2},
        "capture": {"source": str(work / "capture"), "endpoint": "", "redact": False},
    })
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    head = init_random_head(target, work / "head", k=cfg.head.num_speculative_tokens, seed=0)
    stack = ServingStack(cfg, head_dir=head, target_dir=target, writer_kwargs={"flush_seconds": 0.2},
                         replica_extra_args=["--enforce-eager"] if args.eager else None)
    stack.start()

    def written() -> int:
        time.sleep(1.0)
        while stack.writer.queue.qsize():
            time.sleep(0.2)
        time.sleep(1.0)
        return stack.writer.counts["written"]

    try:
        before = written()
        victim = stack.pool.replicas[-1]
        with SteadyLoad(stack.url, stack.model_name, args.clients, max_seconds=3600, max_tokens=args.max_tokens,
                        completions=False) as load:
            time.sleep(args.settle)
            in_flight = victim.outstanding
            t_kill = time.monotonic()
            os.killpg(victim.proc.proc.pid, signal.SIGKILL)
            while not (victim.restarts >= 1 and victim.healthy):
                time.sleep(0.5)
                if time.monotonic() - t_kill > 1800:
                    raise TimeoutError("the pool did not bring the replica back in 30 min")
            back_s = time.monotonic() - t_kill
            time.sleep(args.settle)
        captured = written() - before
    finally:
        stack.stop()
    failed_started = len(load.failed_started)
    out = {"target": str(target), "replicas": args.replicas, "clients": args.clients, "max_tokens": args.max_tokens,
           "in_flight_on_victim_at_kill": in_flight, "answered": load.ok, "failed": len(load.failed),
           "failed_streams_already_answering": failed_started, "failed_otherwise": len(load.failed) - failed_started,
           "replica_back_s": round(back_s, 1), "capture_records": captured, "failures": load.failed[:8]}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"target {Path(target).name}, {args.replicas} replicas, {args.clients} chat clients (1 in 3 streamed), "
              f"kill -9 of one with {in_flight} requests in flight on it")
        print(f"answered {load.ok}, failed {len(load.failed)} ({failed_started} streams already answering, "
              f"{len(load.failed) - failed_started} otherwise); replica back after {back_s:.0f} s; "
              f"capture records {captured} for {load.ok} answered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
