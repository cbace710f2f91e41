"""Tokenized examples for the featurization tests: very different lengths, each with an assistant span."""

from __future__ import annotations

import random

import torch

from adapt.data import Example


def examples(n: int, seed: int = 0) -> list[Example]:
    """Examples of very different lengths (so buckets pad), each with an assistant span."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([5, 9, 23, 40, 71])
        ids = torch.tensor([rng.randrange(4, 500) for _ in range(length)])
        mask = torch.zeros(length, dtype=torch.bool)
        mask[rng.randrange(2, length - 1):] = True
        out.append(Example(ids, mask, f"e{seed}-{i}"))
    return out
