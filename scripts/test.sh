#!/usr/bin/env bash
# Installs what is missing (first run only) and runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k capture
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$REPO_ROOT"
python -m app models prepare --tiny --tiny-qwen3-chat --json
# A private base temp dir: pytest prunes old /tmp/pytest-of-$USER dirs, which would pull
# the files from under a concurrent run's session fixtures.
basetemp="$(mktemp -d -t drafter-adapt-tests.XXXXXX)"
trap 'rm -rf "$basetemp"' EXIT
python -m pytest -q -p no:cacheprovider --basetemp="$basetemp/t" "$@"
