"""Promotion gate: a pre-registered decision over a cycle's replay benches and ``[gate]``.

The product promises a swap only when the candidate is better on both counts, so a
candidate is promoted only if, at once,

* its mean acceptance length beats the reference by more than ``min_acceptance_gain``
  tokens, and
* its output tok/s beats the reference's by more than ``min_throughput_gain`` (a
  fraction) at **every** benchmarked concurrency
  (``throughput_test = "non_inferiority"``, an option: is at most
  ``throughput_tolerance`` worse).

The reference is the live head and its A/A control pooled (the same head measured twice
in every slot). Each check is a one-sided test at level ``α = (1 − confidence) / 2``
(0.05 by default) on a cluster t-interval over prompt groups (``evaluation.stats``). A
candidate passes only when every check does, so whichever margin it truly misses, the
chance it is promoted is at most that one check's α: the intersection needs no
multiplicity correction, and ``α`` is the false-promotion rate of the whole gate.

* **passed**: the check's lower bound is above its margin;
* **rejected**: its upper bound is at or below the margin (confidently not better by it);
* **inconclusive**: neither, or fewer than ``min_clusters`` prompt groups.

The verdict is *rejected* if any check is (or if the candidate failed more requests than
the live head), *passed* if all are, else *inconclusive*.

**Re-measurement adds data.** A cycle benchmarks an inconclusive candidate again, up to
``max_attempts`` times; each attempt replays new held-out prompt groups where the held-out
set has them (else the same groups in another order) and is pooled with the earlier ones,
group by group. Each look is tested at ``α / max_attempts``
(``evaluation.stats.look_level``), so all the looks together keep the false-promotion
rate at or below ``α`` however the looks correlate. Rejection is non-binding (stopping
early for it never adds promotions), and so is stopping when no later look can pass:
when the held-out set has no new prompt groups for another attempt and acceptance, which
greedy replays repeat exactly, cannot tell yet, the same groups replayed again give the
same acceptance interval at every later look. Within an attempt, ``first_round_share`` of its
level may go to a look after its first round (:func:`attempt_levels`, :func:`round_look`): a
candidate clearly better there skips the rounds left. :func:`size_attempts` sizes a cycle's
attempts from the noise of the last cycles' benches, within twice the default bench budget.

**The A/A control is a diagnostic.** Control − live compares a head with itself: when its
own interval (at ``aa_confidence``) leaves out 0 for any figure, load changed under that
benchmark in a way the counterbalancing did not cancel, and the attempt is void: its data
joins no pool and the look is spent. Against the pooled reference, the A/A contrast is
orthogonal to the candidate's, so voiding on it does not bias the decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from evaluation.result import BenchResult
from evaluation.stats import (CANDIDATE, CONTROL, LIVE, Interval, clusters_needed, contrast, look_level,
                              pool_clusters, power, reference, t_interval)

PASSED = "passed"
REJECTED = "rejected"
INCONCLUSIVE = "inconclusive"


@dataclass
class Check:
    """One gated figure at one look: its interval, margin and status, with a sentence."""

    name: str
    status: str
    why: str
    estimate: float | None = None
    ci: list[float | None] = field(default_factory=lambda: [None, None])
    margin: float | None = None
    unit: str = ""
    level: float | None = None  # one-sided nominal level of each bound at this look
    clusters: int = 0
    aa_ci: list[float | None] | None = None  # the A/A control's interval of the same figure (latest attempt)

    @property
    def ok(self) -> bool:
        return self.status == PASSED

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "ok": self.ok, "why": self.why, "estimate": self.estimate,
                "ci": self.ci, "margin": self.margin, "unit": self.unit, "level": self.level,
                "clusters": self.clusters, "aa_ci": self.aa_ci}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Check":
        return cls(d["name"], d["status"], d.get("why", ""), d.get("estimate"), d.get("ci") or [None, None],
                   d.get("margin"), d.get("unit", ""), d.get("level"), int(d.get("clusters") or 0), d.get("aa_ci"))


@dataclass
class Verdict:
    status: str
    reason: str
    checks: list[Check] = field(default_factory=list)
    attempts: int = 0  # benchmarks this verdict looked at
    level: float | None = None  # the one-sided nominal level of this look
    voided: list[int] = field(default_factory=list)  # attempts (1-based) the A/A control voided
    final: bool = False  # no further attempt can change it (e.g. too few prompt groups: more rounds add none)

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def label(self) -> str:
        return self.status

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.status, "passed": self.passed, "reason": self.reason,
                "checks": [c.to_json() for c in self.checks], "attempts": self.attempts, "level": self.level,
                "voided": self.voided, "final": self.final}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Verdict":
        return cls(d["verdict"], d.get("reason", ""), [Check.from_json(c) for c in d.get("checks") or []],
                   int(d.get("attempts") or 0), d.get("level"), list(d.get("voided") or []), bool(d.get("final")))


def _span(iv: Interval, margin: float, unit: str, level: float) -> str:
    return (f"[{iv.lo:.4g}, {iv.hi:.4g}] (estimate {iv.estimate:.4g}, one-sided level {level:.3g} per bound, "
            f"{iv.clusters} prompt groups), margin {margin:.4g} {unit}")


def check(name: str, iv: Interval, margin: float, unit: str, level: float, min_clusters: int,
          aa: Interval | None = None) -> Check:
    """One gated figure: passed / rejected / inconclusive from its interval at ``level`` per bound."""
    base = dict(estimate=iv.estimate, ci=[iv.lo, iv.hi], margin=margin, unit=unit, level=level,
                clusters=iv.clusters, aa_ci=aa.ci if aa is not None else None)
    if iv.clusters == 0:
        return Check(name, INCONCLUSIVE, f"{name}: nothing measured that every arm answered (acceptance is read "
                                         "per request at concurrency 1 only)", **base)
    if iv.clusters < min_clusters:
        return Check(name, INCONCLUSIVE, f"{name}: {iv.clusters} prompt groups measured, the gate needs "
                                         f"{min_clusters} (more held-out prompts, or smaller groups)", **base)
    if iv.estimate is None or iv.lo is None or iv.hi is None:
        return Check(name, INCONCLUSIVE, f"{name}: no interval (too few successful paired requests)", **base)
    span = _span(iv, margin, unit, level)
    if iv.lo > margin:
        return Check(name, PASSED, f"{name}: better by more than the margin: {span}", **base)
    if iv.hi <= margin:
        return Check(name, REJECTED, f"{name}: not better by the margin: {span}", **base)
    return Check(name, INCONCLUSIVE, f"{name}: cannot tell yet: {span}", **base)


def _refs(clusters_arms: set[str]) -> list[str]:
    return [LIVE, CONTROL] if CONTROL in clusters_arms else [LIVE]


def aa_void(result: BenchResult, gate: Any) -> str | None:
    """Why the A/A control voids this benchmark (None: it does not).

    Control − live of every gated figure, on this benchmark alone, at ``aa_confidence``:
    an interval that leaves out 0 says two identical heads measured apart.
    """
    if CONTROL not in result.arms:
        return "no A/A control in this benchmark, so nothing shows the machine held still under it"
    c1 = min(result.concurrencies)
    figs = [("mean_acceptance_length", c1, "mean_acceptance_length")]
    figs += [(f"output_tok_per_s@c{c}", c, "output_tok_per_s") for c in result.concurrencies]
    for name, c, metric in figs:
        iv = contrast(result.clusters, metric, c, CONTROL, [LIVE], gate.aa_confidence)
        if iv.excludes(0.0):
            return (f"A/A control {name}: the live head measured against itself differs by {iv.estimate:.4g} "
                    f"[{iv.lo:.4g}, {iv.hi:.4g}] ({gate.aa_confidence:.0%}): load changed under the bench")
    return None


def acceptance_repeats(results: Sequence[BenchResult]) -> bool:
    """Whether every prompt replayed more than once by an arm drafted and accepted the same each time.

    Acceptance is read at the lowest concurrency, one request at a time, and greedy decoding
    repeats it exactly on a replay, so the per-group acceptance of prompts already measured
    is fixed: replaying them again cannot move its interval. Read from the requests' own
    records; False where none was replayed yet, or where the records are missing or differ
    (sampled traffic, or an engine whose batches change its numerics). The A/A control is the
    live head: its turn replays the live head's prompts, so one round already shows whether
    replays repeat.
    """
    seen: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in results:
        if not r.concurrencies:
            continue
        c1 = min(r.concurrencies)
        for rec in r.request_records:
            if rec.ok and rec.concurrency == c1 and rec.drafts is not None:
                head = LIVE if rec.arm == CONTROL else rec.arm
                seen.setdefault((head, rec.prompt), []).append((rec.drafts, rec.accepted or 0.0))
    return any(len(v) > 1 for v in seen.values()) and all(len(set(v)) == 1 for v in seen.values())


def acceptance_check(clusters: list, c1: int, refs: list[str], gate: Any, level: float, aa=None) -> Check:
    """The gate's acceptance check on pooled prompt-group ``clusters`` (read at concurrency ``c1``)."""
    iv = contrast(clusters, "mean_acceptance_length", c1, CANDIDATE, refs, 1.0 - 2.0 * level)
    return check("mean_acceptance_length", iv, max(gate.min_acceptance_gain, 0.0), "tokens", level,
                 gate.min_clusters, aa.mean_acceptance_length if aa else None)


