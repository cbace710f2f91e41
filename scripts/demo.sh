#!/usr/bin/env bash
# Installs what is missing (first run only) and runs the main job on the embedded default config.
# Extra arguments go to `adapt demo`, e.g. scripts/demo.sh --json
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO_ROOT"
exec python -m app demo "$@"
