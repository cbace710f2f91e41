"""The replay bench's plan and statistics on simulated measurements (no services).

What the gate must never do is promote a head that is not better, whatever the
machine did during the run: drift, load that comes and goes, jitter.
"""

from __future__ import annotations

from collections import Counter

import pytest

import evaluation.bench as bench_mod
from evaluation.bench import (CANDIDATE, CONTROL, LIVE, NOSPEC, RequestResult, Slot, analyze, arm_orders,
                              cycle_seed, mirrored_pairs, plan, prompt_groups)
from evaluation.result import BenchResult
from loop.gate import PASSED, REJECTED, decide
from settings.config import GateConfig
from tests.bench_sim import ARMS, CONCS, N, simulate, slots_for

SAME = {CANDIDATE: 1.0, LIVE: 1.0, CONTROL: 1.0}
SAME_AL = {CANDIDATE: 1.5, LIVE: 1.5, CONTROL: 1.5}


def run(slots, speed, seed=0, **kw):
    arms = [a for a in (CANDIDATE, LIVE, CONTROL, NOSPEC) if any(a in s.order for s in slots)]
    return analyze(simulate(slots, speed, seed=seed, **kw), arms, CONCS, confidence=0.9)


@pytest.mark.parametrize("arms", [[CANDIDATE, LIVE, CONTROL], [CANDIDATE, LIVE, CONTROL, NOSPEC]])
def test_orders_are_seeded_and_counterbalanced(arms):
    o = arm_orders(arms, seed=3)
    assert o == arm_orders(arms, seed=3) and o != arm_orders(arms, seed=5)
    positions = Counter((a, r.index(a)) for r in o for a in arms)
    assert len(set(positions.values())) == 1 and len(positions) == len(arms) ** 2  # every arm, every position
    follows = Counter((r[i], r[i + 1]) for r in o for i in range(len(arms) - 1))
    assert len(set(follows.values())) == 1 and len(follows) == len(arms) * (len(arms) - 1)  # every predecessor
    pairs = mirrored_pairs(arms, seed=3)
    assert sorted(map(tuple, (r for p in pairs for r in p))) == sorted(map(tuple, o))  # the whole cycle, in pairs
    assert all(b == list(reversed(a)) for a, b in pairs)


@pytest.mark.parametrize("arms,n,concs,rounds", [
    ([CANDIDATE, LIVE, CONTROL], 32, [1, 4], 2), ([CANDIDATE, LIVE, CONTROL, NOSPEC], 32, [1, 4], 2),
    ([CANDIDATE, LIVE, CONTROL], 12, [1, 2], 2), ([CANDIDATE, LIVE, CONTROL], 6, [1], 4),
    ([CANDIDATE, LIVE, CONTROL], 24, [1, 4], 4), ([CANDIDATE, LIVE, CONTROL, NOSPEC], 24, [1, 4], 4)])
def test_every_group_is_balanced_and_every_concurrency_runs_whole_williams_cycles(arms, n, concs, rounds):
    """At every concurrency: each prompt group's rounds put every arm at the same mean position (a load
    trend across a slot cancels inside the group), and the speculative arms' orders form whole Williams
    cycles (the groups are cut for them, with or without the no-speculation arm)."""
    slots = plan(arms, n, concs, rounds, group_size=4, seed=1)
    cycle = Counter(map(tuple, arm_orders(arms, seed=1)))
    for c in concs:
        mine = [s for s in slots if s.concurrency == c]
        for g in {s.group for s in mine}:
            rows = [s.order for s in mine if s.group == g]
            assert len(rows) == rounds
            mean_pos = {a: sum(r.index(a) for r in rows) / rounds for a in arms}
            assert len(set(mean_pos.values())) == 1, (c, g, mean_pos)
        if NOSPEC not in arms:
            used = Counter(tuple(s.order) for s in mine)
            k = used[next(iter(cycle))]
            assert used == Counter({row: k for row in cycle}), (c, used)  # k whole cycles, nothing left over


