#!/usr/bin/env bash
# The README's test command: set up (idempotent), then run every test of the workspace.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/core -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec uv run --no-sync pytest "$@"
