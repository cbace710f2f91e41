"""Swap a head across a live 2-replica pool under steady load: in place vs rolling restart.

Starts a pool (router + N vLLM replicas on loopback), keeps a bounded concurrent
load on the router, then (1) swaps head A→B in place, (2) swaps B→A by rolling
restart (forced), and prints per-replica swap time and failed client requests
for each, in the same run.

With ``--router-workers N`` (N > 1) the router is N worker processes on one port (``[serving]
router_workers``) and each swap is asked for as an operator asks, ``POST /admin/swap`` on the router's
port: a worker passes it to the process that owns the pool, and every worker routes and captures
through the swap. After each swap, every worker's answer to ``/admin/status`` must name the new head.

    python benchmarks/swap.py [--target tiny|smollm2|DIR] [--replicas 2] [--workers 3] [--router-workers 1]
                              [--eager] [--in-place-only] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.pool import free_pool_ports  # noqa: E402
from traffic.loadgen import SteadyLoad  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--workers", type=int, default=3, help="load clients")
    ap.add_argument("--router-workers", type=int, default=1, help="router processes on the router's port")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of load before and after each swap")
    ap.add_argument("--eager", action="store_true", help="start replicas with --enforce-eager (faster start-up)")
    ap.add_argument("--in-place-only", action="store_true", help="skip the rolling restart")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from adapt.checkpoint import init_random_head
    from serving.serve import ServingStack
    from settings.config import load_config
    from targets.model_zoo import ensure_target

    work = Path(tempfile.mkdtemp(prefix="swap-bench-"))
    base, router_port = free_pool_ports(args.replicas)
    cfg = load_config(overrides={
        "state_dir": str(work), "target": {"model": args.target},
        "serving": {"replicas": args.replicas, "base_port": base, "router_port": router_port,
                    "admin_token": "bench", "max_model_len": 1024, "router_workers": args.router_workers},
        "capture": {"source": str(work / "capture")},
    })
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    heads = [init_random_head(target, work / f"head{s}", k=cfg.head.num_speculative_tokens, seed=s) for s in (0, 1)]
    stack = ServingStack(cfg, head_dir=heads[0], target_dir=target,
                         replica_extra_args=["--enforce-eager"] if args.eager else None)
    t0 = time.perf_counter()
    stack.start()
    start_s = time.perf_counter() - t0
    rows = []
    try:
        methods = (("in-place", heads[1], False), ("rolling restart", heads[0], True))
        for name, head, restart in methods[:1] if args.in_place_only else methods:
            with SteadyLoad(stack.url, stack.model_name, args.workers, max_seconds=900, max_tokens=24,
                            completions=False) as load:
                time.sleep(args.settle)
                if args.router_workers > 1:
                    rep = admin_swap(stack.url, str(head), restart)
                else:
                    rep = stack.run_coro(stack.controller.swap(str(head), force_restart=restart), 3600).to_json()
                time.sleep(args.settle)
            views = worker_heads(stack.url, args.router_workers) if args.router_workers > 1 else {}
            rows.append({"method": name, "ok": rep["ok"], "mode": rep["mode"], "error": rep["error"],
                         "per_replica_ms": [round(s.get("swap_ms", float("nan")), 1) for s in rep["replicas"]],
                         "worker_ms": [s.get("worker_ms") and round(s["worker_ms"], 1) for s in rep["replicas"]],
                         "steps_ms": [s.get("steps_ms") for s in rep["replicas"]],
                         "total_s": round(rep["seconds"], 2), "requests_ok": load.ok,
                         "requests_failed": len(load.failed), "failures": load.failed[:5],
                         "router_workers_see_new_head": all(v == [rep["head"]["sha256"]] for v in views.values())
                         if views else None, "router_worker_heads": views})
    finally:
        stack.stop()
    out = {"target": str(target), "replicas": args.replicas, "load_workers": args.workers,
           "router_workers": args.router_workers,
           "pool_start_s": round(start_s, 1), "results": rows}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"target {target.name}, {args.replicas} replicas, {args.workers} load workers, "
              f"{args.router_workers} router process(es), pool start {start_s:.0f} s")
        print(f"{'method':<16} {'ok':<5} {'swap ms per replica':<28} {'total s':>8} {'req ok':>7} {'req failed':>10}")
        for r in rows:
            print(f"{r['method']:<16} {str(r['ok']):<5} {str(r['per_replica_ms']):<28} {r['total_s']:>8} "
                  f"{r['requests_ok']:>7} {r['requests_failed']:>10}")
            for i, st in enumerate(r.get("steps_ms") or []):
                if st:
                    print(f"  replica {i}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in st.items()))
            if r["router_worker_heads"]:
                print(f"  heads each router worker's /admin/status names: {r['router_worker_heads']}")
            if r["error"]:
                print(f"  error: {r['error']}")
    return 0 if all(r["ok"] and r["requests_failed"] == 0 and r["router_workers_see_new_head"] is not False
                    for r in rows) else 1


def admin_swap(url: str, head: str, restart: bool) -> dict:
    """A swap as an operator asks for it: through the router's port (with workers, one of them passes it on)."""
    import httpx

    r = httpx.post(url + "/admin/swap", json={"head": head, "restart": restart}, timeout=3600,
                   headers={"Authorization": "Bearer bench"})
    if r.status_code not in (200, 409):
        raise RuntimeError(f"/admin/swap answered {r.status_code}: {r.text[:500]}")
    return r.json()


def worker_heads(url: str, n: int) -> dict[str, list[str]]:
    """The replicas' head sha256s as each router worker's ``/admin/status`` gives them (new connections until
    every worker has answered)."""
    import httpx

    seen: dict[str, list[str]] = {}
    for _ in range(50 * n):
        with httpx.Client(timeout=60) as c:
            r = c.get(url + "/admin/status", headers={"Authorization": "Bearer bench"})
        seen[r.headers.get("x-router-worker", "?")] = sorted({x["head_sha256"] for x in r.json()["replicas"]})
        if len(seen) >= n:
            break
    return seen


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
