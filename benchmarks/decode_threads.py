"""Greedy decoding on a CPU: all threads, one thread and ``decode_threads``' pick, quiet and beside busy processes.

The offline acceptance estimate (the cycle's evaluate step, ``adapt eval``) decodes the
target's greedy answers token by token (:meth:`adapt.hidden_states.TargetRunner.greedy_batch`).
This decodes the same prompts in each setting, interleaved over ``--rounds`` rounds, first
on the machine as it is and then beside ``--busy`` processes that each run small torch ops on
one thread pinned to a core (as a vLLM CPU engine binds its threads), and prints seconds per
setting, per round, with the ratios to all threads.

    python benchmarks/decode_threads.py [--target smollm2|tiny|DIR] [--prompts 8] [--tokens 32]
                                        [--rounds 2] [--busy N (default: every core)] [--json]

These competitors leave all-thread decoding about as fast as one thread; a real CI suite
beside it (vLLM engines and test servers) made it about 10x slower than one thread: run it
with ``--busy 0`` beside the load that matters to see that case.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spin(stop, core: int) -> None:
    """One competitor: small torch ops in a loop on one thread pinned to one core, as a vLLM CPU
    engine binds its OpenMP threads to cores."""
    import os

    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)

    a = torch.randn(64, 576)
    b = torch.randn(576, 576)
    while not stop.is_set():
        for _ in range(10):
            a = torch.tanh(a @ b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from adapt.device import decode_threads, usable_cores
    from adapt.hidden_states import TargetRunner
    from settings.config import load_config
    from targets.model_zoo import ensure_target

    cfg = load_config()
    target = ensure_target(args.target, cfg.target.model_cache)
    runner = TargetRunner(target, [1], device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = runner.model.config.vocab_size
    prompts = [torch.randint(100, vocab - 1, (80 + 10 * i,), generator=g).tolist() for i in range(args.prompts)]
    runner.greedy_batch(prompts, 2)  # warm-up
    n = torch.get_num_threads()
    busy = usable_cores() if args.busy is None else args.busy

    def timed(setting: str) -> tuple[float, int]:
        if setting == "pick":
            with decode_threads(torch.device("cpu")) as k:
                t = time.perf_counter()
                runner.greedy_batch(prompts, args.tokens)
                return time.perf_counter() - t, k
        torch.set_num_threads(n if setting == "all" else 1)
        try:
            t = time.perf_counter()
            runner.greedy_batch(prompts, args.tokens)
            return time.perf_counter() - t, torch.get_num_threads()
        finally:
            torch.set_num_threads(n)

    out: dict = {"threads": n, "cores": usable_cores(), "prompts": args.prompts, "tokens": args.tokens,
                 "busy_processes": busy, "machines": {}}
    machines = [("as it is", 0)] + ([(f"beside {busy} busy processes", busy)] if busy else [])
    for machine, procs in machines:
        ctx = mp.get_context("spawn")  # a fork of a process whose OpenMP pool is running is not safe
        stop = ctx.Event()
        cores = sorted(os.sched_getaffinity(0))
        spinners = [ctx.Process(target=spin, args=(stop, cores[i % len(cores)]), daemon=True) for i in range(procs)]
        for p in spinners:
            p.start()
        try:
            time.sleep(5.0 if procs else 0.0)  # the spawned competitors import torch first
            rows: dict[str, list[float]] = {"all": [], "one": [], "pick": []}
            picked = []
            for r in range(args.rounds):
                for setting in (("all", "one", "pick") if r % 2 == 0 else ("pick", "one", "all")):
                    s, k = timed(setting)
                    rows[setting].append(s)
                    if setting == "pick":
                        picked.append(k)
        finally:
            stop.set()
            for p in spinners:
                p.join()
        med = {k: statistics.median(v) for k, v in rows.items()}
        out["machines"][machine] = {"seconds": rows, "median": med, "pick_threads": picked,
                                    "one_over_all": med["all"] / med["one"], "pick_over_all": med["all"] / med["pick"]}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.prompts} prompts x {args.tokens} tokens, greedy, {args.target}; torch threads {n}, cores {out['cores']}")
    for machine, m in out["machines"].items():
        print(f"{machine}:")
        for k, label in (("all", f"all {n} threads"), ("one", "one thread"), ("pick", "decode_threads' pick")):
            extra = f" (picked {m['pick_threads']})" if k == "pick" else ""
            print(f"  {label:22s} median {m['median'][k]:7.2f} s  rounds {[round(x, 2) for x in m['seconds'][k]]}{extra}")
        print(f"  speed-up over all threads: one thread {m['one_over_all']:.2f}x, the pick {m['pick_over_all']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
