"""Simple simulated replay-bench measurements for the statistics and cycle tests (no services).

The blocks follow a bench plan (``evaluation.bench.plan``): per slot, each arm replays
the slot's prompts. A request's speed is the head's speed times the prompt's own
factor (lengths and difficulty differ a lot between prompts) times the machine at
that moment: a drift over the run, a load level per slot (shared by the arms of
the slot) and a jitter per block. Each effect can be switched on alone, which the
tests of single mechanisms need; the simulator that tries to fool the gate (heavy
tails, autocorrelated load with bursts, head-by-prompt effects) is ``evaluation.simulate``.
"""

from __future__ import annotations

import random
from pathlib import Path

from evaluation.bench import CANDIDATE, CONTROL, LIVE, NOSPEC, RequestResult, Slot, plan
from evaluation.result import HeadRef, analyze
from serving.metrics import SpecDelta

N = 24
CONCS = [1, 4]
ARMS = [CANDIDATE, LIVE, CONTROL]


def slots_for(arms=ARMS, seed=0, rounds=2, group_size=4) -> list[Slot]:
    return plan(arms, N, CONCS, rounds, group_size, seed)


def simulate(slots, speed, *, drift=0.0, load=0.0, jitter=0.0, seed=0, al=None):
    rng = random.Random(seed)
    prompt = [0.5 + 1.5 * random.Random(i).random() for i in range(N)]  # up to 4x apart
    al = al or {CANDIDATE: 1.8, LIVE: 1.5, CONTROL: 1.5}
    blocks, t = [], 0
    for i, slot in enumerate(slots):
        level = 1.0 + rng.uniform(-load, load)
        for role in slot.order:
            machine = (1.0 - drift * t) * level * (1.0 + rng.uniform(-jitter, jitter))
            t += 1
            results = []
            for p in slot.prompts:
                tokens = 40 + 3 * p
                lat = tokens / (speed[role] * machine * prompt[p] * (1 + rng.uniform(-0.02, 0.02)))
                r = RequestResult(ok=True, output_tokens=tokens, ttft=0.05, latency=lat,
                                  itls=[lat / tokens] * (tokens - 1))
                if role != NOSPEC and slot.concurrency == 1:
                    r.drafts = tokens / al[role]
                    r.accepted = r.drafts * (al[role] - 1)
                results.append(r)
            spec = None
            if role != NOSPEC:
                d = sum(r.output_tokens for r in results) / al[role]
                spec = SpecDelta(seconds=1.0, drafts=d, draft_tokens=3 * d, accepted=d * (al[role] - 1),
                                 per_pos=[d * 0.4, d * 0.2, d * 0.1])
            blocks.append({"role": role, "round": slot.round, "concurrency": slot.concurrency, "slot": i,
                           "prompts": slot.prompts, "results": results,
                           "wall": sum(r.latency for r in results) / slot.concurrency, "spec": spec})
    return blocks


def simulated_bench(runs, calls: list):
    """A stand-in for ``evaluation.bench.bench_heads``: each call analyzes the next simulated run for real.

    ``runs``: (load, candidate speed) per call; the candidate drafts 1.8 against the live head's 1.5;
    with no speculation measured (``bp.nospec``, or ``[bench] nospec_reference`` where that is None, as the
    real bench reads it) a no-speculation arm runs at 0.8 of the live head's speed.
    """
    runs = iter(runs)

    def fake_bench(cfg, bp, progress=None):
        load, speed = next(runs)
        calls.append(bp.seed)
        nospec = cfg.bench.nospec_reference if bp.nospec is None else bp.nospec
        arms = ARMS + ([NOSPEC] if nospec else [])
        blocks = simulate(slots_for(arms, seed=bp.seed), {CANDIDATE: speed, LIVE: 1.0, CONTROL: 1.0, NOSPEC: 0.8},
                          load=load, jitter=load / 4, seed=bp.seed + 1, al={CANDIDATE: 1.8, LIVE: 1.5, CONTROL: 1.5})
        res = analyze(blocks, arms, CONCS, cfg.gate.confidence)
        res.heads = {"candidate": HeadRef("cand", "c" * 64), "live": HeadRef("live", "l" * 64)}
        res.requests, res.seed = N, bp.seed
        Path(bp.out).mkdir(parents=True)
        res.write(Path(bp.out) / "bench.json")
        return res

    return fake_bench
