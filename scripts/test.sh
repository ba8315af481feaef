#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint (ruff) and type-check (mypy) the workspace,
# then run every test. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/core -x`).
# Both tools are configured once, in the root pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
uv run --no-sync ruff check
uv run --no-sync mypy
exec uv run --no-sync pytest "$@"
