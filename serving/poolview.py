"""One view of the pool across router processes: the state the parent pushes, what workers report back.

With ``[serving] router_workers`` > 1 (``serving.workers``), the pool manager (health checks, crash
restarts, the swap controller, the admin API) stays in the ``adapt serve`` process; the router
workers forward requests. The parent pushes a :class:`PoolState` (membership, health, draining, the
pool's head) to every worker whenever it changes, numbered by a generation; a worker applies it to its
own :class:`~serving.pool.Pool` of routing state (:func:`apply`) and routes on it. Workers send back a
:class:`WorkerReport`: per replica, the requests they have in flight, served and failed, the replicas
they saw refuse or drop a request (the parent takes such a replica out of rotation for everyone, as
the single-process router does, until its health check says otherwise), their capture counters, and
the last generation they applied.

:class:`SharedPool` is the parent's pool: its counters are the workers' sums, and a drain is done when
every worker has applied the draining state and none has a request in flight on the replica (a
worker that had not seen the drain yet could still send it one).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from serving.pool import Pool, Replica


@dataclass(frozen=True)
class ReplicaView:
    url: str
    healthy: bool
    draining: bool
    agent_token: str | None = None


@dataclass(frozen=True)
class PoolState:
    gen: int
    replicas: tuple[ReplicaView, ...]
    current_head: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"gen": self.gen, "replicas": [asdict(r) for r in self.replicas], "current_head": self.current_head}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PoolState":
        return cls(int(d["gen"]), tuple(ReplicaView(**r) for r in d["replicas"]), dict(d.get("current_head") or {}))


def views(pool: Pool) -> tuple[ReplicaView, ...]:
    return tuple(ReplicaView(r.url, r.healthy, r.draining, r.agent_token) for r in pool.replicas)


def apply(pool: Pool, state: PoolState) -> None:
    """Make a worker's routing pool match ``state``: replicas added or removed as listed, health and
    draining as the parent sees them; the worker's own counters (in flight, served, failed) kept."""
    have = {r.url: r for r in pool.replicas}
    keep: list[Replica] = []
    for v in state.replicas:
        r = have.get(v.url)
        if r is None or r.agent_token != v.agent_token:
            r = Replica(url=v.url, agent_token=v.agent_token, verify=pool.verify)
            if v.url in have:  # the same address, another agent: in-flight counts stay with the requests
                r.outstanding = have[v.url].outstanding
        r.healthy, r.draining = v.healthy, v.draining
        keep.append(r)
    pool.replicas = keep
    pool.current_head = dict(state.current_head)


@dataclass(frozen=True)
class ReplicaCounts:
    outstanding: int = 0
    served: int = 0
    failures: int = 0


@dataclass(frozen=True)
class WorkerReport:
    gen: int  # the last PoolState generation this worker applied
    replicas: dict[str, ReplicaCounts]
    down: dict[str, str]  # replica -> why, for replicas this worker took out of rotation since that state
    capture: dict[str, int]
    capture_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"gen": self.gen, "replicas": {u: asdict(c) for u, c in self.replicas.items()}, "down": self.down,
                "capture": self.capture, "capture_error": self.capture_error}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "WorkerReport":
        return cls(int(d["gen"]), {u: ReplicaCounts(**c) for u, c in d["replicas"].items()}, dict(d["down"]),
                   {k: int(v) for k, v in d["capture"].items()}, d.get("capture_error"))


def report(pool: Pool, gen: int, state: PoolState | None, capture: dict[str, int], capture_error: str | None) -> WorkerReport:
    """A worker's report: its counters, and the replicas it marked down that ``state`` has healthy."""
    healthy = {v.url for v in state.replicas if v.healthy} if state is not None else set()
    return WorkerReport(gen, {r.url: ReplicaCounts(r.outstanding, r.served, r.failures) for r in pool.replicas},
                        {r.url: r.last_error or "down" for r in pool.replicas if not r.healthy and r.url in healthy},
                        dict(capture), capture_error)


class SharedPool(Pool):
    """The parent's pool when router workers route: counters summed from the workers' reports
    (:meth:`take_report`), state pushed through :attr:`publish` (set by ``serving.workers``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.reports: dict[int, WorkerReport] = {}  # live workers' last reports, by slot
        self.retired: dict[str, ReplicaCounts] = {}  # served/failed by workers that are gone
        self.retired_capture: dict[str, int] = {}  # their capture counters
        self.gen = 0
        self._last: tuple[tuple[ReplicaView, ...], str] | None = None
        self.publish: Any = None  # callable(PoolState) -> None, set by the workers' supervisor
        self.live_slots: Any = lambda: set(self.reports)

    # -- state out ---------------------------------------------------------------

    def state(self) -> PoolState:
        return PoolState(self.gen, views(self), dict(self.current_head))

    def push_if_changed(self, force: bool = False) -> int:
        """Bump the generation and push the state if it differs from the last pushed; the generation."""
        key = (views(self), repr(sorted(self.current_head.items())))
        if force or key != self._last:
            self._last = key
            self.gen += 1
            if self.publish is not None:
                self.publish(self.state())
        return self.gen

    # -- reports in --------------------------------------------------------------

    def take_report(self, slot: int, rep: WorkerReport) -> None:
        self.reports[slot] = rep
        for url, why in rep.down.items():
            try:
                r = self.get(url)
            except KeyError:
                continue
            if r.healthy:  # as the single-process router does: out until the health check says otherwise
                r.healthy = False
                r.last_error = why
        self._sum()
        self.push_if_changed()

    def worker_gone(self, slot: int) -> None:
        rep = self.reports.pop(slot, None)
        if rep is not None:
            for url, c in rep.replicas.items():
                old = self.retired.get(url, ReplicaCounts())
                self.retired[url] = ReplicaCounts(0, old.served + c.served, old.failures + c.failures)
            for k, v in rep.capture.items():
                self.retired_capture[k] = self.retired_capture.get(k, 0) + v
        self._sum()

    def _sum(self) -> None:
        for r in self.replicas:
            cs = [rep.replicas[r.url] for rep in self.reports.values() if r.url in rep.replicas]
            old = self.retired.get(r.url, ReplicaCounts())
            r.outstanding = sum(c.outstanding for c in cs)
            r.served = old.served + sum(c.served for c in cs)
            r.failures = old.failures + sum(c.failures for c in cs)

    def capture_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rep in self.reports.values():
            for k, v in rep.capture.items():
                out[k] = out.get(k, 0) + v
        for k, v in self.retired_capture.items():
            out[k] = out.get(k, 0) + v
        return out

    # -- drain across workers ----------------------------------------------------

    async def drain(self, url: str, timeout: float = 120.0) -> bool:
        """Stop routing to ``url`` in every worker and wait until none has a request in flight on it."""
        r = self.get(url)
        r.draining = True
        gen = self.push_if_changed(force=True)
        deadline = time.monotonic() + timeout
        while True:
            seen = all(slot in self.reports and self.reports[slot].gen >= gen for slot in self.live_slots())
            if seen and r.outstanding == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)

    def undrain(self, url: str) -> None:
        super().undrain(url)
        self.push_if_changed()
