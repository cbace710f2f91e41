"""Traffic a tiny target answered itself, for the tests that train and serve a head on it."""

from __future__ import annotations

import random

from adapt.hidden_states import TargetRunner

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