def attempt_levels(gate: Any, looks: int, rounds: int) -> tuple[float, float]:
    """The one-sided levels of an attempt's two looks: after its first round, and after its last.

    Each of a cycle's ``looks`` attempts gets ``α / looks`` (:func:`evaluation.stats.look_level`);
    an attempt of two or more ``rounds`` gives ``[gate] first_round_share`` of it to a look after
    its first round and the rest to the look after its last, so all looks together stay at ``α``
    (Bonferroni, whatever their correlation). Without that share (or with one round) the first
    look is not taken (level 0).
    """
    a = look_level(gate.level, looks)
    share = gate.first_round_share if rounds > 1 else 0.0
    return a * share, a * (1.0 - share)


def acceptance_level(kept: Sequence[BenchResult], gate: Any, looks: int, level: float) -> float:
    """The level of the acceptance check at a look of ``level``: the whole attempt's where replays repeat.

    Greedy replays repeat acceptance exactly (:func:`acceptance_repeats`), so an attempt's looks
    after its first and its last round read the same acceptance interval: one test, not two, and
    it keeps the attempt's whole level (``α / looks``); only throughput, which a round does move,
    splits it between the looks. Where replays differ, acceptance takes the look's level too.
    """
    return look_level(gate.level, looks) if level < look_level(gate.level, looks) and acceptance_repeats(kept) \
        else level


