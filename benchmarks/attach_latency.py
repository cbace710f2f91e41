"""Latency the router adds in front of an attached replica: p50/p99 at c=1 and c=16, side by side.

One attached replica of the target as deployed: `adapt agent --embed -- <vllm serve line>` (the
agent holding vLLM's engine, bearer token, no dev mode), and a capturing router (`adapt serve`
attaching that agent, capture on) in front of it, each in its own process. Each round sends the
same chat requests to the agent directly and through the router (arms rotated every round), at
each concurrency. Latency is one request's, sent to full answer. (The agent is vLLM's own OpenAI
app in the engine's process with a token check in front: there is no separate replica behind it
to compare with.)

Noise: the spread (max - min) of each arm's per-round p50; an added latency within the direct
arm's own spread is not told apart from zero.

    python benchmarks/attach_latency.py [--target tiny] [--rounds 3] [--requests 48] [--max-tokens 16] [--json]
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

TOKEN = "bench-agent-token-0123456789abcdef"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def run_arm(url: str, model: str, headers: dict, n: int, conc: int, max_tokens: int, tag: str) -> list[float]:
    import httpx

    lat: list[float] = []
    todo = list(range(n))
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=conc + 4)) as c:
        async def worker() -> None:
            while todo:
                i = todo.pop()
                body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"{tag} request {i}: the of and to in code"}]}
                t0 = time.perf_counter()
                r = await c.post(url + "/v1/chat/completions", json=body, headers=headers)
                r.raise_for_status()
                lat.append((time.perf_counter() - t0) * 1000.0)
        await asyncio.gather(*(worker() for _ in range(conc)))
    return lat


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48, help="requests per arm, round and concurrency (x conc/4 at c>4)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import httpx

    from adapt.checkpoint import init_random_head
    from serving.replica import REPO_ROOT, ReplicaSpec, free_ports, vllm_serve_argv
    from serving.serve import served_name
    from settings.config import dump_toml, load_config
    from targets.model_zoo import ensure_target

    work = Path(tempfile.mkdtemp(prefix="attach-latency-"))
    replica_port, agent_port, router_port = free_ports(3)
    agent_url = f"http://127.0.0.1:{agent_port}"
    cfg = load_config(overrides={
        "state_dir": str(work), "target": {"model": args.target},
        "capture": {"source": str(work / "capture"), "endpoint": ""},
        "serving": {"replicas": 0, "router_port": router_port, "attach_agents": [agent_url]}})
    (work / "adapt.toml").write_text(dump_toml(cfg))
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    head = init_random_head(target, work / "head", k=cfg.head.num_speculative_tokens, seed=0)
    name = served_name(cfg.target)
    spec = ReplicaSpec(target_dir=str(target), head_dir=str(head), num_speculative_tokens=cfg.head.num_speculative_tokens,
                       port=replica_port, served_model_name=name, max_model_len=1024,
                       max_num_seqs=max(args.concurrency) + 2)
    env = dict(os.environ, ADAPT_AGENT_TOKEN=TOKEN, ADAPT_ADMIN_TOKEN="", PYTHONPATH=str(REPO_ROOT),
               ADAPT_CONFIG=str(work / "adapt.toml"))
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], log: str, url: str) -> None:
        p = subprocess.Popen([sys.executable, "-m", "app", *argv], env=env, cwd=REPO_ROOT, start_new_session=True,
                             stdout=open(work / log, "wb"), stderr=subprocess.STDOUT)
        procs.append(p)
        deadline = time.monotonic() + 1800  # an engine start on a loaded host
        while True:
            if p.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited: {(work / log).read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{argv[0]} not healthy")
            time.sleep(1)

    try:
        start(["agent", "--host", "127.0.0.1", "--port", str(agent_port), "--target", str(target),
               "--heads-dir", str(work / "agent-heads"), "--embed", "--", *vllm_serve_argv(spec, python=sys.executable)],
              "agent.log", agent_url)
        router_url = f"http://127.0.0.1:{router_port}"
        start(["serve", "--head", str(head)], "router.log", router_url)
        arms = {"agent": (agent_url, {"Authorization": f"Bearer {TOKEN}"}), "router+agent": (router_url, {})}
        # Warm every path (connection pools, the engine's first batches).
        for url, headers in arms.values():
            asyncio.run(run_arm(url, name, headers, 8, 4, args.max_tokens, "warm"))
        lat = {(a, c): [] for a in arms for c in args.concurrency}
        per_round = {(a, c): [] for a in arms for c in args.concurrency}
        order = list(arms)
        for rnd in range(args.rounds):
            for c in args.concurrency:
                n = args.requests * max(1, c // 4)
                for a in order[rnd % len(order):] + order[:rnd % len(order)]:
                    url, headers = arms[a]
                    got = asyncio.run(run_arm(url, name, headers, n, c, args.max_tokens, f"r{rnd}c{c}"))
                    lat[(a, c)] += got
                    per_round[(a, c)].append(statistics.median(got))
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)

    rows = []
    for c in args.concurrency:
        d50, d99 = pct(lat[("agent", c)], 0.5), pct(lat[("agent", c)], 0.99)
        for a in arms:
            xs = lat[(a, c)]
            p50, p99 = pct(xs, 0.5), pct(xs, 0.99)
            rounds = per_round[(a, c)]
            rows.append({"arm": a, "concurrency": c, "requests": len(xs), "p50_ms": round(p50, 1),
                         "p99_ms": round(p99, 1), "added_p50_ms": round(p50 - d50, 1),
                         "added_p99_ms": round(p99 - d99, 1),
                         "p50_spread_ms": round(max(rounds) - min(rounds), 1)})
    out = {"target": str(target), "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": rows}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"target {Path(target).name}, chat, max_tokens {args.max_tokens}, {args.rounds} rounds (arms rotated)")
        print(f"{'arm':<13} {'c':>3} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} "
              f"{'p50 spread':>10}")
        for r in rows:
            print(f"{r['arm']:<13} {r['concurrency']:>3} {r['requests']:>5} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
                  f"{r['added_p50_ms']:>8.1f} {r['added_p99_ms']:>8.1f} {r['p50_spread_ms']:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
