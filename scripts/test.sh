#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint (ruff), type-check (mypy) and check the
# layer rules (import-linter's contracts) of the workspace, then run every test. Extra arguments go
# to pytest (e.g. `bash scripts/test.sh tests/core -x`). The tools are configured once, in the root
# pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
uv run --no-sync ruff check
uv run --no-sync mypy
uv run --no-sync lint-imports
exec uv run --no-sync pytest "$@"
