#!/usr/bin/env bash
# Prepare, on a machine that reaches a package index, what scripts/device-check.sh needs on a GPU
# (or NPU) machine that reaches none: wheels of the Python packages the project needs beyond what
# such a machine has (torch, numpy, pytest, ...), built for that machine's Python.
#
#   bash scripts/device-bundle.sh [DIR]     # DIR default: .whl at the repository root (git-ignored)
#
# Then bring the repository and DIR to the device machine (DIR as .whl in the repository root or
# next to it, or named by LW_WHEELS) and run there, with no network:
#
#   bash scripts/device-check.sh
#
# It installs the wheels of the modules its Python lacks with
# `pip install --no-index --no-deps --target <tmp>` and puts that on PYTHONPATH; nothing else.
#
# Environment: DEVICE_PYTHON (the device's Python version, default 3.12), DEVICE_PLATFORMS (pip
# platform tags, default manylinux_2_28/2_17/2014 x86_64), BUNDLE_PACKAGES (default: msgspec lmdb
# tqdm), PIP (default: python3 -m pip).
set -euo pipefail

cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${DEVICE_PYTHON:-3.12}
PLATFORMS=${DEVICE_PLATFORMS:-manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64}
PACKAGES=${BUNDLE_PACKAGES:-msgspec lmdb tqdm}
read -r -a PIP_CMD <<< "${PIP:-python3 -m pip}"

plat_args=()
for p in $PLATFORMS; do plat_args+=(--platform "$p"); done
mkdir -p "$DIR"
# shellcheck disable=SC2086
"${PIP_CMD[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  "${plat_args[@]}" -d "$DIR" $PACKAGES
echo "device-bundle: wheels for CPython $PYV in $DIR:"
ls -l "$DIR"
echo "device-bundle: $(du -sh "$DIR" | cut -f1) in all; on the device machine run: bash scripts/device-check.sh"