def round_look(results: Sequence[BenchResult], gate: Any) -> str | None:
    """Why the newest attempt runs no more rounds after the one just measured (None: it goes on).

    After its first round, with ``[gate] first_round_share``, the candidate is promoted when every
    check passes at that look's level (:func:`decide` reads the same result at the same level);
    after any round, the rounds left are skipped when acceptance cannot pass (:func:`round_futility`).
    """
    results = list(results)
    first = attempt_levels(gate, max(gate.max_attempts, len(results)), results[-1].planned_rounds)[0] \
        if results and results[-1].after_first_round else 0.0
    if first > 0:
        v = _decide_at(results, gate, True, first, first)
        if v.passed:
            return f"every check passed at the look after the first round: {v.reason}"
    return round_futility(results, gate)


def round_futility(results: Sequence[BenchResult], gate: Any) -> str | None:
    """Why the newest attempt's remaining rounds cannot let the candidate pass at this look (None: they might).

    ``results``: the cycle's attempts so far, the newest one measured up to the end of a round.
    Its later rounds replay the same prompts, so where replays repeat acceptance exactly
    (:func:`acceptance_repeats`; one round shows it, the live head and its A/A control answer
    the same prompts), they leave the pooled acceptance interval where it is now. When that
    interval cannot pass, neither can this look's verdict, whatever throughput does, and the
    rounds are not spent. Stopping only for a check that cannot pass takes no chance of a
    false promotion: a promotion still needs every check to pass at its look.
    """
    results = list(results)
    if not results or not results[-1].concurrencies:
        return None
    last = results[-1]
    looks = max(gate.max_attempts, len(results))
    earlier = [r for r in results[:-1] if aa_void(r, gate) is None]
    pooled = earlier + results[-1:]
    # the rounds left end at the attempt's last look
    level = acceptance_level(pooled, gate, looks, attempt_levels(gate, looks, last.planned_rounds or last.rounds)[1])
    refs = _refs(set().union(*(r.arms for r in pooled)))
    c = acceptance_check(pool_clusters([r.clusters for r in pooled]), min(results[-1].concurrencies), refs, gate,
                         level)
    if c.status == PASSED or not acceptance_repeats(pooled):
        return None
    return (f"{c.why} (the rounds left replay the same prompts, whose acceptance repeats exactly: "
            "they cannot move it)")