def test_the_prompt_groups_do_not_depend_on_which_arms_run():
    """An attempt with the no-speculation arm and one without it cut the same groups, so they pool as the
    same clusters (four arms once cut 2 mirrored pairs' worth of groups, three cut 3)."""
    for n in range(6, 129):
        for concs in ([1], [1, 4]):
            three = plan([CANDIDATE, LIVE, CONTROL], n, concs, 2, 4, seed=0)
            four = plan([CANDIDATE, LIVE, CONTROL, NOSPEC], n, concs, 2, 4, seed=0)
            assert {(s.concurrency, tuple(s.prompts)) for s in three} == \
                {(s.concurrency, tuple(s.prompts)) for s in four}, n


@pytest.mark.parametrize("arms", [[CANDIDATE, LIVE, CONTROL], [CANDIDATE, LIVE, CONTROL, NOSPEC]])
def test_no_slot_starts_with_the_arm_that_just_ran(arms):
    """A load episode across a slot boundary never slows one arm at the end of one group and at the start of
    the next (in odd rounds the mirrors once put the same arm on both sides), across concurrency switches
    and rounds too; and the arm that runs first after a concurrency switch changes from switch to switch."""
    for n in (12, 24, 32, 64, 100):
        for rounds in (1, 2, 4):
            for seed in range(4):
                slots = plan(arms, n, [1, 4], rounds, 4, seed)
                assert all(a.order[-1] != b.order[0] for a, b in zip(slots, slots[1:])), (n, rounds, seed)
                firsts = [b.order[0] for a, b in zip([None] + slots, slots)
                          if a is None or (a.round, a.concurrency) != (b.round, b.concurrency)]
                if rounds >= 2:
                    assert len(set(firsts)) >= 2, firsts


def test_the_orders_change_from_cycle_to_cycle():
    """Seeded from the cycle's id: the same cycle replays the same orders, another cycle other ones (no arm
    is the first after the replica's start in every cycle)."""
    assert cycle_seed("c20261127T120000Z") == cycle_seed("c20261127T120000Z")
    seeds = {cycle_seed(f"c{i}") for i in range(40)}
    assert len(seeds) == 40 and cycle_seed("c1", 0) != cycle_seed("c1", 1)
    firsts = Counter(plan(ARMS, 32, [1, 4], 2, 4, s)[0].order[0] for s in seeds)
    assert set(firsts) == set(ARMS)


def test_later_attempts_replay_new_prompt_batches_while_the_held_out_set_has_them():
    reqs = [bench_mod.BenchRequest("/v1/completions", {"prompt": str(i)}) for i in range(100)]
    assert bench_mod.heldout_batch(reqs, 32, 0) == (reqs[:32], 0)
    assert bench_mod.heldout_batch(reqs, 32, 1) == (reqs[32:64], 32)
    assert bench_mod.heldout_batch(reqs, 32, 3) == (reqs[:32], 0)  # 3 full batches: the fourth wraps around
    assert bench_mod.heldout_batch(reqs[:40], 32, 1) == (reqs[:32], 0)  # one batch: every attempt replays it
    assert bench_mod.heldout_batch(reqs[:20], 32, 1) == (reqs[:20], 0)
    slots = plan(ARMS, 32, [1, 4], 2, 4, 0, first_prompt=32)
    assert sorted({p for s in slots for p in s.prompts}) == list(range(32, 64))


def test_plan_covers_every_prompt_with_every_arm_in_groups_of_at_least_one_wave():
    slots = plan(ARMS, 32, [1, 4], rounds=2, group_size=4, seed=0)
    for r in (0, 1):
        for c in (1, 4):
            mine = [s for s in slots if s.round == r and s.concurrency == c]
            assert sorted(p for s in mine for p in s.prompts) == list(range(32))
            assert all(len(s.prompts) >= c for s in mine) and len(mine) >= 6  # the gate's clusters
    assert all(sorted(s.order) == sorted(ARMS) for s in slots)
    # the same groups in every round (the statistics' clusters)
    assert {tuple(s.prompts) for s in slots if s.round == 0} == {tuple(s.prompts) for s in slots if s.round == 1}


