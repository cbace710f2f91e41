"""What a process start costs with and without compiled bytecode, side by side in one run.

    python benchmarks/imports.py [--rounds 3]

Each row imports what one kind of the project's processes imports (a vLLM replica, a trainer, an
ingest worker, the Airflow scheduler's DAG parse) in a fresh interpreter of this environment,
twice: as the environment is (scripts/env.sh builds it with ``uv pip sync --compile-bytecode``,
the images too), and with Python sent to a bytecode cache that holds the standard library's only
and may not be written to (``-X pycache_prefix`` + ``PYTHONDONTWRITEBYTECODE``): the installed
packages without their bytecode, which is what every start costs where it was not built in and
cannot be written (a read-only image, a non-root user over a root install, a shell exporting
``PYTHONDONTWRITEBYTECODE``). CPU seconds (user + system) of the child, median of the rounds,
the two modes alternated.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile

PROCESSES = {
    "vLLM replica (vllm, vllm.entrypoints.openai.api_server)": "import vllm, vllm.entrypoints.openai.api_server",
    "trainer (torch, transformers, adapt.train)": "import torch, transformers, adapt.train",
    "ingest worker (capture.ingest)": "import capture.ingest, capture.batchpath",
    "Airflow DAG parse (airflow, dags)": "import airflow.sdk, loop.cycle",
}


def cpu_of(code: str, env: dict[str, str], extra: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, *extra, "-c", code], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = dict(os.environ)
    cold_env = env | {"PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory() as empty:
        # The standard library's bytecode into the cache (an interpreter ships with it).
        subprocess.run([sys.executable, "-X", f"pycache_prefix={empty}", "-m", "compileall", "-q", "-j", "0",
                        sysconfig.get_paths()["stdlib"]], check=False, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        print(f"{'process':58} {'bytecode':>9} {'none':>9} {'ratio':>6}   (CPU s, median of {args.rounds})")
        for name, code in PROCESSES.items():
            cpu_of(code, env, [])  # anything left to write is written once, outside the timing
            warm, cold = [], []
            for _ in range(args.rounds):
                warm.append(cpu_of(code, env, []))
                cold.append(cpu_of(code, cold_env, ["-X", f"pycache_prefix={empty}"]))
            w, c = statistics.median(warm), statistics.median(cold)
            print(f"{name:58} {w:9.2f} {c:9.2f} {c / w:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
