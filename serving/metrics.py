"""Read vLLM's Prometheus ``/metrics`` and turn spec-decode counters into acceptance figures.

vLLM exports cumulative counters; acceptance over an interval is the delta of two
snapshots. Mean acceptance length is ``1 + accepted / drafts`` (the bonus token
counts, as in vLLM's own logging); acceptance at position ``i`` is
``accepted_per_pos[i] / drafts``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import httpx

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
GENERATION_TOKENS = "vllm:generation_tokens"

def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) samples of the text exposition format (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(smp.name, dict(smp.labels), float(smp.value))
            for fam in text_string_to_metric_families(text) for smp in fam.samples]


def _base(name: str) -> str:
    # prometheus_client exposes counters as ``name_total``; accept both spellings.
    return name[: -len("_total")] if name.endswith("_total") else name


@dataclass
class SpecSnapshot:
    """Cumulative spec-decode counters of one replica at one instant."""

    t: float
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: list[float] = field(default_factory=list)
    generation_tokens: float = 0.0

    @classmethod
    def from_text(cls, text: str, t: float | None = None) -> "SpecSnapshot":
        snap = cls(t=time.time() if t is None else t)
        pos: dict[int, float] = {}
        for name, labels, value in parse_prometheus(text):
            base = _base(name)
            if name.endswith("_created"):
                continue
            if base == NUM_DRAFTS:
                snap.drafts += value
            elif base == NUM_DRAFT_TOKENS:
                snap.draft_tokens += value
            elif base == NUM_ACCEPTED:
                snap.accepted += value
            elif base == ACCEPTED_PER_POS:
                p = int(labels.get("position", "0"))
                pos[p] = pos.get(p, 0.0) + value
            elif base == GENERATION_TOKENS:
                snap.generation_tokens += value
        snap.per_pos = [pos[i] for i in sorted(pos)]
        return snap

    def minus(self, older: "SpecSnapshot") -> "SpecDelta":
        n = max(len(self.per_pos), len(older.per_pos))
        a = self.per_pos + [0.0] * (n - len(self.per_pos))
        b = older.per_pos + [0.0] * (n - len(older.per_pos))
        return SpecDelta(
            seconds=self.t - older.t,
            drafts=self.drafts - older.drafts,
            draft_tokens=self.draft_tokens - older.draft_tokens,
            accepted=self.accepted - older.accepted,
            per_pos=[x - y for x, y in zip(a, b)],
            generation_tokens=self.generation_tokens - older.generation_tokens,
        )


@dataclass
class SpecDelta:
    """Spec-decode counters over an interval, with the derived acceptance figures."""

    seconds: float
    drafts: float
    draft_tokens: float
    accepted: float
    per_pos: list[float]
    generation_tokens: float = 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts > 0 else math.nan

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens > 0 else math.nan

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [x / self.drafts if self.drafts > 0 else math.nan for x in self.per_pos]

    def to_json(self) -> dict:
        def clean(x: float) -> float | None:
            return None if isinstance(x, float) and math.isnan(x) else x

        return {
            "seconds": self.seconds,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "accepted_per_pos": self.per_pos,
            "mean_acceptance_length": clean(self.mean_acceptance_length),
            "acceptance_rate": clean(self.acceptance_rate),
            "acceptance_per_pos": [clean(x) for x in self.acceptance_per_pos],
        }


def fetch_snapshot(url: str, timeout: float = 5.0) -> SpecSnapshot:
    """GET ``{url}/metrics`` of one vLLM replica (synchronous)."""
    r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout)
    r.raise_for_status()
    return SpecSnapshot.from_text(r.text)


# A snapshot that a measurement depends on (a bench block, a swap's smoke check) waits this
# long: on a loaded CPU host /metrics can take seconds to answer. Polling keeps the short default.
MEASURE_TIMEOUT = 60.0


async def afetch_snapshot(client: httpx.AsyncClient, url: str, timeout: float = 5.0,
                          headers: dict[str, str] | None = None) -> SpecSnapshot:
    r = await client.get(url.rstrip("/") + "/metrics", timeout=timeout, headers=headers)
    r.raise_for_status()
    return SpecSnapshot.from_text(r.text)