def test_a_concurrency_can_replay_fewer_of_the_prompts_in_groups_of_its_own():
    """``prompts_at``: the first n prompts at that concurrency (still a whole plan: every arm in every slot),
    all of them where it names none or more than there are."""
    slots = plan(ARMS, 144, [1, 4], 1, 2, 0, first_prompt=144, prompts_at={1: 112, 4: 200})
    at = {c: sorted(p for s in slots if s.concurrency == c for p in s.prompts) for c in (1, 4)}
    assert at == {1: list(range(144, 256)), 4: list(range(144, 288))}
    groups = bench_mod.prompt_groups(112, 1, 2, bench_mod.GROUP_CYCLE, 6, 144)
    assert [s.prompts for s in slots if s.concurrency == 1] == groups and len(groups) > 50
    assert all(sorted(s.order) == sorted(ARMS) for s in slots)
    even = plan(ARMS, 32, [1, 4], 2, 4, 0)
    assert plan(ARMS, 32, [1, 4], 2, 4, 0, prompts_at={}) == even == plan(ARMS, 32, [1, 4], 2, 4, 0, prompts_at={4: 32})


def test_prompt_groups_take_min_groups_when_the_prompts_allow():
    assert [len(g) for g in prompt_groups(6, 1, 4, 3, 6)] == [1] * 6  # 6 prompts: 6 groups of one
    assert len(prompt_groups(6, 4, 4, 3, 6)) == 1  # c=4 with 6 prompts: one wave is all there is
    assert len(prompt_groups(32, 4, 4, 3, 6)) == 6 and len(prompt_groups(32, 1, 4, 3, 6)) == 9
    assert len(prompt_groups(200, 1, 4, 3, 6)) == 51  # plenty of prompts: about group_size each


def test_pairing_resolves_a_real_gain_that_prompt_variety_would_hide():
    res = run(slots_for(), {CANDIDATE: 1.10, LIVE: 1.0, CONTROL: 1.0})
    d = res.differences.tok_per_s(1)
    assert d.pairs == 2 * N and d.clusters == 6 and d.lo > 0  # +10%, prompts 4x apart: pairs share the prompt
    assert res.differences.mean_acceptance_length.estimate == pytest.approx(0.3)
    assert res.rounds == 2


def test_a_fixed_order_on_a_slowing_machine_fakes_a_gain_the_counterbalanced_plan_does_not():
    # Candidate always first, live second (the old bench's order): the machine slows as it goes.
    fixed = [Slot(s.round, s.concurrency, s.prompts, [CANDIDATE, LIVE], s.group) for s in slots_for()]
    res = run(fixed, {CANDIDATE: 1.0, LIVE: 1.0}, drift=0.005, al=SAME_AL)
    assert res.differences.tok_per_s(1).lo > 0  # a confident "gain" for identical heads
    balanced = run(slots_for(seed=1), SAME, drift=0.005, al=SAME_AL)
    d = balanced.differences.tok_per_s(1)
    assert d.lo < 0 < d.hi
    assert decide(balanced, GateConfig(min_acceptance_gain=0.0)).status != PASSED


def test_the_pooled_reference_sits_where_the_candidate_does():
    """Live and control around the candidate (control, candidate, live) on a slowing machine: the pooled
    reference has the candidate's mean position, so the trend cancels, while the A/A control shows it."""
    fixed = [Slot(s.round, s.concurrency, s.prompts, [CONTROL, CANDIDATE, LIVE], s.group) for s in slots_for()]
    res = run(fixed, SAME, drift=0.01, al=SAME_AL)
    d, aa = res.differences.tok_per_s(1), res.aa_control.tok_per_s(1)
    assert d.lo < 0 < d.hi and abs(d.estimate) < 0.25 * abs(aa.estimate) and aa.lo > 0


