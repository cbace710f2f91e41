"""Synthetic Data Capture traffic in every supported format (tests, demos, the ingest benchmark).

The shapes follow the documented wire formats: OpenAI chat/completions (plain and
SSE-streamed), TGI/LMI ``{"inputs": str}`` → ``{"generated_text"}``, JumpStart chat
``{"inputs": [[...]]}`` → BASE64 ``[{"generation": {...}}]``, plus tabular CSV that an
LLM reader must skip.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

from capture.records import make_capture_record

_WORDS = (
    "the model request latency token cache decode speculative draft head layer batch throughput queue "
    "python function returns list value error retry timeout network service endpoint region bucket data "
    "summarize explain translate compare write code test review plan design schema table query index join "
    "customer order invoice refund shipping product price discount account password email support ticket "
    "weather travel recipe history science music movie book sport health budget report meeting project"
).split()

FORMATS = ("openai_chat", "openai_chat_stream", "openai_completion", "tgi", "jumpstart_chat", "tabular_csv")
DEFAULT_MIX = (0.40, 0.15, 0.10, 0.15, 0.15, 0.05)


def _text(rng: random.Random, mean_words: int) -> str:
    n = max(3, int(rng.lognormvariate(0, 0.6) * mean_words))
    return " ".join(rng.choices(_WORDS, k=n)).capitalize() + "."


class TextPool:
    """Pre-made sentences so that millions of records cost string joins, not random draws per word."""

    def __init__(self, rng: random.Random, size: int = 4096) -> None:
        self.rng = rng
        self.prompts = [_text(rng, 30) for _ in range(size)]
        self.answers = [_text(rng, 80) for _ in range(size)]

    def prompt(self, uid: int) -> str:
        # The uid keeps synthetic conversations distinct, as real traffic mostly is.
        return f"[{uid}] " + self.rng.choice(self.prompts)

    def answer(self) -> str:
        return self.rng.choice(self.answers)


def _sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def exchange(fmt: str, pool: TextPool, uid: int) -> dict:
    """Keyword arguments for :func:`capture.records.make_capture_record` for one exchange of ``fmt``."""
    rng = pool.rng
    prompt, answer = pool.prompt(uid), pool.answer()
    temp = round(rng.choice((0.0, 0.2, 0.7, 1.0)), 2)
    if fmt == "openai_chat":
        req = {"model": "smollm2", "messages": [{"role": "system", "content": "You are helpful."},
                                                {"role": "user", "content": prompt}],
               "temperature": temp, "top_p": 0.9, "max_tokens": 256}
        resp = {"id": f"chatcmpl-{uid}", "object": "chat.completion", "model": "smollm2",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]}
        return {"request": req, "response": resp}
    if fmt == "openai_chat_stream":
        req = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "stream": True,
               "temperature": temp, "max_tokens": 256}
        words = answer.split(" ")
        # Servers flush a few tokens per event; four words a chunk keeps the body realistic in size.
        pieces = [" ".join(words[i:i + 4]) for i in range(0, len(words), 4)]
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}], "model": "smollm2"}]
        chunks += [{"choices": [{"index": 0, "delta": {"content": (" " if i else "") + w}}], "model": "smollm2"}
                   for i, w in enumerate(pieces)]
        return {"request": req, "response": _sse(chunks), "response_content_type": "text/event-stream"}
    if fmt == "openai_completion":
        req = {"model": "smollm2", "prompt": prompt, "temperature": temp, "max_tokens": 128}
        resp = {"object": "text_completion", "model": "smollm2", "choices": [{"index": 0, "text": answer}]}
        return {"request": req, "response": resp}
    if fmt == "tgi":
        req = {"inputs": prompt, "parameters": {"max_new_tokens": 256, "temperature": temp, "top_p": 0.9}}
        return {"request": req, "response": [{"generated_text": answer}]}
    if fmt == "jumpstart_chat":
        req = {"inputs": [[{"role": "user", "content": prompt}]], "parameters": {"max_new_tokens": 256, "top_p": 0.9}}
        resp = [{"generation": {"role": "assistant", "content": answer}}]
        return {"request": req, "response": resp, "response_content_type": None, "response_encoding": "BASE64"}
    if fmt == "tabular_csv":
        row = ",".join(str(rng.randint(0, 300)) for _ in range(8))
        return {"request": row, "response": f"{rng.random():.6f}", "request_content_type": "text/csv",
                "response_content_type": "text/csv", "request_encoding": "CSV", "response_encoding": "CSV"}
    raise ValueError(f"unknown synthetic format {fmt!r}")


def lines(n: int, seed: int = 0, start: datetime | None = None, mix: tuple[float, ...] = DEFAULT_MIX,
          duplicate_rate: float = 0.02, pool: TextPool | None = None, uid0: int = 0) -> Iterator[str]:
    """``n`` capture lines, one second apart from ``start``; ``duplicate_rate`` of them replay an earlier prompt."""
    rng = random.Random(seed)
    pool = pool or TextPool(rng)
    start = start or datetime(2025, 1, 1, tzinfo=timezone.utc)
    recent: list[dict] = []
    for i in range(n):
        if recent and rng.random() < duplicate_rate:
            kw = rng.choice(recent)  # the same exchange served again later: an exact duplicate
        else:
            kw = exchange(rng.choices(FORMATS, weights=mix)[0], pool, uid0 + i)
            if len(recent) < 256:
                recent.append(kw)
            else:
                recent[rng.randrange(256)] = kw
        yield make_capture_record(event_id=f"evt-{seed}-{i}", inference_time=start + timedelta(seconds=i), **kw)


def write_layout(root: str | Path, n: int, *, endpoint: str = "ep", variant: str = "AllTraffic",
                 per_file: int = 1000, seed: int = 0, start: datetime | None = None,
                 duplicate_rate: float = 0.02) -> list[Path]:
    """Write ``n`` records as ``root/endpoint/variant/yyyy/mm/dd/hh/*.jsonl`` files of ``per_file`` lines."""
    root = Path(root)
    start = start or datetime(2025, 1, 1, tzinfo=timezone.utc)
    paths: list[Path] = []
    f = None
    rng = random.Random(seed)
    pool = TextPool(rng)
    for i, line in enumerate(lines(n, seed=seed, start=start, duplicate_rate=duplicate_rate, pool=pool)):
        if i % per_file == 0:
            if f:
                f.close()
            t = start + timedelta(seconds=i)
            d = root / endpoint / variant / t.strftime("%Y/%m/%d/%H")
            d.mkdir(parents=True, exist_ok=True)
            p = d / f"{t:%M-%S}-{seed:04d}-{i:09d}.jsonl"
            paths.append(p)
            f = open(p, "w", encoding="utf-8")
        f.write(line + "\n")
    if f:
        f.close()
    return paths
