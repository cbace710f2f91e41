"""Statistics of a replay bench: prompt-group clusters, cluster t-intervals, sequential levels, power.

The unit of inference is the **prompt group**: the few prompts one slot of the bench plan
replays with every arm (``evaluation.bench.plan``). Everything a group's measurements share
is inside its cluster: the prompts' own difficulty and how each head fares on them (greedy
acceptance repeats exactly from round to round), and the load of the moments its slots ran.
So every round, and every attempt of a cycle, of one group is merged into one cluster, and
an interval is a t-interval over clusters: with J groups it has J − 1 degrees of freedom,
however many rounds replayed them. Resampling slots as if the rounds were independent
would count each group once per round and make the interval too narrow.

A contrast is one number per cluster (e.g. the candidate's tok/s minus the mean of the live
head's and the A/A control's); its mean, standard error and t-quantile give the interval.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable

CANDIDATE, LIVE, CONTROL, NOSPEC = "candidate", "live", "control", "nospec"
SPEC_ARMS = (CANDIDATE, LIVE, CONTROL)

# -- Student's t, without scipy ------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbeta) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbeta) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom (df = inf: the normal)."""
    if math.isinf(df):
        return 0.5 * math.erfc(-t / math.sqrt(2.0))
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=4096)
def t_ppf(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`; exact to ~1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level {p} is not in (0, 1)")
    if p < 0.5:
        return -t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def normal_ppf(p: float) -> float:
    return t_ppf(p, math.inf)


# -- sequential looks -------------------------------------------------------------------------


def look_level(alpha: float, looks: int) -> float:
    """The one-sided level of each of a cycle's ``looks`` looks: ``alpha / looks`` (Bonferroni).

    Whatever the correlation between the looks, the chance that any of them crosses is at
    most the sum of their levels, ``alpha``. The gate's looks are correlated differently
    from cycle to cycle: a later attempt that replays the same prompt groups correlates
    almost fully with the earlier ones, one on new prompt groups as ``sqrt(i/j)``; and
    each look's cluster t-interval is only approximately at its level with few skewed
    clusters (a burst that slows one arm's turn). Pocock's sharper constant
    (:func:`pocock_level`) is exact only for independent equal increments of normal
    data, and the simulator (``benchmarks/gate_sim.py``) found the false-promotion rate
    at a margin too close to ``alpha`` with it; the equal split leaves that room.
    """
    return alpha / max(1, looks)


def pocock_level(alpha: float, looks: int) -> float:
    """The nominal one-sided level of each of ``looks`` equally spaced looks (Pocock's boundary).

    A cycle may benchmark a candidate up to ``looks`` times, each attempt pooled with the
    earlier ones. Testing every look at ``alpha`` would give a null candidate ``looks``
    chances to pass: the boundary instead tests each look at the constant level whose
    chance of being crossed at *any* look, for standardized sums of independent equal
    increments (correlation sqrt(i/j) between looks i < j), is exactly ``alpha``. Computed
    by recursive numerical integration of the sum's density, with the mass that crossed
    the boundary removed at each look.
    """
    if looks <= 1:
        return alpha
    return _pocock(round(alpha, 12), looks)


@functools.lru_cache(maxsize=64)
def _pocock(alpha: float, looks: int) -> float:
    import numpy as np

    def crossing(c: float) -> float:
        h = 0.01
        grid = np.arange(-10.0 * math.sqrt(looks), 10.0 * math.sqrt(looks) + h / 2, h)
        dens = np.exp(-grid ** 2 / 2) / math.sqrt(2 * math.pi)  # density of S_1
        kern = np.exp(-np.arange(-8.0, 8.0 + h / 2, h) ** 2 / 2)
        kern /= kern.sum()
        crossed = 0.0
        for k in range(1, looks + 1):
            if k > 1:
                dens = np.convolve(dens, kern, mode="same")
            beyond = np.clip((grid + h / 2 - c * math.sqrt(k)) / h, 0.0, 1.0)  # share of each cell past it
            crossed += float((dens * beyond).sum() * h)
            dens = dens * (1.0 - beyond)
        return crossed

    lo, hi = normal_ppf(1 - alpha), normal_ppf(1 - alpha / looks)  # none and Bonferroni bracket it
    for _ in range(40):
        mid = (lo + hi) / 2
        if crossing(mid) > alpha:
            lo = mid
        else:
            hi = mid
    return 1.0 - t_cdf((lo + hi) / 2, math.inf)


# -- clusters ---------------------------------------------------------------------------------

_SUMS = ("requests", "tokens", "latency_s", "ttft_sum_s", "ttft_n", "tpot_sum_s", "tpot_n", "itl_sum_s",
         "itl_n", "drafts", "accepted")


@dataclass
class ClusterSums:
    """Sums over the requests of one arm in one prompt group (every round and attempt merged)."""

    requests: int = 0
    tokens: float = 0.0
    latency_s: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_n: int = 0
    tpot_sum_s: float = 0.0
    tpot_n: int = 0
    itl_sum_s: float = 0.0
    itl_n: int = 0
    drafts: float = 0.0  # per-request spec counters (measured at concurrency 1 only)
    accepted: float = 0.0

    def add(self, other: "ClusterSums") -> None:
        # Spelled out, not a loop over _SUMS: the gate's simulation pools clusters millions of times.
        self.requests += other.requests
        self.tokens += other.tokens
        self.latency_s += other.latency_s
        self.ttft_sum_s += other.ttft_sum_s
        self.ttft_n += other.ttft_n
        self.tpot_sum_s += other.tpot_sum_s
        self.tpot_n += other.tpot_n
        self.itl_sum_s += other.itl_sum_s
        self.itl_n += other.itl_n
        self.drafts += other.drafts
        self.accepted += other.accepted

    def add_request(self, output_tokens: int, latency_s: float, ttft_s: float, tpot_s: float,
                    itls_s: Iterable[float], drafts: float, accepted: float) -> None:
        self.requests += 1
        self.tokens += output_tokens
        self.latency_s += latency_s
        if not math.isnan(ttft_s):
            self.ttft_sum_s += ttft_s
            self.ttft_n += 1
        if not math.isnan(tpot_s):
            self.tpot_sum_s += tpot_s
            self.tpot_n += 1
        itls = list(itls_s)
        self.itl_sum_s += sum(itls)
        self.itl_n += len(itls)
        if not math.isnan(drafts):
            self.drafts += drafts
            self.accepted += accepted

    def to_json(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in _SUMS}

    @classmethod
    def from_json(cls, d: dict[str, float]) -> "ClusterSums":
        return cls(**{k: d[k] for k in _SUMS if k in d})


@dataclass
class Cluster:
    """One prompt group at one concurrency: the sums of every arm over the rounds that replayed it."""

    concurrency: int
    prompts: list[int]
    rounds: int = 0
    arms: dict[str, ClusterSums] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, tuple[int, ...]]:
        return self.concurrency, tuple(self.prompts)

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "prompts": self.prompts, "rounds": self.rounds,
                "arms": {a: s.to_json() for a, s in self.arms.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Cluster":
        return cls(int(d["concurrency"]), [int(p) for p in d["prompts"]], int(d.get("rounds", 0)),
                   {a: ClusterSums.from_json(s) for a, s in d["arms"].items()})


def pool_clusters(groups: Iterable[Iterable[Cluster]]) -> list[Cluster]:
    """Merge the clusters of several benches of the same prompts (a cycle's attempts) group by group."""
    out: dict[tuple, Cluster] = {}
    for clusters in groups:
        for cl in clusters:
            mine = out.setdefault(cl.key, Cluster(cl.concurrency, list(cl.prompts)))
            mine.rounds += cl.rounds
            for arm, s in cl.arms.items():
                mine.arms.setdefault(arm, ClusterSums()).add(s)
    return sorted(out.values(), key=lambda c: (c.concurrency, c.prompts))


def clusters_from_blocks(blocks: list[dict], arms: list[str]) -> list[Cluster]:
    """Per prompt group, the sums of each arm over the requests that *every* arm answered.

    ``blocks`` are what the bench measured (``role``, ``round``, ``concurrency``,
    ``prompts``, ``results``). A prompt replay one arm failed is left out for all arms of
    its slot, so a failure never leaves one arm with a different mix of prompts.
    """
    by_slot: dict[tuple, dict[str, dict]] = {}
    for b in blocks:
        by_slot.setdefault((b["round"], b["concurrency"], tuple(b["prompts"])), {})[b["role"]] = b
    out: dict[tuple, Cluster] = {}
    for (_rnd, c, prompts), bl in by_slot.items():
        cl = out.setdefault((c, prompts), Cluster(c, list(prompts)))
        cl.rounds += 1
        ok = [all(bl[a]["results"][i].ok for a in arms if a in bl) for i in range(len(prompts))]
        for a in arms:
            s = cl.arms.setdefault(a, ClusterSums())
            if a not in bl:
                continue
            for i, r in enumerate(bl[a]["results"]):
                if ok[i]:
                    s.add_request(r.output_tokens, r.latency, r.ttft, r.tpot, r.itls, r.drafts, r.accepted)
    return sorted(out.values(), key=lambda c: (c.concurrency, c.prompts))


# Per-cluster figures of one arm: name -> f(sums, concurrency).
def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


FIGURES = {
    "mean_acceptance_length": lambda s, c: 1.0 + _ratio(s.accepted, s.drafts) if s.drafts > 0 else math.nan,
    # c requests in flight, each at tokens/latency: what the arm serves at concurrency c
    "output_tok_per_s": lambda s, c: c * _ratio(s.tokens, s.latency_s),
    "tpot_ms": lambda s, c: 1000 * _ratio(s.tpot_sum_s, s.tpot_n),
    "itl_ms": lambda s, c: 1000 * _ratio(s.itl_sum_s, s.itl_n),
    "ttft_ms": lambda s, c: 1000 * _ratio(s.ttft_sum_s, s.ttft_n),
}


def figure(clusters: list[Cluster], name: str, c: int, role: str) -> list[float]:
    """One figure of ``role`` per prompt group at concurrency ``c`` (NaN where it was not measured)."""
    f = FIGURES[name]
    return [f(cl.arms[role], c) if role in cl.arms else math.nan for cl in clusters if cl.concurrency == c]


def reference(clusters: list[Cluster], name: str, c: int, roles: list[str]) -> list[float]:
    """The mean of ``roles``' figures per cluster: the live head and its A/A control pooled."""
    cols = [figure(clusters, name, c, r) for r in roles]
    return [sum(v) / len(v) for v in zip(*cols)]


@dataclass
class Interval:
    """A contrast's estimate and its two-sided t-interval over prompt-group clusters."""

    estimate: float | None
    lo: float | None
    hi: float | None
    confidence: float  # two-sided; each bound alone is a one-sided bound at (1 - confidence) / 2
    clusters: int = 0
    pairs: int = 0
    sd: float | None = None  # the per-cluster standard deviation: the noise a power analysis needs

    @property
    def ci(self) -> list[float | None]:
        return [self.lo, self.hi]

    def excludes(self, value: float) -> bool:
        return self.lo is not None and self.hi is not None and not self.lo <= value <= self.hi

    def to_json(self) -> dict:
        return {"estimate": self.estimate, "ci": [self.lo, self.hi], "confidence": self.confidence,
                "clusters": self.clusters, "pairs": self.pairs, "sd": self.sd}

    @classmethod
    def from_json(cls, d: dict | None, confidence: float = 0.9) -> "Interval":
        d = d or {}
        ci = d.get("ci") or [None, None]
        # schema 2 called the clusters "slots"
        return cls(d.get("estimate"), ci[0], ci[1], d.get("confidence", confidence),
                   int(d.get("clusters", d.get("slots", 0)) or 0), int(d.get("pairs", 0) or 0), d.get("sd"))

    @classmethod
    def empty(cls, confidence: float) -> "Interval":
        return cls(None, None, None, confidence)


def _clean(x: float) -> float | None:
    return None if x is None or math.isnan(x) or math.isinf(x) else float(x)


def t_interval(values: list[float], confidence: float, shift: float = 0.0, pairs: int = 0) -> Interval:
    """Mean of per-cluster ``values`` and its two-sided t-interval (NaN clusters left out), plus ``shift``."""
    xs = [v for v in values if not math.isnan(v)]
    j = len(xs)
    if j == 0:
        return Interval(None, None, None, confidence, 0, pairs)
    mean = sum(xs) / j
    if j == 1:
        return Interval(_clean(mean + shift), None, None, confidence, 1, pairs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (j - 1))
    half = t_ppf((1 + confidence) / 2, j - 1) * sd / math.sqrt(j)
    return Interval(_clean(mean + shift), _clean(mean - half + shift), _clean(mean + half + shift), confidence, j,
                    pairs, _clean(sd))


def contrast(clusters: list[Cluster], name: str, c: int, x: str, ys: list[str], confidence: float,
             ref_factor: float = 1.0) -> Interval:
    """``x − mean(ys)`` of figure ``name`` at concurrency ``c``, one value per prompt group.

    With ``ref_factor`` = 1 + g the t-interval is that of ``x − (1 + g)·ref`` shifted back by
    ``g·mean(ref)``: a relative margin g tested exactly (``x > (1 + g)·ref``) yet reported in
    the units of the plain difference.
    """
    xv, rv = figure(clusters, name, c, x), reference(clusters, name, c, ys)
    d = [a - ref_factor * b for a, b in zip(xv, rv)]
    ok_ref = [b for a, b in zip(d, rv) if not math.isnan(a)]
    shift = (ref_factor - 1.0) * (sum(ok_ref) / len(ok_ref)) if ok_ref else 0.0
    pairs = sum(min(cl.arms[r].requests for r in [x, *ys] if r in cl.arms) for cl in clusters
                if cl.concurrency == c and all(r in cl.arms for r in [x, *ys]))
    return t_interval(d, confidence, shift, pairs)


def log_ratio(clusters: list[Cluster], name: str, c: int, x: str, y: str, confidence: float) -> Interval:
    """``x / y`` of figure ``name``: the t-interval of the per-cluster log ratio, exponentiated."""
    pairs = [(a, b) for a, b in zip(figure(clusters, name, c, x), figure(clusters, name, c, y)) if a > 0 and b > 0]
    iv = t_interval([math.log(a / b) for a, b in pairs], confidence, pairs=len(pairs))
    return Interval(*(None if v is None else math.exp(v) for v in (iv.estimate, iv.lo, iv.hi)), confidence,
                    iv.clusters, iv.pairs, iv.sd)


def _binom_pmf(i: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 1.0 if i == 0 else 0.0
    if p >= 1.0:
        return 1.0 if i == n else 0.0
    return math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1)
                    + i * math.log(p) + (n - i) * math.log1p(-p))


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a binomial rate k/n: a right-answer or false-promotion rate."""
    def at_least(p: float) -> float:  # P(X >= k)
        return sum(_binom_pmf(i, n, p) for i in range(k, n + 1))

    def at_most(p: float) -> float:  # P(X <= k)
        return sum(_binom_pmf(i, n, p) for i in range(k + 1))

    a = (1 - confidence) / 2

    def solve(f, rising: bool) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if (f(mid) < a) == rising:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    return (0.0 if k == 0 else solve(at_least, True)), (1.0 if k == n else solve(at_most, False))


# -- power ------------------------------------------------------------------------------------


def power(effect: float, sd: float, clusters: int, level: float) -> float:
    """Chance that a one-sided t-test at ``level`` on ``clusters`` clusters sees ``effect`` above its margin.

    ``effect`` is the true difference beyond the margin and ``sd`` the per-cluster standard
    deviation of the contrast. The noncentral t is approximated by a shifted central t
    (slightly conservative at these sizes).
    """
    if clusters < 2:
        return 0.0
    if sd <= 0:
        return 1.0 if effect > 0 else 0.0
    df = clusters - 1
    ncp = effect / (sd / math.sqrt(clusters))
    return 1.0 - t_cdf(t_ppf(1 - level, df) - ncp, df)


def clusters_needed(effect: float, sd: float, level: float, target: float = 0.8, min_clusters: int = 6,
                    most: int = 10_000) -> int | None:
    """The fewest prompt groups (at least ``min_clusters``) that give ``target`` power; None beyond ``most``."""
    for j in range(max(2, min_clusters), most + 1):
        if power(effect, sd, j, level) >= target:
            return j
    return None