def decide(results: BenchResult | list[BenchResult], gate: Any, more_prompts: bool = True) -> Verdict:
    """The verdict after ``len(results)`` benchmarks of one candidate (a cycle's attempts, in order).

    ``more_prompts``: whether a further attempt would replay prompt groups not measured yet
    (False: the held-out set has no more, so it would replay the same groups). Without them,
    an acceptance check that cannot tell stays so at every later look when the replays so far
    repeated it exactly (:func:`acceptance_repeats`): the verdict cannot pass any more and
    is final, and the attempts that could not change it are not spent.
    """
    results = [results] if isinstance(results, BenchResult) else list(results)
    last = results[-1]
    first, final = attempt_levels(gate, max(gate.max_attempts, len(results)), last.planned_rounds or last.rounds)
    if last.after_first_round and first > 0:  # the newest attempt stopped at the look after its first round
        v = _decide_at(results, gate, more_prompts, first, first)
        if v.passed:
            return v
    return _decide_at(results, gate, more_prompts, final, first)


def _decide_at(results: list[BenchResult], gate: Any, more_prompts: bool, level: float,
               first_look: float = 0.0) -> Verdict:
    """:func:`decide` with the newest look at one-sided ``level`` (``first_look``: the level of the look after
    the newest attempt's first round, which an attempt stopped there may pass at)."""
    look = len(results)
    looks = max(gate.max_attempts, look)
    last = results[-1]
    voids = {i + 1: why for i, r in enumerate(results) if (why := aa_void(r, gate)) is not None}
    kept = [r for i, r in enumerate(results) if i + 1 not in voids]
    checks: list[Check] = []
    if look in voids:
        checks.append(Check("aa_control", INCONCLUSIVE, f"attempt {look} void: {voids[look]}"))
    else:
        clusters = pool_clusters([r.clusters for r in kept])
        arms = set().union(*(r.arms for r in kept))
        refs = _refs(arms)
        concs = sorted(set(last.concurrencies))
        failed = {role: sum(r.failed(role) for r in results) for role in (CANDIDATE, LIVE)}
        if failed[CANDIDATE] > failed[LIVE]:
            checks.append(Check("requests", REJECTED, f"requests: the candidate failed {failed[CANDIDATE]} requests, "
                                                      f"the live head {failed[LIVE]}"))
        conf = 1.0 - 2.0 * level  # each bound of this two-sided interval is a one-sided bound at `level`
        aa = last.aa_control
        if concs:
            checks.append(acceptance_check(clusters, concs[0], refs, gate, acceptance_level(kept, gate, looks, level),
                                           aa))
        else:
            checks.append(Check("output_tok_per_s", INCONCLUSIVE, "benchmark has no throughput results"))
        if gate.throughput_test == "non_inferiority":
            factor = 1.0 - gate.throughput_tolerance
        else:
            factor = 1.0 + gate.min_throughput_gain
        for c in concs:
            # x > factor·ref, tested exactly; shown as x − ref against the margin (factor − 1)·ref.
            iv = contrast(clusters, "output_tok_per_s", c, CANDIDATE, refs, conf, ref_factor=factor)
            ref = [v for v in reference(clusters, "output_tok_per_s", c, refs) if not math.isnan(v)]
            margin = (factor - 1.0) * (sum(ref) / len(ref)) if ref else 0.0
            checks.append(check(f"output_tok_per_s@c{c}", iv, margin, "tok/s", level, gate.min_clusters,
                                aa.tok_per_s(c) if aa else None))
    statuses = {c.status for c in checks}
    status = REJECTED if REJECTED in statuses else PASSED if statuses == {PASSED} else INCONCLUSIVE
    shown = [c for c in checks if c.status == status] if status != PASSED else checks
    reason = "; ".join(c.why for c in shown)
    if status == PASSED and last.rounds < (last.planned_rounds or last.rounds) and level > first_look:
        # an attempt stopped before its last round never reached the look this level belongs to
        status = INCONCLUSIVE
        reason = (f"the attempt stopped after {last.rounds} of {last.planned_rounds} rounds, before the look "
                  f"at this level: {reason}")
    # Re-measuring replays the same prompt groups: it cannot add groups to a check that has too few.
    final = status != INCONCLUSIVE or look >= looks or any(
        c.status == INCONCLUSIVE and 0 < c.clusters < gate.min_clusters for c in checks)
    if status == INCONCLUSIVE and not final and not more_prompts and look not in voids and any(
            c.name == "mean_acceptance_length" and c.status == INCONCLUSIVE for c in checks) \
            and acceptance_repeats(kept):
        final = True
        reason = (f"{reason} (a further attempt would replay the same prompt groups, whose acceptance repeated "
                  "exactly on every replay: it cannot pass)")
    if status == INCONCLUSIVE and final:
        reason = f"inconclusive after {look} benchmark(s): {reason}"
    return Verdict(status, reason, checks, look, level, sorted(voids), final)


