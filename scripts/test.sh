#!/usr/bin/env bash
# Installs what is missing (first run only) and runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k capture
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO_ROOT"
python -m adapt models prepare --tiny --json
exec python -m pytest -q -p no:cacheprovider "$@"