def test_the_aa_control_voids_a_run_whose_order_favours_the_first_arm():
    """Always candidate, control, live on a slowing machine: the candidate looks faster, and so does the
    control than the live head (the same head): the A/A interval leaves out 0 and voids the run."""
    fixed = [Slot(s.round, s.concurrency, s.prompts, [CANDIDATE, CONTROL, LIVE], s.group) for s in slots_for()]
    res = run(fixed, SAME, drift=0.01, al={CANDIDATE: 1.6, LIVE: 1.5, CONTROL: 1.5})
    assert res.differences.tok_per_s(1).lo > 0  # biased by the order...
    v = decide(res, GateConfig(min_acceptance_gain=0.0))
    assert v.status != PASSED and v.voided == [1] and "load changed under the bench" in v.reason  # ...the A/A says so


def test_load_that_comes_and_goes_widens_intervals_instead_of_faking_differences():
    """±40% load from slot to slot, ±10% jitter: identical speeds never pass; a really faster head passes
    most runs."""
    gate = GateConfig(min_acceptance_gain=0.0)
    same, better = [], []
    for seed in range(20):
        same.append(decide(run(slots_for(seed=seed), SAME, seed=seed, load=0.4, jitter=0.1,
                               al={CANDIDATE: 1.6, LIVE: 1.5, CONTROL: 1.5}), gate).status)
        better.append(decide(run(slots_for(seed=seed), {CANDIDATE: 1.4, LIVE: 1.0, CONTROL: 1.0}, seed=seed,
                                 load=0.4, jitter=0.1, al={CANDIDATE: 1.9, LIVE: 1.5, CONTROL: 1.5}), gate).status)
    assert PASSED not in same, same
    assert better.count(PASSED) >= 16 and REJECTED not in better, better


def test_identical_heads_are_not_better_whatever_the_load():
    for seed, load in ((0, 0.0), (1, 0.4)):
        v = decide(run(slots_for(seed=seed), SAME, seed=seed, load=load, al=SAME_AL),
                   GateConfig(min_acceptance_gain=0.0))
        assert v.status == REJECTED and "mean_acceptance_length: not better" in v.reason


def test_speedup_over_no_speculation_is_a_cluster_ratio():
    slots = slots_for(arms=[CANDIDATE, LIVE, CONTROL, NOSPEC])
    res = run(slots, {CANDIDATE: 1.3, LIVE: 0.9, CONTROL: 0.9, NOSPEC: 1.0}, load=0.2)
    sp = res.speedup_vs_nospec
    assert sp[1]["candidate"].estimate == pytest.approx(1.3, rel=0.03)
    assert sp[4]["live"].estimate == pytest.approx(0.9, rel=0.03)
    assert sp[4]["live"].lo < 0.9 < sp[4]["live"].hi < 1.0  # slower than no speculation, and the interval says so
    assert res.arms[NOSPEC].spec is None and res.speedup() == {1: pytest.approx(1.3, rel=0.03),
                                                                4: pytest.approx(1.3, rel=0.03)}


def test_failed_requests_are_left_out_of_the_pairs():
    blocks = simulate(slots_for(), SAME)
    for b in blocks:
        if b["role"] == CANDIDATE and b["concurrency"] == 1 and 0 in b["prompts"]:
            b["results"][b["prompts"].index(0)] = RequestResult(ok=False, error="HTTP 500")
    res = analyze(blocks, ARMS, CONCS, 0.9)
    assert res.differences.tok_per_s(1).pairs == 2 * N - 2
    assert res.differences.tok_per_s(4).pairs == 2 * N
    assert res.arms[CANDIDATE].by_concurrency[1].failed == 2
    assert decide(res, GateConfig()).status == REJECTED