def offline_check(offline: dict[str, Any], gate: Any, level: float | None = None) -> Check:
    """The candidate's offline acceptance against the live head's, paired by held-out prompt.

    ``offline`` is ``evaluation.offline.compare_heads``' output for roles candidate and live.
    Each prompt is a cluster (one held-out conversation each); the per-prompt difference in
    mean acceptance length gets a t-interval at one-sided ``level`` per bound (the gate's level
    unless given).
    """
    level = gate.level if level is None else level
    cand, live = offline.get(CANDIDATE) or {}, offline.get(LIVE) or {}
    pairs = [(1 + ca / cd) - (1 + la / ld) for (cd, ca), (ld, la)
             in zip(cand.get("per_prompt") or [], live.get("per_prompt") or []) if cd and ld]
    iv = t_interval(pairs, 1.0 - 2.0 * level)
    return check("offline_acceptance_length", iv, max(gate.min_acceptance_gain, 0.0), "tokens", level,
                 gate.min_clusters)


def prescreen(offline: dict[str, Any], gate: Any) -> Verdict | None:
    """A rejection before any replay benchmark, or None to go on and measure.

    Acceptance length is one of the gate's must-pass figures, and the offline estimate of
    it replays the same held-out prompts through the target's own greedy answers. When that
    estimate is confidently *not* better than the live head's by the margin, benchmarking
    cannot change the verdict's direction on that figure, so the cycle stops here and spends
    no engine time. With ``[gate] offline_futility`` it also rejects a candidate whose offline
    acceptance does not pass at the most lenient level any bench look of acceptance gets
    (``α / max_attempts``): the bench measures acceptance on a subset of the same prompts with
    the same greedy answers, so its estimate tracks the offline one and its interval, from no
    more prompts than the offline check has, is no narrower; an attempt would spend engine time
    on a refusal that is all but certain (a prediction: the served figure may differ a little).
    Fewer prompts than ``min_clusters`` leave the bench to decide.
    Only rejection is taken from offline figures: a promotion always needs the replay benchmark,
    so the false-promotion rate stays the bench's.
    """
    c = offline_check(offline, gate)
    if c.status == REJECTED:
        return Verdict(REJECTED, f"offline, before benchmarking: {c.why}", [c], 0, gate.level, [], True)
    if not gate.offline_futility:
        return None
    level = look_level(gate.level, gate.max_attempts)
    f = offline_check(offline, gate, level)
    if f.status == PASSED or f.clusters < gate.min_clusters:
        return None
    return Verdict(REJECTED, f"offline, before benchmarking: the bench's acceptance check, at its level {level:.3g} "
                   f"on the same prompts, would not pass: {f.why}", [f], 0, level, [], True)


