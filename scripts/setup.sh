#!/usr/bin/env bash
# Set up everything on a fresh machine: uv, the workspace venv (.venv) from uv.lock, and the
# platform's vLLM build (not locked: each platform brings its own; see scripts/install-vllm.sh).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v uv >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check 'uv>=0.5,<1'
fi
bash scripts/install-mooncake-deps.sh  # libibverbs1 for lw-mooncake[store]
# --inexact: keep what install-vllm.sh added outside the lock. Every workspace member with all its
# extras, plus the root's dev group (pytest, ruff, mypy, lw-dev: the test support).
# --compile-bytecode: write every .pyc now. Where PYTHONDONTWRITEBYTECODE is set (it is on these
# machines) Python never caches bytecode, so each engine process compiled vLLM, torch and
# transformers from source again: ~15 s of CPU per process, dozens of processes per test run.
uv sync --inexact --all-packages --all-extras --group dev --quiet --compile-bytecode
if [ -f scripts/install-vllm.sh ] && [ "${LW_SKIP_VLLM:-0}" != "1" ]; then
    bash scripts/install-vllm.sh
fi
