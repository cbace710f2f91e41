"""Memory of the demo and everything it starts: the summed PSS of the process tree, per component and phase.

Runs ``python -m app demo --json`` (or samples a demo already running: ``--pid``), and every
``--interval`` seconds reads the PSS (``/proc/PID/smaps_rollup``: shared pages split between the
processes that map them, so the sum is what the tree really holds) of the demo and every
descendant. Each process is put to a component:

* ``engine:<role>:<part>``: a vLLM replica, by its role (``pool``, ``bench``, ``nospec``: the
  no-speculation reference) and its process (``agent`` = the API server the project's agent
  embeds, ``core`` = vLLM's engine core, ``worker`` = anything below it);
* ``trainer`` / ``evaluator``: a cycle's training or offline evaluation in its own process;
* ``mlflow``: an MLflow server and its workers;
* ``demo``: the demo's own process (router, capture, controller, and training/evaluation when
  they run in it);
* ``other``: anything else below the demo (named by its command).

It prints the peak of the sum, the peak of each component, the components at the moment of
the sum's peak and the demo's phase then (from its progress lines on stderr: the section and
the cycle step). ``--out DIR`` keeps ``memory.json`` (rewritten every ``--flush`` seconds, so a
run stopped early keeps what it saw), the demo's stderr and its report.

    python benchmarks/demo_memory.py [--out DIR] [--interval 1] [-- demo arguments...]
    python benchmarks/demo_memory.py --pid PID [--log DEMO_STDERR_FILE]

Run from fresh state (``ADAPT_STATE_DIR=$(mktemp -d)``) for the demo's real peak.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

REPO_ROOT = Path(__file__).resolve().parents[1]

# --- the process tree --------------------------------------------------------------------------


@dataclass
class Proc:
    pid: int
    ppid: int
    comm: str
    argv: list[str]


def read_proc(pid: int, proc: Path = Path("/proc")) -> Proc | None:
    """One process's parent, name and command line (None: it is gone or unreadable)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        argv = (proc / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    # comm is in parentheses and may itself hold spaces or parentheses: the last ')' ends it.
    comm = stat[stat.index("(") + 1:stat.rindex(")")]
    ppid = int(stat[stat.rindex(")") + 2:].split()[1])
    return Proc(pid, ppid, comm, [a.decode(errors="replace") for a in argv if a])


def descendants(root: int, proc: Path = Path("/proc")) -> list[Proc]:
    """``root`` and every process below it (one pass over /proc), parents before children."""
    procs: dict[int, Proc] = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            p = read_proc(int(d.name), proc)
            if p is not None:
                procs[p.pid] = p
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    if root not in procs:
        return []
    out, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(procs[pid])
        todo += sorted(children.get(pid, []))
    return out


def pss_kib(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's PSS in KiB (None: gone, or a kernel without smaps_rollup)."""
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:
        return None
    m = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) if m else None


# --- attribution --------------------------------------------------------------------------------


def engine_role(argv: list[str]) -> str:
    """``pool``/``bench``/``nospec`` of a replica's agent from its ``vllm serve`` line (serving.pool:
    the bench replicas keep no prefix cache; the reference has no speculative config)."""
    if "--speculative-config" not in argv:
        return "nospec"
    return "bench" if "--no-enable-prefix-caching" in argv else "pool"


def is_agent(argv: list[str]) -> bool:
    return "serving.embedded" in argv or any(a.endswith("vllm.entrypoints.openai.api_server") for a in argv)


# What a cycle step run in its own process carries on its command line (loop.cycle's step worker).
STEP_WORKER = "loop.step_worker"


