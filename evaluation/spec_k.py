"""Which K (speculative tokens per step) pays at each batch size, from per-position acceptance and step costs.

A P-EAGLE head drafts its K positions in one pass, so serving it with fewer positions keeps the first
ones' acceptance: with ``acceptance_rate_per_pos`` as vLLM counts it (position i is accepted only when
every position before it was, per draft), a step that drafts k positions emits on average
``1 + sum(rate[:k])`` tokens. Its cost depends on the batch size: the target verifies ``1 + k`` tokens
per sequence (nearly free while a small batch is bound by reading the weights, dear once the batch
fills the device), and the drafter runs once. The best k maximises tokens per second of step time;
k = 0 is no speculation.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# seconds of one decoding step at (batch size, k); k = 0 is a plain decoding step
StepCost = Callable[[int, int], float]


@dataclass(frozen=True)
class KChoice:
    batch_size: int
    k: int
    tokens_per_step: float  # per sequence
    speedup: float  # tokens per second against no speculation at this batch size


def expected_tokens(rate_per_pos: Sequence[float], k: int) -> float:
    """Tokens one sequence gains per step when drafting ``k`` positions (the target's own token included)."""
    if k < 0 or k > len(rate_per_pos):
        raise ValueError(f"k={k}: the head measured {len(rate_per_pos)} positions")
    return 1.0 + sum(rate_per_pos[:k])


def table_cost(seconds: Mapping[tuple[int, int], float]) -> StepCost:
    """A :data:`StepCost` from measured step times keyed by (batch size, k)."""
    def cost(batch_size: int, k: int) -> float:
        try:
            return seconds[(batch_size, k)]
        except KeyError:
            raise KeyError(f"no measured step time for batch size {batch_size}, k={k}") from None
    return cost


def best_k(rate_per_pos: Sequence[float], cost: StepCost, batch_sizes: Sequence[int],
           max_k: int | None = None) -> list[KChoice]:
    """Per batch size, the k in 0..``max_k`` (default: every measured position) with the most tokens per
    second; ties go to the smaller k (less verification work for the same gain)."""
    top = len(rate_per_pos) if max_k is None else min(max_k, len(rate_per_pos))
    out = []
    for b in batch_sizes:
        base = cost(b, 0)
        if base <= 0:
            raise ValueError(f"step time at batch size {b}, k=0 is {base}: must be positive")
        rate = {k: expected_tokens(rate_per_pos, k) / cost(b, k) for k in range(top + 1)}
        k = max(rate, key=lambda kk: (rate[kk], -kk))
        out.append(KChoice(b, k, expected_tokens(rate_per_pos, k), rate[k] * base))
    return out


def per_batch_size_schedule(choices: Sequence[KChoice], last: int | None = None) -> list[tuple[int, int, int]]:
    """``[[first, last, k], ...]`` for ``[serving] num_speculative_tokens_per_batch_size``: each measured
    batch size's k holds from it up to the next measured one; the last range ends at ``last``
    (default: the largest measured batch size)."""
    rows: list[tuple[int, int, int]] = []
    cs = sorted(choices, key=lambda c: c.batch_size)
    for i, c in enumerate(cs):
        hi = cs[i + 1].batch_size - 1 if i + 1 < len(cs) else (last or c.batch_size)
        lo = 1 if i == 0 else c.batch_size
        if rows and rows[-1][2] == c.k:
            rows[-1] = (rows[-1][0], hi, c.k)
        else:
            rows.append((lo, hi, c.k))
    return rows


def parse_step_seconds(data: Mapping[str, float]) -> dict[tuple[int, int], float]:
    """``{"BxK": seconds}`` (as benchmarks/learning_curve.py writes ``k_choice.step_seconds``) -> ``{(B, K): seconds}``."""
    out = {}
    for key, s in data.items():
        b, _, k = key.partition("x")
        try:
            out[(int(b), int(k))] = float(s)
        except ValueError:
            raise ValueError(f"step time key {key!r}: expected BATCHxK, e.g. '8x2'") from None
    return out


def verification_cost(step_seconds: Mapping[tuple[int, int], float], head_layers: int,
                      target_layers: int) -> StepCost:
    """A :data:`StepCost` from the target's measured verification forwards (``(B, k)``: ``1 + k`` new tokens
    per sequence) plus the drafter's one pass over k positions, approximated as a target forward of the
    same tokens scaled by the head's share of the layers."""
    share = head_layers / target_layers

    def verify(b: int, k: int) -> float:
        # Verifying more tokens never costs less: a faster reading at a larger k is timing noise.
        try:
            return max(step_seconds[(b, j)] for j in range(k + 1))
        except KeyError:
            raise KeyError(f"no measured step time for batch size {b}, k<={k}") from None

    def cost(b: int, k: int) -> float:
        return verify(b, k) + (share * verify(b, k - 1) if k else 0.0)
    return cost


@dataclass(frozen=True)
class KProposal:
    """The K a head's measured acceptance supports at each batch size, and the serving setting that says so."""

    per_batch_size: list[KChoice]
    schedule: list[tuple[int, int, int]]  # [serving] num_speculative_tokens_per_batch_size

    def to_json(self) -> dict[str, Any]:
        return {"per_batch_size": [asdict(c) for c in self.per_batch_size],
                "schedule": [list(r) for r in self.schedule]}


def load_step_seconds(path: str | Path) -> dict[tuple[int, int], float]:
    """Measured step times from ``path``: ``{"BxK": seconds}``, or a benchmarks/learning_curve.py result
    (its ``k_choice.step_seconds``)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of step times")
    nested = data.get("k_choice")
    if isinstance(nested, dict) and isinstance(nested.get("step_seconds"), dict):
        data = nested["step_seconds"]
    seconds = parse_step_seconds(data)
    if not seconds:
        raise ValueError(f"{path}: no step times")
    return seconds


def propose(rate_per_pos: Sequence[float], step_seconds: Mapping[tuple[int, int], float], head_layers: int,
            target_layers: int) -> KProposal:
    """The best K at every measured batch size for a head with ``rate_per_pos``, and its schedule."""
    sizes = sorted({b for b, _ in step_seconds})
    choices = best_k(rate_per_pos, verification_cost(step_seconds, head_layers, target_layers), sizes)
    return KProposal(choices, per_batch_size_schedule(choices))


def propose_for_head(rate_per_pos: Sequence[float], step_times: str | Path, head_dir: str | Path,
                     target_dir: str | Path) -> KProposal:
    """:func:`propose` for the head in ``head_dir`` on the target in ``target_dir`` (their layer counts from
    their ``config.json``), from the step times in ``step_times`` (:func:`load_step_seconds`)."""
    head_layers = json.loads((Path(head_dir) / "config.json").read_text()).get("num_hidden_layers", 1)
    target_layers = json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"]
    return propose(rate_per_pos, load_step_seconds(step_times), head_layers, target_layers)
