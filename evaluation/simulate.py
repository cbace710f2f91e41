"""A simulated replay bench that tries to fool the gate: what a shared machine and real traffic do.

It produces the blocks :func:`evaluation.bench.run_bench` measures (per slot, per arm: the
requests' results and the spec-decode counters), following a real bench plan, from a
model with the noise the gate must survive:

* **prompts** differ a lot in length and speed (up to 4x), and in how well any head drafts
  them; the candidate's advantage itself varies from prompt to prompt (head-by-prompt
  interaction), so an equal-quality head is better on some prompts and worse on others;
  greedy acceptance repeats exactly in every round;
* **load** is autocorrelated from one arm's turn to the next (AR(1)), with bursts that
  slow the machine for several turns, a slow drift, heavy-tailed (Student-t) noise per
  turn and per request, and rare request latency spikes.

A *world* (the prompts, their difficulty, the heads' per-prompt effects) is fixed by
``world_seed``; every attempt of a cycle replays it under fresh machine noise
(``noise_seed``), as a cycle re-measures the same held-out prompts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from evaluation.bench import RequestResult, Slot
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC
from serving.metrics import SpecDelta


@dataclass
class Noise:
    """The machine: every figure is a fraction of the speed it would have when idle."""

    turn_sd: float = 0.02  # per arm's turn (a block), Student-t with `tail_df` degrees of freedom
    tail_df: float = 3.0  # heavy tails (inf: Gaussian)
    load_sd: float = 0.0  # stationary sd of the autocorrelated load level
    load_ar: float = 0.9  # AR(1) coefficient from one turn to the next
    burst_rate: float = 0.0  # chance per turn that a burst starts
    burst_turns: float = 4.0  # mean burst length, in turns
    burst_slow: float = 0.3  # a burst slows the machine by this fraction
    request_sd: float = 0.02  # per request, Student-t too
    spike_rate: float = 0.0  # chance a request's latency is multiplied by 2-5
    drift: float = 0.0  # slowdown per turn (linear)

    def scaled(self, k: float) -> "Noise":
        """The same shape of noise, ``k`` times as large."""
        return Noise(self.turn_sd * k, self.tail_df, self.load_sd * k, self.load_ar, self.burst_rate,
                     self.burst_turns, min(0.9, self.burst_slow * k), self.request_sd * k, self.spike_rate,
                     self.drift * k)


def quiet() -> Noise:
    """A quiet 2-core machine (calibrated to the demo's A/A spread of about ±0.5 tok/s of 30 at c=1)."""
    return Noise(turn_sd=0.024, load_sd=0.012, burst_rate=0.01, burst_slow=0.1, request_sd=0.024, spike_rate=0.002)


def loaded() -> Noise:
    """The same machine under other jobs' load (an A/A spread of about 20% of tok/s)."""
    return Noise(turn_sd=0.31, load_sd=0.26, burst_rate=0.06, burst_slow=0.5, request_sd=0.1, spike_rate=0.01,
                 drift=0.0002)


@dataclass
class Heads:
    """The truth the gate should find: each arm's speed and acceptance, and how they vary by prompt."""

    speed: dict[str, float] = field(default_factory=lambda: {CANDIDATE: 1.0, LIVE: 1.0, CONTROL: 1.0,
                                                              NOSPEC: 1.1})
    acceptance: dict[str, float] = field(default_factory=lambda: {CANDIDATE: 1.5, LIVE: 1.5, CONTROL: 1.5})
    speed_by_prompt: float = 0.04  # sd of the candidate's relative speed advantage from prompt to prompt
    acceptance_by_prompt: float = 0.08  # sd of its acceptance advantage from prompt to prompt
    prompt_acceptance: float = 0.15  # sd of how well any head drafts a prompt
    # The candidate's speed relative to its `speed` at some concurrencies (e.g. {4: 1.15}: faster only at
    # c=4), to make one check the only one at its null, the case that tests a gate's level hardest.
    speed_at: dict[int, float] = field(default_factory=dict)


@dataclass
class World:
    """The held-out prompts and the heads' per-prompt effects: the same in every attempt."""

    tokens: list[int]
    speed: list[float]  # the prompt's own speed factor (length, difficulty)
    acceptance: list[float]  # the prompt's own acceptance offset
    cand_speed: list[float]  # the candidate's extra relative speed on the prompt
    cand_acceptance: list[float]

    @classmethod
    def make(cls, n: int, heads: Heads, seed: int) -> "World":
        rng = random.Random(seed)
        return cls(tokens=[rng.randint(24, 128) for _ in range(n)],
                   speed=[math.exp(rng.uniform(-0.7, 0.7)) for _ in range(n)],
                   acceptance=[rng.gauss(0, heads.prompt_acceptance) for _ in range(n)],
                   cand_speed=[rng.gauss(0, heads.speed_by_prompt) for _ in range(n)],
                   cand_acceptance=[rng.gauss(0, heads.acceptance_by_prompt) for _ in range(n)])


def _t(rng: random.Random, df: float) -> float:
    """A Student-t draw scaled to unit variance (df > 2)."""
    if math.isinf(df):
        return rng.gauss(0, 1)
    z = rng.gauss(0, 1)
    chi = rng.gammavariate(df / 2, 2.0)
    return z / math.sqrt(chi / df) / math.sqrt(df / (df - 2))


def simulate(slots: list[Slot], heads: Heads, noise: Noise, world: World, noise_seed: int = 0,
             tok_per_s: float = 30.0) -> list[dict]:
    """The blocks of one bench run of ``slots``: what :func:`evaluation.result.analyze` takes."""
    rng = random.Random(noise_seed)
    load, burst, t = 0.0, 0, 0
    blocks = []
    for i, slot in enumerate(slots):
        c = slot.concurrency
        per_request = tok_per_s * c ** -0.3  # more requests in flight: each one slower, the sum faster
        for role in slot.order:
            load = noise.load_ar * load + math.sqrt(1 - noise.load_ar ** 2) * noise.load_sd * rng.gauss(0, 1)
            if burst == 0 and rng.random() < noise.burst_rate:
                burst = 1 + int(rng.expovariate(1 / noise.burst_turns))
            machine = math.exp(load + noise.turn_sd * _t(rng, noise.tail_df)) * (1 - noise.drift * t)
            if burst:
                machine *= 1 - noise.burst_slow
                burst -= 1
            t += 1
            results, drafted, accepted = [], 0.0, 0.0
            for p in slot.prompts:
                n_tok = world.tokens[p]
                speed = heads.speed[role] * (1 + (world.cand_speed[p] if role == CANDIDATE else 0.0))
                if role == CANDIDATE:
                    speed *= heads.speed_at.get(c, 1.0)
                rate = per_request * speed * world.speed[p] * machine * math.exp(noise.request_sd * _t(rng, noise.tail_df))
                lat = n_tok / max(rate, 1e-6)
                if rng.random() < noise.spike_rate:
                    lat *= rng.uniform(2, 5)
                r = RequestResult(ok=True, output_tokens=n_tok, ttft=0.05 * lat / n_tok * 4, latency=lat)
                if role != NOSPEC:
                    al = heads.acceptance[role] + world.acceptance[p] + (
                        world.cand_acceptance[p] if role == CANDIDATE else 0.0)
                    al = max(1.0, al)
                    drafts = n_tok / al
                    if c == 1:  # per-request counters are read at concurrency 1 only
                        r.drafts, r.accepted = drafts, drafts * (al - 1)
                    drafted, accepted = drafted + drafts, accepted + drafts * (al - 1)
                results.append(r)
            spec = None
            if role != NOSPEC:
                spec = SpecDelta(seconds=1.0, drafts=drafted, draft_tokens=3 * drafted, accepted=accepted,
                                 per_pos=[accepted * 0.5, accepted * 0.3, accepted * 0.2])
            blocks.append({"role": role, "round": slot.round, "concurrency": c, "slot": i, "prompts": slot.prompts,
                           "results": results, "wall": sum(r.latency for r in results) / c, "spec": spec})
    return blocks