def bootstrap_verdict() -> Verdict:
    """The first head of a registered model has nothing to beat: it passes, and says so."""
    return Verdict(PASSED, "bootstrap: no Production version and no live head to compare against", [])


def power_plan(result: BenchResult, gate: Any, tok_gain: float = 0.10, acceptance_gain: float = 0.10,
               target: float = 0.8) -> dict[str, dict[str, Any]]:
    """The gate's own power analysis from one bench's noise: per check, its power and the groups it needs.

    For a candidate ``tok_gain`` faster (a fraction of the reference's tok/s) and
    ``acceptance_gain`` tokens better in acceptance, each check's power at the first attempt's last
    look (``α / max_attempts``, less ``first_round_share``) with the prompt groups this bench had,
    and the number of groups that would give ``target`` power at the same rounds and group
    size, with the held-out prompts that takes (``prompts_for_target``). The per-group noise is the candidate − reference spread where a candidate was measured,
    else the A/A control's (control − live has 4/3 the variance of candidate − reference).
    """
    level = attempt_levels(gate, gate.max_attempts, result.rounds)[1]
    refs = _refs(set(result.arms))
    out: dict[str, dict[str, Any]] = {}
    c1 = min(result.concurrencies)
    items = [("mean_acceptance_length", c1, acceptance_gain - gate.min_acceptance_gain)]
    for c in result.concurrencies:
        ref = [v for v in reference(result.clusters, "output_tok_per_s", c, refs) if not math.isnan(v)]
        mean_ref = sum(ref) / len(ref) if ref else math.nan
        items.append((f"output_tok_per_s@c{c}", c, (tok_gain - gate.min_throughput_gain) * mean_ref))
    for name, c, effect in items:
        metric = name.split("@")[0]
        diff = contrast(result.clusters, metric, c, CANDIDATE, refs, 0.9)
        aa = contrast(result.clusters, metric, c, CONTROL, [LIVE], 0.9) if CONTROL in result.arms else None
        sd = diff.sd if diff.sd is not None else (aa.sd * math.sqrt(0.75) if aa and aa.sd is not None else None)
        j = diff.clusters
        sizes = [len(cl.prompts) for cl in result.clusters if cl.concurrency == c]
        row: dict[str, Any] = {"effect_beyond_margin": effect, "sd_per_group": sd, "groups": j,
                               "prompts_per_group": sum(sizes) / len(sizes) if sizes else None}
        if sd is not None and not math.isnan(effect):
            row["power"] = power(effect, sd, j, level)
            need = clusters_needed(effect, sd, level, target, gate.min_clusters)
            row["groups_for_target"] = need
            row["prompts_for_target"] = (math.ceil(need * row["prompts_per_group"])
                                         if need is not None and sizes else None)
        out[name] = row
    return out


@dataclass
class AttemptSize:
    """How a cycle's attempts replay held-out prompts: the bench's shape, and why this one."""

    prompts: int  # held-out prompts per attempt (a later attempt takes new ones while the set has them)
    rounds: int
    group_size: int
    budget: float  # prompt replays per attempt (per concurrency, on average), as a multiple of the default bench's
    power: float | None = None  # predicted chance every check passes at the last look (None: no noise known)
    why: str = ""
    predicted: dict[str, float] = field(default_factory=dict)  # per check
    # Prompts replayed at each concurrency where they differ (the first ones of ``prompts``); empty: all of them.
    prompts_at: dict[int, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "prompts_at": {str(c): n for c, n in self.prompts_at.items()}}


