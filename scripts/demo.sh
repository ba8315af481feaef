#!/usr/bin/env bash
# The README's main job: set up (idempotent), then `lw-bench serve` -- time to first token of a
# real vLLM engine (CPU build) with the connector on the embedded pool: recompute vs pool hits,
# bulk vs layerwise, at 256..2048-token prefixes. Table on stdout, figures in out/serve.{json,png}.
#
#   bash scripts/demo.sh [--all] [lw-bench serve options, e.g. --reps 5]
#
# About 13 minutes on a 2-core machine, 1.5 of them the set-up. `bash scripts/demo.sh --quick` is a
# first look (lw-bench serve --quick: the 4-layer test model, one 128-token prefix): about a minute
# after the set-up.
# --all also runs the two component benches afterwards (layer pipeline vs synthetic compute, and
# the raw pool), into out/pipeline.png and the printed tables.
set -euo pipefail
cd "$(dirname "$0")/.."
all=0
if [ "${1:-}" = "--all" ]; then
    all=1
    shift
fi
bash scripts/setup.sh
mkdir -p out
uv run --no-sync lw-bench serve --plot out/serve.png --save out/serve.json "$@"
if [ "$all" = 1 ]; then
    uv run --no-sync lw-bench pipeline --plot out/pipeline.png
    uv run --no-sync lw-bench backend
fi
