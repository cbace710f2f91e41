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
from dataclasses import dataclass, field

from evaluation.bench import RequestResult, Slot
from evaluation.result import Arm, ArmFigures, BenchResult, Comparison
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC, Cluster, ClusterSums, Interval
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


def heavy() -> Noise:
    """A busy machine whose load comes in short bursts: a burst often slows a single arm's turn.

    Student-t(3) turn and request noise, AR(1) load, bursts of one turn most often (a mean of
    1.6), a few latency spikes. Calibrated so that the bench before new prompt groups per
    attempt had about the power an independent audit measured on its own generator (15-20%
    for a head 10% faster and +0.1 in acceptance at the default size).
    """
    return Noise(turn_sd=0.12, load_sd=0.10, burst_rate=0.08, burst_turns=1.0, burst_slow=0.4, request_sd=0.06,
                 spike_rate=0.01)


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
        import numpy as np

        rng = np.random.default_rng(seed)
        return cls(tokens=rng.integers(24, 129, n).tolist(), speed=np.exp(rng.uniform(-0.7, 0.7, n)).tolist(),
                   acceptance=rng.normal(0, heads.prompt_acceptance, n).tolist(),
                   cand_speed=rng.normal(0, heads.speed_by_prompt, n).tolist(),
                   cand_acceptance=rng.normal(0, heads.acceptance_by_prompt, n).tolist())

    def arrays(self) -> dict[str, "np.ndarray"]:
        import numpy as np

        return {k: np.asarray(getattr(self, k), dtype=float)
                for k in ("tokens", "speed", "acceptance", "cand_speed", "cand_acceptance")}


def _t(rng, df: float, size) -> "np.ndarray":
    """Student-t draws scaled to unit variance (df > 2); df = inf: Gaussian."""
    if math.isinf(df):
        return rng.standard_normal(size)
    return rng.standard_t(df, size) / math.sqrt(df / (df - 2))


@dataclass
class Draws:
    """One bench run of a plan, request by request (flat arrays in time order)."""

    slots: list[Slot]
    turn: "np.ndarray"  # each request's arm turn (block) index
    slot: "np.ndarray"
    arm: "np.ndarray"  # index into ``roles``
    prompt: "np.ndarray"
    concurrency: "np.ndarray"
    tokens: "np.ndarray"
    latency: "np.ndarray"
    drafts: "np.ndarray"  # NaN where not read per request (concurrency > 1, no speculation)
    accepted: "np.ndarray"
    acceptance: "np.ndarray"  # the request's mean acceptance length (1 without speculation)
    roles: list[str]
    turn_role: list[str]


def draw(slots: list[Slot], heads: Heads, noise: Noise, world: World, noise_seed: int = 0,
         tok_per_s: float = 30.0, arrays: dict | None = None) -> Draws:
    """Every request of one bench run of ``slots``: the machine noise drawn at once with numpy."""
    import numpy as np

    rng = np.random.default_rng(noise_seed)
    w = arrays if arrays is not None else world.arrays()
    roles = sorted({r for s in slots for r in s.order}, key=[CANDIDATE, LIVE, CONTROL, NOSPEC].index)
    turn_role = [r for s in slots for r in s.order]
    n_turns = len(turn_role)
    # The machine, turn by turn: AR(1) load, bursts, heavy-tailed turn noise, drift.
    shocks = rng.standard_normal(n_turns) * (math.sqrt(1 - noise.load_ar ** 2) * noise.load_sd)
    starts = rng.random(n_turns) < noise.burst_rate
    lengths = 1 + np.floor(rng.exponential(noise.burst_turns, n_turns)).astype(int)
    load = np.empty(n_turns)
    slow = np.zeros(n_turns, dtype=bool)
    level, left = 0.0, 0
    for k in range(n_turns):
        level = noise.load_ar * level + shocks[k]
        load[k] = level
        if left == 0 and starts[k]:
            left = lengths[k]
        if left:
            slow[k] = True
            left -= 1
    machine = np.exp(load + noise.turn_sd * _t(rng, noise.tail_df, n_turns)) * (
        1 - noise.drift * np.arange(n_turns))
    machine = np.where(slow, machine * (1 - noise.burst_slow), machine)
    # The requests.
    per_turn = [(i, s, r) for i, s in enumerate(slots) for r in s.order]
    turn = np.repeat(np.arange(n_turns), [len(s.prompts) for _, s, _ in per_turn])
    slot = np.repeat([i for i, _, _ in per_turn], [len(s.prompts) for _, s, _ in per_turn])
    prompt = np.fromiter((p for _, s, _ in per_turn for p in s.prompts), dtype=int)
    conc = np.repeat([s.concurrency for _, s, _ in per_turn], [len(s.prompts) for _, s, _ in per_turn])
    arm = np.repeat([roles.index(r) for _, _, r in per_turn], [len(s.prompts) for _, s, _ in per_turn])
    is_cand = arm == roles.index(CANDIDATE) if CANDIDATE in roles else np.zeros(len(arm), dtype=bool)
    speed = np.asarray([heads.speed[r] for r in roles])[arm] * np.where(is_cand, 1 + w["cand_speed"][prompt], 1.0)
    if heads.speed_at:
        at = np.asarray([heads.speed_at.get(int(c), 1.0) for c in conc])
        speed = np.where(is_cand, speed * at, speed)
    n = len(arm)
    per_request = tok_per_s * conc.astype(float) ** -0.3  # more requests in flight: each slower, the sum faster
    rate = per_request * speed * w["speed"][prompt] * machine[turn] * np.exp(
        noise.request_sd * _t(rng, noise.tail_df, n))
    tokens = w["tokens"][prompt]
    lat = tokens / np.maximum(rate, 1e-6)
    spikes = rng.random(n) < noise.spike_rate
    lat = np.where(spikes, lat * rng.uniform(2, 5, n), lat)
    spec_arm = np.asarray([r != NOSPEC for r in roles])[arm]
    al = np.asarray([heads.acceptance.get(r, 1.0) for r in roles])[arm] + w["acceptance"][prompt] + np.where(
        is_cand, w["cand_acceptance"][prompt], 0.0)
    al = np.maximum(1.0, al)
    per_req = spec_arm & (conc == 1)  # per-request counters are read at concurrency 1 only
    drafts = np.where(per_req, tokens / al, np.nan)
    accepted = np.where(per_req, tokens / al * (al - 1), np.nan)
    al = np.where(spec_arm, al, 1.0)
    return Draws(slots, turn, slot, arm, prompt, conc, tokens, lat, drafts, accepted, al, roles, turn_role)


