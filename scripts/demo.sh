#!/usr/bin/env bash
# The README's main job: set up (idempotent), then measure the layer pipeline and the pool.
# Figures go to out/ as JSON and PNG besides the printed tables.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
uv run --no-sync lw-bench pipeline --plot out/pipeline.png "$@"
uv run --no-sync lw-bench backend
