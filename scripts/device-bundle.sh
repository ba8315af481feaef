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
# Mooncake (BUNDLE_MOONCAKE=1, the default) comes too, so the device check also measures the
# Mooncake pool's get and put arenas on the device: the wheel MOONCAKE_WHEEL for the device's Python
# and mooncake-libs.tar.xz, the system libraries its binaries load on this machine (libibverbs,
# libnuma, libcurl and what they load; device-check.sh uses only those its machine lacks). About
# 50 MB of the bundle; a device runner that carries 64 MiB in all takes it with the tree.
# BUNDLE_MOONCAKE=0 leaves it out (the device check then skips Mooncake).
#
# Environment: DEVICE_PYTHON (the device's Python version, default 3.12), DEVICE_PLATFORMS (pip
# platform tags, default manylinux_2_28/2_17/2014 x86_64), BUNDLE_PACKAGES (default: msgspec lmdb
# tqdm), BUNDLE_MOONCAKE (default 1), MOONCAKE_WHEEL (default the version lw-mooncake pins,
# mooncake-transfer-engine-non-cuda==0.3.13.post1), PIP (default: python3 -m pip).
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

if [ "${BUNDLE_MOONCAKE:-1}" = 1 ]; then
  MOONCAKE_WHEEL=${MOONCAKE_WHEEL:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
  # shellcheck disable=SC2086
  "${PIP_CMD[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${plat_args[@]}" -d "$DIR" "$MOONCAKE_WHEEL"
  # The libraries its binaries load from this machine's system, glibc's own and the C++ runtime
  # (there wherever torch runs) left out: resolved by ldd on the wheel's own files.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  whl=$(ls -t "$DIR"/mooncake_transfer_engine*.whl | head -1)
  python3 -m zipfile -e "$whl" "$tmp/whl"
  mkdir -p "$tmp/lib"
  ldd "$tmp"/whl/mooncake/store.so "$tmp"/whl/mooncake/engine.so "$tmp"/whl/mooncake/mooncake_master 2>/dev/null \
    | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | grep -v "^$tmp/" | sort -u \
    | grep -Ev '/(libc|libm|libpthread|libdl|librt|libresolv|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' \
    | while read -r lib; do cp -L "$lib" "$tmp/lib/"; done
  tar -cJf "$DIR/mooncake-libs.tar.xz" -C "$tmp/lib" .
  echo "device-bundle: Mooncake: ${whl##*/} and mooncake-libs.tar.xz ($(ls "$tmp/lib" | wc -l) libraries)"
fi
echo "device-bundle: wheels for CPython $PYV in $DIR:"
ls -l "$DIR"
echo "device-bundle: $(du -sh "$DIR" | cut -f1) in all; on the device machine run: bash scripts/device-check.sh"