def _noise(results: Sequence[BenchResult], gate: Any) -> dict[str, tuple[float, float, float]]:
    """Per check, the per-group variance split into a per-turn and a per-prompt part, and the effect.

    The A/A control (control − live) holds only the machine's noise: the candidate −
    reference contrast holds 3/4 of it (its pooled reference halves one side) plus how the
    candidate's advantage varies from prompt to prompt. The machine's part shrinks with the
    rounds that replay a group, the prompts' part with the prompts in it; throughput in
    units of the reference's tok/s, so benches of other heads and machines average.
    """
    acc: dict[str, list[tuple[float, float, float]]] = {}
    for r in results:
        if CONTROL not in r.arms or CANDIDATE not in r.arms or not r.concurrencies:
            continue
        refs = _refs(set(r.arms))
        c1 = min(r.concurrencies)
        items = [("mean_acceptance_length", c1, "mean_acceptance_length")]
        items += [(f"output_tok_per_s@c{c}", c, "output_tok_per_s") for c in r.concurrencies]
        for name, c, metric in items:
            d = contrast(r.clusters, metric, c, CANDIDATE, refs, 0.9)
            a = contrast(r.clusters, metric, c, CONTROL, [LIVE], 0.9)
            if d.sd is None or a.sd is None:
                continue
            scale = 1.0
            if metric == "output_tok_per_s":
                ref = [v for v in reference(r.clusters, metric, c, refs) if not math.isnan(v)]
                scale = sum(ref) / len(ref) if ref and sum(ref) > 0 else math.nan
            sizes = [len(cl.prompts) for cl in r.clusters if cl.concurrency == c]
            m0 = sum(sizes) / len(sizes)
            machine = 0.75 * (a.sd / scale) ** 2
            prompt = max(0.0, (d.sd / scale) ** 2 - machine)
            acc.setdefault(name, []).append((machine * max(1, r.rounds), prompt * m0, c))
    return {k: (sum(x[0] for x in v) / len(v), sum(x[1] for x in v) / len(v), v[0][2]) for k, v in acc.items()}