def test_figures_carry_the_percentiles_and_names_of_vllm_bench_serve():
    blocks = simulate(slots_for(), SAME, load=0.2, jitter=0.1)
    res = analyze(blocks, ARMS, CONCS, 0.9)
    f = res.arms[CANDIDATE].by_concurrency[1].figures()
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert f[f"p50_{name}_ms"] == pytest.approx(f[f"median_{name}_ms"])
        assert f[f"p50_{name}_ms"] <= f[f"p90_{name}_ms"] <= f[f"p99_{name}_ms"] and f[f"std_{name}_ms"] >= 0
    assert f["requests"] == 2 * N
    records = res.request_records
    assert len(records) == len(ARMS) * len(CONCS) * 2 * N
    r = next(x for x in records if x.arm == CANDIDATE and x.concurrency == 1)
    assert r.ok and r.output_tokens > 0 and r.drafts > 0 and r.itls_ms


def test_every_arm_goes_through_the_same_load_path(monkeypatch):
    """Heads of other shapes: every spec arm's turn restarts the replica (the live head's and the A/A
    control's too), found once by a probe; with shapes that match, every turn swaps in place. Every arm's
    turn has a warm-up wave at its slot's concurrency before its block (the batch shapes it will run)."""
    import asyncio

    import evaluation.bench as bench

    events: list[tuple] = []

    class Admin:
        served = {"sha256": "l" * 64, "path": "/h/live"}

        def __init__(self, url, token, local=False):
            assert local  # the bench replica runs on this host: heads by path through its agent

        async def head_info(self):
            return dict(Admin.served)

        async def load_head(self, path, version, sha):
            if Admin.shapes_differ and path != Admin.served["path"]:
                raise RuntimeError("drafter shapes differ: restart needed")
            Admin.served = {"sha256": sha, "path": path}
            events.append(("inplace", path))
            return dict(Admin.served)

    def restart(path):
        Admin.served = {"sha256": "c" * 64 if path.endswith("cand") else "l" * 64, "path": path}
        events.append(("restart", path))

    async def warm(client, url, req):
        events.append(("warm", url))
        return RequestResult(ok=True, output_tokens=1, latency=0.01, ttft=0.01)

    async def block(url, reqs, c):
        events.append(("block", url, c))
        return {"results": [RequestResult(ok=True, output_tokens=8, latency=0.1, ttft=0.01) for _ in reqs],
                "wall": 0.1 * len(reqs) / c, "spec": None}

    monkeypatch.setattr(bench, "AgentAdmin", Admin)
    monkeypatch.setattr(bench, "stream_one", warm)
    monkeypatch.setattr(bench, "run_block", block)
    heads = {"candidate": {"path": "/h/cand", "sha256": "c" * 64}, "live": {"path": "/h/live", "sha256": "l" * 64}}
    reqs = [bench.BenchRequest("/v1/completions", {"prompt": str(i)}) for i in range(6)]
    for differ, how in ((True, "restart"), (False, "inplace")):
        Admin.shapes_differ, Admin.served = differ, {"sha256": "l" * 64, "path": "/h/live"}
        events.clear()
        res = asyncio.run(bench.run_bench("http://spec", heads, reqs, concurrencies=[1, 2], rounds=2,
                                          restart=restart, nospec_url="http://nospec", min_groups=3))
        turns = [s for s in res.swaps if s["role"] != "probe"]
        assert {s["how"] for s in res.swaps} == {how} and len(turns) == 3 * res.slots  # every spec arm's turn
        assert sum(e[0] == how and e[1] == "/h/live" for e in events) >= 2 * res.slots  # live and control alike
        blocks = [i for i, e in enumerate(events) if e[0] == "block"]
        # no speculation runs in the first round only: its figure is a ratio shown beside the heads
        assert len(blocks) == 3 * res.slots + res.slots // 2
        assert {b["round"] for b in res.blocks if b["role"] == "nospec"} == {0}
        for i in blocks:
            c = events[i][2]
            assert [e[0] for e in events[i - c:i]] == ["warm"] * c and events[i - c - 1][0] != "warm", (i, c)
        assert {events[i][2] for i in blocks} == {1, 2}
    # A sizing that replays fewer prompts at c=1: its blocks hold the first ones only, the result says so.
    res = asyncio.run(bench.run_bench("http://spec", heads, reqs, concurrencies=[1, 2], rounds=2, restart=restart,
                                      min_groups=3, first_prompt=6, prompts_at={1: 4}))
    assert {p for b in res.blocks if b["concurrency"] == 1 for p in b["prompts"]} == {6, 7, 8, 9}
    assert {p for b in res.blocks if b["concurrency"] == 2 for p in b["prompts"]} == set(range(6, 12))
    assert res.prompts_at == {1: 4, 2: 6}