def blocks_of(d: Draws) -> list[dict]:
    """The draws as :func:`evaluation.bench.run_bench` measures them: what :func:`evaluation.result.analyze` takes."""
    blocks = []
    for k, role in enumerate(d.turn_role):
        idx = (d.turn == k).nonzero()[0]
        slot = d.slots[int(d.slot[idx[0]])]
        results = []
        for j in idx:
            n_tok, lat = int(d.tokens[j]), float(d.latency[j])
            r = RequestResult(ok=True, output_tokens=n_tok, ttft=0.05 * lat / n_tok * 4, latency=lat)
            if not math.isnan(d.drafts[j]):
                r.drafts, r.accepted = float(d.drafts[j]), float(d.accepted[j])
            results.append(r)
        spec = None
        if role != NOSPEC:
            # the replica's counters over the block, at any concurrency
            drafted = float(sum(d.tokens[idx] / d.acceptance[idx]))
            accepted = float(sum(d.tokens[idx] / d.acceptance[idx] * (d.acceptance[idx] - 1)))
            spec = SpecDelta(seconds=1.0, drafts=drafted, draft_tokens=3 * drafted, accepted=accepted,
                             per_pos=[accepted * 0.5, accepted * 0.3, accepted * 0.2])
        blocks.append({"role": role, "round": slot.round, "concurrency": slot.concurrency,
                       "slot": int(d.slot[idx[0]]), "prompts": slot.prompts, "results": results,
                       "wall": sum(r.latency for r in results) / slot.concurrency, "spec": spec})
    return blocks


def simulate(slots: list[Slot], heads: Heads, noise: Noise, world: World, noise_seed: int = 0,
             tok_per_s: float = 30.0) -> list[dict]:
    """The blocks of one bench run of ``slots``: what :func:`evaluation.result.analyze` takes."""
    return blocks_of(draw(slots, heads, noise, world, noise_seed, tok_per_s))


def clusters_of(d: Draws) -> list[Cluster]:
    """The prompt-group clusters of a run straight from its draws, summed with numpy.

    The same sums :func:`evaluation.stats.clusters_from_blocks` takes from :func:`blocks_of`
    (every request succeeds here), without building a block per turn: what lets the gate's
    simulation run thousands of cycles on two cores.
    """
    import numpy as np

    keys = {(s.concurrency, tuple(s.prompts)): None for s in d.slots}
    order = sorted(keys)
    cid = {k: i for i, k in enumerate(order)}
    slot_cluster = np.asarray([cid[(s.concurrency, tuple(s.prompts))] for s in d.slots])
    na = len(d.roles)
    cell = slot_cluster[d.slot] * na + d.arm
    size = len(order) * na

    def total(x) -> "np.ndarray":
        return np.bincount(cell, weights=x, minlength=size).reshape(len(order), na)

    reqs = np.bincount(cell, minlength=size).reshape(len(order), na)
    toks, lat = total(d.tokens), total(d.latency)
    ttft = total(0.05 * d.latency / d.tokens * 4)
    tpot_ok = d.tokens > 1
    tpot = total(np.where(tpot_ok, (d.latency - 0.05 * d.latency / d.tokens * 4) / np.maximum(d.tokens - 1, 1), 0.0))
    tpot_n = total(tpot_ok.astype(float))
    has = ~np.isnan(d.drafts)
    drafts, acc = total(np.where(has, d.drafts, 0.0)), total(np.where(has, d.accepted, 0.0))
    rounds = np.bincount(slot_cluster, minlength=len(order))  # a group's slots: one per round
    out = []
    for i, (c, prompts) in enumerate(order):
        arms = {r: ClusterSums(int(reqs[i, a]), float(toks[i, a]), float(lat[i, a]), float(ttft[i, a]),
                               int(reqs[i, a]), float(tpot[i, a]), int(tpot_n[i, a]), 0.0, 0, float(drafts[i, a]),
                               float(acc[i, a]))
                for a, r in enumerate(d.roles)}
        out.append(Cluster(c, list(prompts), int(rounds[i]), arms))
    return out


def bench_result(slots: list[Slot], heads: Heads, noise: Noise, world: World, noise_seed: int,
                 concurrencies: list[int], confidence: float, arrays: dict | None = None) -> BenchResult:
    """A bench result holding what the gate reads (the clusters, the arms, the concurrencies), fast."""
    d = draw(slots, heads, noise, world, noise_seed, arrays=arrays)
    return BenchResult(arms={r: Arm(None, {c: ArmFigures() for c in concurrencies}) for r in d.roles},
                       clusters=clusters_of(d), differences=Comparison(Interval.empty(confidence), {}),
                       aa_control=None, speedup_vs_nospec={}, concurrencies=list(concurrencies),
                       rounds=len({s.round for s in slots}), confidence=confidence)