def size_attempts(recent: Sequence[BenchResult], gate: Any, bench: Any, available: int, *,
                  tok_gain: float = 0.10, acceptance_gain: float = 0.10, target: float | None = None,
                  most_budget: float | None = None) -> AttemptSize:
    """The shape of a cycle's attempts, from the last cycles' benches (``recent``), for ``target`` power
    (default: ``[gate] power_target``) within ``most_budget`` (default: ``[gate] most_budget``).

    For a candidate ``tok_gain`` faster and ``acceptance_gain`` tokens better, each shape's
    power at the last look (every attempt pooled, at the last look's level) is predicted from
    the recent benches' noise (:func:`_noise`): the product of the checks' powers, since a
    promotion needs all of them. The shapes: the default (``[bench] max_prompts``,
    ``rounds``, ``group_size``), more prompts per attempt, the same prompts replayed in more
    rounds (all a small held-out set allows), and one round of twice the prompts instead of
    replaying each twice, each in groups of the configured size or, where every attempt
    takes new prompts, of 2 (more, shorter turns: the machine's noise averages over more of
    them, and a load burst more often spans every arm of a slot); where the held-out set
    has the prompts, also the same replays split unevenly between the concurrencies (the
    lowest one a quarter or an eighth fewer, the others as many more between them, or the reverse), so the
    weaker check gets more of them. Up to ``most_budget`` times the default's prompt replays
    per attempt, and never more prompts than the held-out set has (``available``). The
    default wins when it reaches ``target``, else the cheapest shape that does (then the one
    with the fewest turns); when none does, the most powerful. Without recent benches the
    default is what comes out.
    """
    from evaluation.bench import GROUP_CYCLE, prompt_groups

    target = gate.power_target if target is None else target
    most_budget = gate.most_budget if most_budget is None else most_budget
    default = AttemptSize(bench.max_prompts, bench.rounds, bench.group_size, 1.0)
    noise = _noise(recent, gate)
    if not noise:
        default.why = "no earlier bench with a candidate and an A/A control to size from: the default"
        return default
    attempts = max(1, gate.max_attempts)
    concs = sorted({c for _, _, c in noise.values()})
    base = bench.max_prompts * bench.rounds
    sizes = sorted({bench.group_size, 2}, reverse=True)
    even: list[tuple[int, int, int]] = [(bench.max_prompts, bench.rounds, m) for m in sizes]
    for f in (1.5, 2.0, 3.0, 4.0):
        if f <= most_budget:
            for m in sizes:
                even.append((int(round(f * bench.max_prompts)), bench.rounds, m))
                # the same prompts replayed more often: all a small held-out set allows
                even.append((bench.max_prompts, int(round(f * bench.rounds)), m))
    for f in (1.0, 1.5, 2.0, 3.0, 4.0):
        if f <= most_budget:
            for m in sizes:
                even.append((int(round(f * base)), 1, m))
    # (prompts per concurrency, rounds, group size)
    shapes: list[tuple[tuple[int, ...], int, int]] = [((p,) * len(concs), r, m) for p, r, m in even]
    if len(concs) > 1:
        for p, r, m in even:
            for shift in (-0.25, -0.125, 0.125, 0.25):
                low = int(round(p * (1 - shift)))
                high = int(round(p * (1 + shift / (len(concs) - 1))))
                if max(low, high) <= available:  # only prompts the set has, never the same ones twice
                    shapes.append(((low,) + (high,) * (len(concs) - 1), r, m))

    def predict(at: dict[int, int], rounds: int, m: int) -> tuple[float, dict[str, float], int]:
        batches = max(1, min(attempts, available // max(at.values())))  # new prompts per attempt while they last
        eff_rounds = rounds * attempts / batches
        level = attempt_levels(gate, attempts, rounds)[1]  # the attempt's last look
        out, turns = {}, 0
        for name, (machine, prompt, c) in noise.items():
            groups = prompt_groups(at[c], c, m, GROUP_CYCLE, gate.min_clusters)
            j = len(groups)
            if name.startswith("output"):
                turns += j * rounds
            var = machine / eff_rounds + prompt / (at[c] / j)
            if name == "mean_acceptance_length":
                effect = acceptance_gain - gate.min_acceptance_gain
            else:
                effect = tok_gain - gate.min_throughput_gain
            out[name] = power(effect, math.sqrt(var), j * batches, level) if j * batches >= gate.min_clusters else 0.0
        return math.prod(out.values()), out, turns  # every check must pass

    rows = []
    for ps, rounds, m in dict.fromkeys(shapes):
        p = max(ps)
        if p > max(available, bench.max_prompts) or min(ps) < 1:
            continue
        if m < bench.group_size and available < p * attempts:
            # Smaller groups only where every attempt brings new ones: a few prompts replayed in small
            # groups made the t-bound liberal on a busy machine (benchmarks/gate_sim.py); many held it.
            continue
        if p == bench.max_prompts:
            ps = tuple(min(n, available) for n in ps)
        at = dict(zip(concs, ps))
        pw, per, turns = predict(at, rounds, m)
        rows.append((sum(ps) / len(ps) * rounds / base, turns, pw, per, p, rounds, m, at))
    good = [r for r in rows if r[2] >= target]
    default_row = rows[0]  # (prompts, rounds, group size) as configured
    if default_row[2] >= target:
        good = [default_row]
    pick = min(good, key=lambda r: (r[0], r[1])) if good else max(rows, key=lambda r: (r[2], -r[0]))
    f, _turns, pw, per, p, rounds, m, at = pick
    split = len(set(at.values())) > 1
    what = (", ".join(f"{n} at c={c}" for c, n in at.items()) if split else f"{p}") + " prompts"
    if good:
        why = (f"{what} x {rounds} round(s) in groups of {m}: the cheapest shape with {target:.0%} power "
               f"(predicted {pw:.0%}) from {len(recent)} recent bench(es)")
    else:
        why = (f"{what} x {rounds} round(s) in groups of {m}: no shape within {most_budget:g}x the default "
               f"budget reaches {target:.0%} power (predicted {pw:.0%} at best)")
    return AttemptSize(p, rounds, m, f, pw, why, per, at if split else {})
