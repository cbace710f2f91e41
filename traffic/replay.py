"""Replay real conversations against an OpenAI-compatible endpoint, turn by turn, as clients do.

Each conversation's users' turns are sent one after the other; every request carries
the history so far with the *served model's own* earlier answers (not the answers
recorded in the dataset), as a real chat client would. Conversations start as a
Poisson process at ``rate`` per second (or back to back when ``rate`` is 0), and at
most ``concurrency`` are in flight at once. A conversation whose history no longer
fits the model's context ends there (counted, not failed).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import httpx

from capture.sharegpt import to_messages


@dataclass
class ReplayStats:
    conversations: int = 0
    completed: int = 0  # every user turn answered
    context_full: int = 0  # ended early: the history outgrew the model's context
    failed: int = 0  # ended by an error other than the context
    turns_sent: int = 0
    turns_ok: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "errors"}
        d["output_tok_per_s"] = round(self.output_tokens / self.seconds, 2) if self.seconds else None
        d["errors"] = self.errors[:5]
        return d


def _is_context_error(status: int, text: str) -> bool:
    t = text.lower()
    return status == 400 and ("context length" in t or "maximum context" in t or "too long" in t
                              or "max_model_len" in t or "exceeds" in t)


async def replay_conversation(client: httpx.AsyncClient, url: str, model: str, row: dict[str, Any], *,
                              max_tokens: int, max_turns: int | None, temperature: float, stats: ReplayStats,
                              tick=None, timeout: float = 900.0, headers: dict[str, str] | None = None) -> list[dict]:
    """Send one conversation's user turns in order; returns the messages as served (the model's answers)."""
    history: list[dict[str, str]] = []
    users = 0
    for msg in to_messages(row):
        if msg["role"] == "assistant":
            continue  # the dataset's answer: replaced by the served model's own
        history.append(msg)
        if msg["role"] != "user":
            continue
        users += 1
        if max_turns is not None and users > max_turns:
            history.pop()
            break
        body = {"model": model, "messages": history, "max_tokens": max_tokens, "temperature": temperature}
        stats.turns_sent += 1
        try:
            r = await client.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=timeout,
                                  headers=headers)
        except httpx.HTTPError as exc:
            stats.failed += 1
            stats.errors.append(f"{type(exc).__name__}: {exc}")
            return history
        if r.status_code != 200:
            if _is_context_error(r.status_code, r.text):
                stats.context_full += 1
            else:
                stats.failed += 1
                stats.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
            history.pop()
            return history
        out = r.json()
        stats.turns_ok += 1
        stats.output_tokens += int((out.get("usage") or {}).get("completion_tokens") or 0)
        history.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})
        if tick:
            tick()
    stats.completed += 1
    return history


def replayed_turns(row: dict[str, Any], max_turns: int | None = None) -> int:
    """The user turns of ``row`` a replay sends (at most ``max_turns``): one request, one captured record each."""
    return min(sum(m["role"] == "user" for m in to_messages(row)), max_turns or 10**9)


async def _replay(url: str, model: str, rows: list[dict[str, Any]], *, max_tokens: int, max_turns: int | None,
                  concurrency: int, rate: float, seed: int, temperature: float, progress: bool,
                  headers: dict[str, str] | None, transcripts: list | None) -> ReplayStats:
    stats = ReplayStats(conversations=len(rows))
    sem = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    bar = None
    if progress:
        from tqdm import tqdm

        total = sum(replayed_turns(r, max_turns) for r in rows)
        bar = tqdm(total=total, desc="replay turns", unit="turn", file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(row: dict[str, Any], start_at: float) -> None:
            delay = start_at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                served = await replay_conversation(client, url, model, row, max_tokens=max_tokens,
                                                   max_turns=max_turns, temperature=temperature, stats=stats,
                                                   headers=headers, tick=(lambda: bar.update(1)) if bar else None)
            if transcripts is not None and any(m["role"] == "assistant" for m in served):
                transcripts.append(to_row(row, served))

        starts, at = [], 0.0
        for _ in rows:
            starts.append(at)
            if rate > 0:
                at += rng.expovariate(rate)
        await asyncio.gather(*(one(r, s) for r, s in zip(rows, starts)))
    if bar:
        bar.close()
    stats.seconds = round(time.perf_counter() - t0, 2)
    return stats


def to_row(row: dict[str, Any], served: list[dict[str, str]]) -> dict[str, Any]:
    """A ShareGPT row of the conversation as served: the users' turns and the served model's answers,
    up to its last answer."""
    last = max(i for i, m in enumerate(served) if m["role"] == "assistant")
    who = {"user": "human", "assistant": "gpt", "system": "system", "tool": "human"}
    return {"id": row.get("id"), "conversations": [{"from": who[m["role"]], "value": m["content"]}
                                                   for m in served[: last + 1]]}


def replay(url: str, model: str, rows: Iterable[dict[str, Any]], *, max_tokens: int = 128,
           max_turns: int | None = None, concurrency: int = 4, rate: float = 0.0, seed: int = 0,
           temperature: float = 0.0, progress: bool = True, headers: dict[str, str] | None = None,
           transcripts: list | None = None) -> ReplayStats:
    """Replay ShareGPT ``rows`` (``{"conversations": [...]}``) against ``url``; returns the counts.

    ``transcripts``, when given, receives each conversation as served (:func:`to_row`): what the
    endpoint's capture would hold, on-policy training data for the served model.
    """
    return asyncio.run(_replay(url, model, list(rows), max_tokens=max_tokens, max_turns=max_turns,
                               concurrency=concurrency, rate=rate, seed=seed, temperature=temperature,
                               progress=progress, headers=headers, transcripts=transcripts))
