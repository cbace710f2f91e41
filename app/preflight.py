"""Before `adapt demo` starts anything: does this machine have the memory and the cores the demo needs?

A machine too small is told so, with what the demo needs and which setting lowers it, instead of
being stopped by the OOM killer halfway through a 20-minute run. The figures are the demo's
measured memory (``benchmarks/demo_memory.py``, docs/benchmarks.md "The demo"), in one place:
:data:`DEMO_MEMORY`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Set to 0 to skip the check (a machine whose memory limit /proc/meminfo does not show, or a
# smaller demo whose needs are known to be lower).
SKIP_ENV = "ADAPT_DEMO_PREFLIGHT"


@dataclass(frozen=True)
class DemoMemory:
    """Peak PSS of the demo's parts on the embedded default target (GB figures of docs/benchmarks.md,
    "Memory of the demo", taken as GiB: rounded up). The engines that live at once change with the
    phase: the pool's during training (the trainer beside them), the pool's and the bench's two at a
    benchmark (the trainer has ended). Per-component peaks of benchmarks/demo_memory.py replace them."""

    demo: float = 1.0  # the demo's own process: router, capture writer, controller, MLflow client
    # one vLLM-cpu replica (agent, engine core, worker): the upper end of 3.3-4.2 GB measured with 1 GiB of
    # KV cache, less the 0.5 GiB the demo's engines no longer allocate
    engine: float = 3.7
    trainer: float = 5.9  # a cycle's training process (the drift cycle's 150 steps, bounded oneDNN cache)
    bench_engines: int = 2  # the bench replica and the no-speculation reference
    margin: float = 0.5  # the sampler's 1 s steps miss short peaks; the kernel's own share

    def need_gib(self, pool_replicas: int) -> float:
        training = pool_replicas * self.engine + self.trainer
        bench = (pool_replicas + self.bench_engines) * self.engine
        return round(self.demo + max(training, bench) + self.margin, 1)


DEMO_MEMORY = DemoMemory()
# The pool, the bench and the trainer each take the two cores in turn; on one core every step
# takes twice as long and the timeouts sized for two start to fire.
DEMO_CORES = 2


class MachineTooSmall(RuntimeError):
    """The machine lacks the memory or the cores the demo needs; the message says what and how to lower it."""


def mem_available_gib(meminfo: Path = Path("/proc/meminfo")) -> float | None:
    """MemAvailable in GiB (None: not reported, e.g. not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check(pool_replicas: int, meminfo: Path = Path("/proc/meminfo"), cores: int | None = None,
          memory: DemoMemory = DEMO_MEMORY) -> None:
    """Raise :class:`MachineTooSmall` when free memory or cores fall short of the demo's needs."""
    if os.environ.get(SKIP_ENV, "1").strip() in ("0", "off", "false"):
        return
    need = memory.need_gib(pool_replicas)
    have = mem_available_gib(meminfo)
    cores = usable_cores() if cores is None else cores
    problems = []
    if have is not None and have < need:
        problems.append(
            f"it needs about {need:.1f} GiB of free memory and this machine has {have:.1f} GiB available "
            f"(MemAvailable). At its peak the demo holds {pool_replicas} pool replica(s) and the bench's "
            f"{memory.bench_engines} vLLM engines of about {memory.engine:.1f} GiB each, or the pool beside a "
            f"training process of about {memory.trainer:.1f} GiB. Close other programs, or lower [serving] "
            f"replicas (each pool replica is one engine)" + (" to 1" if pool_replicas > 1 else "")
            + "; each more replica adds " f"{memory.engine:.1f} GiB")
    if cores < DEMO_CORES:
        problems.append(f"it needs {DEMO_CORES} CPU cores and this process may use {cores}: the engines, the "
                        "router and the trainer share them, and on fewer the demo's timeouts fire")
    if problems:
        raise MachineTooSmall("adapt demo cannot run here: " + "; ".join(problems)
                              + f" (figures of the embedded default target; {SKIP_ENV}=0 skips this check)")