def test_a_bench_runs_no_more_rounds_once_told_they_cannot_change_the_verdict(monkeypatch):
    """``stop_after_round`` is asked after every round but the last, with the result so far."""
    import asyncio

    import evaluation.bench as bench

    class Admin:
        def __init__(self, url, token, local=False):
            pass

        async def head_info(self):
            return {}

        async def load_head(self, path, version, sha):
            return {"sha256": sha, "path": path}

    async def warm(client, url, req):
        return RequestResult(ok=True, output_tokens=1, latency=0.01, ttft=0.01)

    async def block(url, reqs, c):
        return {"results": [RequestResult(ok=True, output_tokens=8, latency=0.1, ttft=0.01, drafts=6.0, accepted=2.0)
                            for _ in reqs], "wall": 0.1 * len(reqs) / c, "spec": None}

    monkeypatch.setattr(bench, "AgentAdmin", Admin)
    monkeypatch.setattr(bench, "stream_one", warm)
    monkeypatch.setattr(bench, "run_block", block)
    heads = {"candidate": {"path": "/h/cand", "sha256": "c" * 64}, "live": {"path": "/h/live", "sha256": "l" * 64}}
    reqs = [bench.BenchRequest("/v1/completions", {"prompt": str(i)}) for i in range(6)]
    asked: list[tuple[int, int]] = []
    said: list[str] = []

    def run(stop_at: int | None):
        asked.clear()

        def stop(partial):
            asked.append((partial.rounds, len(partial.request_records)))
            return "cannot pass" if partial.rounds == stop_at else None

        return asyncio.run(bench.run_bench("http://spec", heads, reqs, concurrencies=[1], rounds=3, min_groups=3,
                                           nospec_url="http://nospec", stop_after_round=stop, progress=said.append))

    res = run(stop_at=1)
    assert asked == [(1, 4 * 6)] and res.rounds == 1 and res.stopped == "cannot pass"
    assert {b["round"] for b in res.blocks} == {0} and any("no more rounds after round 1" in m for m in said)
    res = run(stop_at=None)
    assert asked == [(1, 4 * 6), (2, 4 * 6 + 3 * 6)] and res.rounds == 3 and res.stopped is None
    assert BenchResult.from_json(res.to_json()).stopped is None
    res.stopped = "cannot pass"
    assert BenchResult.from_json(res.to_json()).stopped == "cannot pass"


def test_arms_of_the_first_round_only_leave_the_others_orders_as_they_were():
    full = plan(["candidate", "live", "control", "nospec"], 12, [1, 2], 2, 2, seed=5, min_groups=3)
    short = plan(["candidate", "live", "control", "nospec"], 12, [1, 2], 2, 2, seed=5, min_groups=3,
                 first_round_only=["nospec"])
    assert [s.order for s in short if s.round == 0] == [s.order for s in full if s.round == 0]
    later = [s for s in short if s.round > 0]
    assert later and all("nospec" not in s.order and len(s.order) == 3 for s in later)
    assert all(sorted(s.order) == ["candidate", "control", "live"] for s in later)