def attribute(tree: list[Proc], root: int) -> dict[int, str]:
    """Each process's component (see the module's docstring); ``tree`` is parents before children."""
    out: dict[int, str] = {}
    for p in tree:
        parent = out.get(p.ppid)
        line = " ".join(p.argv)
        if p.pid == root:
            out[p.pid] = "demo"
        elif parent and parent.startswith("engine:"):  # before the agent's test: a forked child keeps its argv
            _, role, part = parent.split(":")
            out[p.pid] = f"engine:{role}:{'core' if part == 'agent' else 'worker'}"
        elif is_agent(p.argv):
            out[p.pid] = f"engine:{engine_role(p.argv)}:agent"
        elif STEP_WORKER in p.argv:
            i = p.argv.index(STEP_WORKER)
            step = p.argv[i + 1] if i + 1 < len(p.argv) else ""
            out[p.pid] = {"train": "trainer", "evaluate": "evaluator"}.get(step, f"step:{step}")
        elif parent in ("trainer", "evaluator", "mlflow") or (parent or "").startswith("step:"):
            out[p.pid] = parent
        elif "mlflow" in line:
            out[p.pid] = "mlflow"
        else:
            name = Path(p.argv[0]).name if p.argv else p.comm
            if name.startswith("python") and len(p.argv) > 2 and p.argv[1] == "-m":
                name = p.argv[2]
            out[p.pid] = f"other:{name}" if parent in (None, "demo") or parent.startswith("other") else parent
    return out


# --- the demo's phase, from its progress lines ----------------------------------------------------

_LINE = re.compile(r"^\[demo\s+[\d.]+s\] (.*)$")
_STEP = re.compile(r"^\s+cycle \S+: (\w+) \(\d+/\d+\)")


class Phase:
    """The demo's current section (``setup``, ``general chat``, ``bootstrap``, ...) and cycle step."""

    def __init__(self) -> None:
        self.section = "start"
        self.step: str | None = None

    def feed(self, line: str) -> None:
        m = _LINE.match(line.rstrip("\n"))
        if not m:
            return
        msg = m.group(1)
        s = _STEP.match(msg)
        if s:
            self.step = s.group(1)
            return
        if msg.startswith(" "):  # other progress of the step (bench attempts, ...)
            return
        section = msg.split(":", 1)[0] if ":" in msg[:60] else " ".join(msg.split()[:4])
        section = re.sub(r" \((pass \d+|held-out period)\)$", "", section)
        if section != self.section:
            self.section, self.step = section, None

    def __str__(self) -> str:
        return self.section + (f" / {self.step}" if self.step else "")


# --- sampling --------------------------------------------------------------------------------------


@dataclass
class Peaks:
    """What the samples saw: the sum's peak (with its breakdown and phase), each component's peak."""

    samples: int = 0
    peak_kib: int = 0
    peak_at_s: float = 0.0
    peak_phase: str = ""
    peak_parts: dict[str, int] = field(default_factory=dict)
    component_kib: dict[str, int] = field(default_factory=dict)
    component_phase: dict[str, str] = field(default_factory=dict)
    phase_peak_kib: dict[str, int] = field(default_factory=dict)

    def add(self, t: float, phase: str, parts: dict[str, int]) -> None:
        total = sum(parts.values())
        self.samples += 1
        if total > self.peak_kib:
            self.peak_kib, self.peak_at_s, self.peak_phase, self.peak_parts = total, t, phase, dict(parts)
        for c, kib in parts.items():
            if kib > self.component_kib.get(c, 0):
                self.component_kib[c], self.component_phase[c] = kib, phase
        self.phase_peak_kib[phase] = max(self.phase_peak_kib.get(phase, 0), total)

    def to_json(self) -> dict:
        gb = lambda kib: round(kib * 1024 / 1e9, 2)  # noqa: E731 - GB as docs/benchmarks.md writes them
        return {"samples": self.samples, "peak_gb": gb(self.peak_kib), "peak_at_s": round(self.peak_at_s, 1),
                "peak_phase": self.peak_phase,
                "at_peak_gb": {c: gb(k) for c, k in sorted(self.peak_parts.items(), key=lambda x: -x[1])},
                "component_peak_gb": {c: {"gb": gb(k), "phase": self.component_phase[c]}
                                      for c, k in sorted(self.component_kib.items(), key=lambda x: -x[1])},
                "phase_peak_gb": {p: gb(k) for p, k in self.phase_peak_kib.items()}}


def sample(root: int, proc: Path = Path("/proc")) -> dict[str, int]:
    """One sample: KiB of PSS per component of ``root``'s tree (processes gone meanwhile count 0)."""
    tree = descendants(root, proc)
    comp = attribute(tree, root)
    parts: dict[str, int] = {}
    for p in tree:
        kib = pss_kib(p.pid, proc)
        if kib:
            parts[comp[p.pid]] = parts.get(comp[p.pid], 0) + kib
    return parts


