"""benchmarks/demo_memory.py: the process-tree sampler, its attribution to components and the demo's phases."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("demo_memory", REPO_ROOT / "benchmarks" / "demo_memory.py")
dm = importlib.util.module_from_spec(spec)
sys.modules["demo_memory"] = dm  # its dataclasses look their module up
spec.loader.exec_module(dm)

VLLM = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "/t"]
SPEC = ["--speculative-config", "{}"]


def fake_proc(root: Path, procs: list[tuple[int, int, str, list[str], int]]) -> Path:
    """A /proc with (pid, ppid, comm, argv, PSS KiB) processes."""
    for pid, ppid, comm, argv, kib in procs:
        d = root / str(pid)
        d.mkdir(parents=True)
        # comm with a space and a parenthesis, as real ones may have
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
        (d / "smaps_rollup").write_text(f"00400000-7ff ---p 00000000 00:00 0  [rollup]\nRss: {kib * 2} kB\n"
                                        f"Pss:  {kib} kB\nPss_Anon: 1 kB\n")
    (root / "self").mkdir()  # not a process
    return root


TREE = [
    (10, 1, "python", ["python", "-m", "app", "demo", "--json"], 1000),
    (11, 10, "python", ["python", "-m", "serving.embedded", "--port", "8001", "--", *VLLM, *SPEC], 300),
    (12, 11, "VLLM::EngineCore", ["VLLM::EngineCore"], 2000),
    (13, 12, "pt_main (x)", ["python", "-c", "from multiprocessing.spawn import spawn_main"], 50),
    (21, 10, "python", ["python", "-m", "serving.embedded", "--", *VLLM, *SPEC, "--no-enable-prefix-caching"], 400),
    (22, 21, "python", ["python", "-m", "serving.embedded", "--", *VLLM, *SPEC, "--no-enable-prefix-caching"], 2100),
    (31, 10, "python", ["python", "-m", "serving.embedded", "--", *VLLM, "--no-enable-prefix-caching"], 500),
    (32, 31, "VLLM::EngineCore", ["VLLM::EngineCore"], 1900),
    (40, 10, "python", ["python", "-m", "loop.step_worker", "train", "/state/c1"], 4000),
    (41, 40, "python", ["python", "-c", "from multiprocessing.resource_tracker import main"], 10),
    (50, 10, "python", ["python", "-m", "mlflow", "server", "--port", "5000"], 200),
    (51, 50, "uvicorn", ["python", "-m", "uvicorn", "mlflow.server:app"], 150),
    (60, 10, "weed", ["/usr/bin/weed", "mini"], 70),
    (99, 1, "python", ["python", "-m", "serving.embedded", "--", *VLLM], 9999),  # not the demo's
]


def test_attribution_of_a_demo_tree(tmp_path):
    proc = fake_proc(tmp_path, TREE)
    tree = dm.descendants(10, proc)
    assert [p.pid for p in tree][0] == 10 and 99 not in {p.pid for p in tree}
    assert next(p for p in tree if p.pid == 13).comm == "pt_main (x)"
    comp = dm.attribute(tree, 10)
    assert comp == {10: "demo", 11: "engine:pool:agent", 12: "engine:pool:core", 13: "engine:pool:worker",
                    21: "engine:bench:agent", 22: "engine:bench:core",  # a forked core keeps its parent's argv
                    31: "engine:nospec:agent", 32: "engine:nospec:core", 40: "trainer", 41: "trainer",
                    50: "mlflow", 51: "mlflow", 60: "other:weed"}
    parts = dm.sample(10, proc)
    assert parts["trainer"] == 4010 and parts["mlflow"] == 350 and parts["engine:pool:core"] == 2000
    assert sum(parts.values()) == sum(kib for pid, _, _, _, kib in TREE if pid != 99)


def test_peaks_per_component_and_the_phase_of_the_sums_peak():
    p = dm.Peaks()
    p.add(0.0, "setup", {"demo": 1000, "engine:pool:core": 2000})
    p.add(1.0, "bootstrap / train", {"demo": 1000, "engine:pool:core": 2500, "trainer": 5000})
    p.add(2.0, "bootstrap / bench", {"demo": 3000, "engine:pool:core": 2400})
    j = p.to_json()
    assert j["peak_phase"] == "bootstrap / train" and j["peak_gb"] == round(8500 * 1024 / 1e9, 2)
    assert j["component_peak_gb"]["demo"]["phase"] == "bootstrap / bench"
    assert j["component_peak_gb"]["engine:pool:core"]["phase"] == "bootstrap / train"
    assert list(j["at_peak_gb"]) == ["trainer", "engine:pool:core", "demo"]
    assert j["phase_peak_gb"]["setup"] == round(3000 * 1024 / 1e9, 2)
    assert "bootstrap / train" in dm.render(j)


def test_phase_follows_the_demos_progress_lines():
    ph = dm.Phase()
    for line, want in [
        ("[demo     1.0s] setup: target model x\n", "setup"),
        ("some library's warning\n", "setup"),
        ("[demo    50.0s] general chat (held-out period): 12/12 turns answered\n", "general chat"),
        ("[demo    90.0s] bootstrap: bootstrap from general chat: ingested {}\n", "bootstrap"),
        ("[demo    91.0s]   cycle c20261127T000000Z: train (4/10)\n", "bootstrap / train"),
        ("[demo    95.0s]   bench attempt 1 of at most 2\n", "bootstrap / train"),
        ("[demo    96.0s]   cycle c20261127T000000Z: bench (6/10)\n", "bootstrap / bench"),
        ("[demo   300.0s] hot-swapping the pool to version 1 while nightly general chat replays\n",
         "hot-swapping the pool to"),
    ]:
        ph.feed(line)
        assert str(ph) == want


def test_a_real_process_tree(tmp_path):
    """Real /proc: a parent holding ~60 MB and a child 'trainer' holding ~120 MB, both counted."""
    hold = "import sys, time; b = bytearray({n} * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(30)"
    child = [sys.executable, "-c", hold.format(n=120), "loop.step_worker", "train"]
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess; p = subprocess.Popen({child!r}); " + hold.format(n=60)])
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            parts = dm.sample(parent.pid)
            if parts.get("trainer", 0) > 110 * 1024 and parts.get("demo", 0) > 55 * 1024:
                break
            time.sleep(0.2)
        assert parts.get("trainer", 0) > 110 * 1024 and parts.get("demo", 0) > 55 * 1024, parts
        n = iter(range(3))
        peaks = dm.sample_until(parent.pid, lambda: next(n, None) is None, lambda: "phase", interval=0.01)
        assert peaks.samples == 3 and peaks.component_kib["trainer"] > 110 * 1024
    finally:
        for pid in [p.pid for p in dm.descendants(parent.pid)][::-1]:
            subprocess.run(["kill", str(pid)], check=False)
        parent.wait(10)


@pytest.mark.parametrize("argv,role", [([*VLLM], "nospec"), ([*VLLM, *SPEC], "pool"),
                                       ([*VLLM, *SPEC, "--no-enable-prefix-caching"], "bench")])
def test_engine_roles(argv, role):
    assert dm.engine_role(argv) == role
