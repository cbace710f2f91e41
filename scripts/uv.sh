# Source me: sets UV to a hash-checked uv (requirements/uv.txt), installed once under
# $DRAFTER_ADAPT_HOME/tools, and defines the helpers the environment scripts share.
#
# Every step runs through `_da_step`, which keeps the step's output in a log and, when the step
# fails, says which step failed, with what exit code, and shows the log's tail. No step's status
# depends on what it printed (no output filters in a pipeline).

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRAFTER_ADAPT_HOME="${DRAFTER_ADAPT_HOME:-$HOME/.cache/drafter-adapt}"
PYTHON_BIN="${PYTHON_BIN:-python3.11}"
command -v "$PYTHON_BIN" >/dev/null 2>&1 || PYTHON_BIN=python3

_da_step() {  # _da_step LOG DESCRIPTION CMD...: run CMD, output to LOG; on failure report and return its code
  local log="$1" what="$2" rc=0
  shift 2
  printf '\n$ %s\n' "$*" >>"$log"
  "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "[env] FAILED: $what (exit $rc): $*" >&2
    echo "[env] last lines of $log:" >&2
    tail -n 25 "$log" | sed 's/^/[env]   /' >&2
  fi
  return "$rc"
}

uv_find_links_args() {  # --find-links for uv from UV_FIND_LINKS or pip's configuration (uv reads no pip.conf)
  [ -n "${UV_FIND_LINKS:-}" ] && return 0  # uv reads UV_FIND_LINKS itself
  local links
  links="$("$PYTHON_BIN" -m pip config get global.find-links 2>/dev/null)" || links=""
  local l
  for l in $links; do printf -- '--find-links\n%s\n' "$l"; done
}

_da_uv_version="$(sed -n 's/^uv==\([0-9.]*\).*/\1/p' "$REPO_ROOT/requirements/uv.txt")"
_da_uv_home="$DRAFTER_ADAPT_HOME/tools/uv-$_da_uv_version"
UV="$_da_uv_home/bin/uv"

if [ ! -x "$UV" ]; then
  mkdir -p "$DRAFTER_ADAPT_HOME/tools"
  _da_uv_log="$DRAFTER_ADAPT_HOME/tools/uv-$_da_uv_version.log"
  : >"$_da_uv_log"
  echo "[env] installing uv $_da_uv_version into $_da_uv_home" >&2
  rm -rf "$_da_uv_home.tmp"
  if ! { _da_step "$_da_uv_log" "create the uv tool environment" "$PYTHON_BIN" -m venv "$_da_uv_home.tmp" \
       && _da_step "$_da_uv_log" "install uv (hash-checked)" "$_da_uv_home.tmp/bin/python" -m pip install \
            --disable-pip-version-check --no-input --quiet --require-hashes --only-binary=:all: \
            -r "$REPO_ROOT/requirements/uv.txt"; }; then
    rm -rf "$_da_uv_home.tmp"
    return 1 2>/dev/null || exit 1
  fi
  # The venv's scripts name their interpreter by path: uv itself is a static binary, so the move is safe.
  rm -rf "$_da_uv_home" && mv "$_da_uv_home.tmp" "$_da_uv_home"
  UV="$_da_uv_home/bin/uv"
  if [ ! -x "$UV" ]; then
    echo "[env] FAILED: uv is not at $UV after installing it" >&2
    return 1 2>/dev/null || exit 1
  fi
fi