def sample_until(root: int, done: Callable[[], bool], phase: Callable[[], str], interval: float = 1.0,
                 flush: Callable[[Peaks], None] | None = None, flush_every: float = 30.0,
                 proc: Path = Path("/proc")) -> Peaks:
    """Sample ``root``'s tree every ``interval`` s until ``done()`` or the tree is gone."""
    peaks, t0, last_flush = Peaks(), time.monotonic(), time.monotonic()
    while not done():
        parts = sample(root, proc)
        if not parts:
            break
        peaks.add(time.monotonic() - t0, phase(), parts)
        if flush and time.monotonic() - last_flush >= flush_every:
            flush(peaks)
            last_flush = time.monotonic()
        time.sleep(interval)
    return peaks


def render(p: dict) -> str:
    lines = [f"peak of the summed PSS: {p['peak_gb']:.2f} GB at {p['peak_at_s']:.0f}s, in phase "
             f"'{p['peak_phase']}' ({p['samples']} samples)", "at that peak:"]
    lines += [f"  {c:<24} {gb:6.2f} GB" for c, gb in p["at_peak_gb"].items()]
    lines.append("each component's own peak:")
    lines += [f"  {c:<24} {v['gb']:6.2f} GB  in '{v['phase']}'" for c, v in p["component_peak_gb"].items()]
    lines.append("peak of the sum per phase:")
    lines += [f"  {ph:<48} {gb:6.2f} GB" for ph, gb in p["phase_peak_gb"].items()]
    return "\n".join(lines)


def _follow(lines: Iterable[str], phase: Phase, sink=None) -> None:
    for line in lines:
        if sink is not None:
            sink.write(line)
            sink.flush()
        phase.feed(line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="directory for memory.json, the demo's stderr and report")
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--flush", type=float, default=30.0, help="seconds between rewrites of memory.json")
    ap.add_argument("--pid", type=int, default=None, help="sample this running demo instead of starting one")
    ap.add_argument("--log", type=Path, default=None, help="with --pid: the demo's stderr file (for its phases)")
    ap.add_argument("demo_args", nargs="*", help="arguments of `adapt demo` (after --)")
    args = ap.parse_args(argv)
    out = args.out or Path(os.environ.get("TMPDIR", "/tmp")) / f"demo-memory-{time.strftime('%Y%m%dT%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    phase = Phase()

    def flush(peaks: Peaks) -> None:
        tmp = out / ".memory.json.tmp"
        tmp.write_text(json.dumps(peaks.to_json(), indent=1))
        os.replace(tmp, out / "memory.json")

    if args.pid is not None:
        root, proc = args.pid, None
        if args.log:
            def tail() -> None:
                with open(args.log, errors="replace") as f:
                    while True:
                        line = f.readline()
                        if line:
                            phase.feed(line)
                        else:
                            time.sleep(0.5)
            threading.Thread(target=tail, daemon=True).start()
        done = lambda: False  # noqa: E731 - until the tree is gone
    else:
        cmd = [sys.executable, "-m", "app", "demo", "--json", *args.demo_args]
        report = open(out / "report.json", "w")
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=report, stderr=subprocess.PIPE, text=True, bufsize=1)
        root = proc.pid
        log = open(out / "demo.stderr", "w")
        threading.Thread(target=_follow, args=(proc.stderr, phase, log), daemon=True).start()
        done = lambda: proc.poll() is not None  # noqa: E731
    sys.stderr.write(f"sampling the demo (pid {root}) every {args.interval}s; files in {out}\n")
    peaks = sample_until(root, done, lambda: str(phase), args.interval, flush, args.flush)
    flush(peaks)
    result = peaks.to_json()
    if proc is not None:
        rc = proc.wait()
        result["demo_exit_code"] = rc
        try:
            rep = json.loads((out / "report.json").read_text())
            result["demo"] = {k: rep.get(k) for k in ("shown", "requests_failed", "total_seconds")}
        except (OSError, ValueError):
            result["demo"] = None
        (out / "memory.json").write_text(json.dumps(result, indent=1))
    print(render(result))
    if result.get("demo"):
        print(f"demo: {json.dumps(result['demo'])}")
    return 0 if proc is None or result.get("demo_exit_code") == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
