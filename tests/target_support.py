"""Traffic a tiny target answered itself, and greedy serving of it, for the tests that train and serve a head."""

from __future__ import annotations

import asyncio
import random
from contextlib import contextmanager
from pathlib import Path

import httpx

from adapt.hidden_states import TargetRunner
from serving.metrics import SpecDelta, SpecSnapshot

WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from "
         "def return import class self print while if else json tool call function name value list").split()


def self_answered(runner: TargetRunner, n: int, seed: int, max_new: int = 48) -> list[dict]:
    """``n`` one-turn ShareGPT rows whose answers the target generated greedily."""
    rng = random.Random(seed)
    eos = runner.tokenizer.eos_token_id
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        row = {"content_hash": f"self-{seed}-{i}", "conversations": [{"from": "human", "value": q}]}
        out = runner.greedy(runner.prompt_ids(row), max_new, stop_ids=(eos,))
        row["conversations"].append({"from": "gpt", "value": runner.tokenizer.decode(out, skip_special_tokens=True)})
        rows.append(row)
    return rows


def serve_greedy(server, prompts: list[list[int]], max_new: int,
                 model: str = "target") -> tuple[list[list[int]], SpecDelta]:
    """Each prompt's greedy completion (token ids, ``max_new`` of them) from one replica (anything with
    a ``url``) serving as ``model``, and the spec-decode counters those requests moved."""
    def counters() -> SpecSnapshot:
        return SpecSnapshot.from_text(httpx.get(server.url + "/metrics", timeout=60).text)

    before = counters()
    outs = []
    for p in prompts:
        r = httpx.post(server.url + "/v1/completions", timeout=180, json={
            "model": model, "prompt": p, "max_tokens": max_new, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        outs.append(r.json()["choices"][0]["token_ids"])
    return outs, counters().minus(before)


def qwen3_chat_model(model_cache) -> Path:
    """The tiny random Qwen3 carrying Qwen3's real tokenizer and chat template (built once, cached)."""
    from targets.model_zoo import build_tiny_qwen3_chat

    return build_tiny_qwen3_chat(model_cache / "tiny-qwen3-chat")


@contextmanager
def served_head(server, head: Path):
    """``server`` drafting with ``head``, swapped in place (the pool's own admin path), and back after.

    One engine start costs the suite minutes; a swap costs seconds. The replica itself reports the
    sha256 it serves."""
    from headspec.validate import validate_head

    def swap(to: Path) -> None:
        want = validate_head(to).sha256
        got = asyncio.run(server.admin.load_head(str(to), None, want))
        assert got["sha256"] == want, got

    swap(head)
    try:
        yield server
    finally:
        swap(server.first_head)
