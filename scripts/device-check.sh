#!/usr/bin/env bash
# One-command device check for a machine with a GPU (or NPU) and torch but no vLLM.
#
#   bash scripts/device-check.sh            # from a checkout of this repository
#
# Sets up from the repository alone (lw-core, lw-bench and lw_vllm's copier on PYTHONPATH, no pip install of
# the project and no vLLM), then:
#   1. runs the device tests (tests/device: the copier and pipeline contract on the device, pinned
#      staging, copies asynchronous yet ordered against the compute stream, GQA KV read across TP
#      sizes in head-major and token-major blocks -- token-major is CUDA's default KV layout) and
#      the pipeline's copier-hook tests;
#   2. runs `lw-bench pipeline --kv-device DEV` (device copies through the pool vs the same compute
#      on the device) and prints the overlap figures and a short summary.
# Takes a few minutes. Results land in $OUT (when set, e.g. by a lent-device runner) or
# /tmp/lw-device-check: device-tests.txt, bench.json, summary.txt.
#
# Environment: PYTHON (default python3), KV_DEVICE (default: cuda, else npu), BENCH_ARGS (replaces
# the bench's size options), PIP_INSTALL_MISSING=1 to try `pip install` of missing pure-Python deps.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-/tmp/lw-device-check}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/packages/lw-core/src:$PWD/packages/lw-bench/src:$PWD/packages/lw-vllm/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
t_start=$(date +%s)
say() { printf '\n== %s\n' "$*"; }

say "environment"
"$PY" - <<'EOF' || { echo "device-check: torch is not importable with $PY (set PYTHON=...)"; exit 2; }
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i}", torch.cuda.get_device_name(i))
else:
    print("no CUDA device visible to torch")
EOF

missing=$("$PY" - <<'EOF'
import importlib.util
need = ["numpy", "msgspec", "tqdm", "pytest"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ] && [ "${PIP_INSTALL_MISSING:-0}" = 1 ]; then
  say "installing missing modules: $missing"
  "$PY" -m pip install --quiet $missing || true
  missing=$("$PY" -c "import importlib.util as u; print(' '.join(m for m in '$missing'.split() if u.find_spec(m) is None))")
fi
if [ -n "$missing" ]; then
  echo "device-check: missing Python modules: $missing (pip install $missing, or rerun with PIP_INSTALL_MISSING=1)"
  exit 2
fi
BACKEND=embedded
"$PY" -c "import lmdb" 2>/dev/null || { BACKEND=memory; echo "lmdb not installed: the bench uses the memory pool instead of the embedded one"; }

# The copier must import without vLLM (it cannot be installed here).
"$PY" -c "import sys; sys.modules['vllm'] = None; import lw_vllm.device.copier, lw_core.pipeline" \
  || { echo "device-check: lw_vllm.device.copier does not import without vLLM"; exit 2; }

if [ -z "${KV_DEVICE:-}" ]; then
  KV_DEVICE=$("$PY" - <<'EOF'
import torch
if torch.cuda.is_available():
    print("cuda:0")
else:
    try:
        import torch_npu  # noqa: F401
        print("npu:0" if torch.npu.is_available() else "none")
    except ImportError:
        print("none")
EOF
)
fi
if [ "$KV_DEVICE" = none ]; then
  echo "device-check: no CUDA or NPU device visible to torch; nothing to check here"
  exit 3
fi
echo "KV device: $KV_DEVICE | pool: $BACKEND | results: $OUT_DIR"

say "device tests (tests/device, tests/core/test_pipeline_copier_hooks.py)"
timeout_opt=""
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt="--timeout=120"
timeout 420 "$PY" -m pytest tests/device tests/core/test_pipeline_copier_hooks.py tests/core/test_pipeline_device.py \
  -q -rs -p no:cacheprovider $timeout_opt 2>&1 | tee "$OUT_DIR/device-tests.txt"
tests_rc=${PIPESTATUS[0]}
cuda_skips=$(sed -n 's/^SKIPPED \[\([0-9]*\)\] tests\/device\/test_device_copier.*/\1/p' "$OUT_DIR/device-tests.txt" | awk '{s+=$1} END {print s+0}')

say "lw-bench pipeline --kv-device $KV_DEVICE"
# 32 layers x 64 blocks x 128 KiB = 256 MiB per step (a mid-size model's prefix hit), 5 reps.
BENCH_ARGS=${BENCH_ARGS:---layers 32 --blocks 64 --block-bytes 131072 --reps 5 --depths 1,2,3,4}
# shellcheck disable=SC2086
timeout 420 "$PY" -m lw_bench.cli pipeline --json --kv-device "$KV_DEVICE" --backend "$BACKEND" \
  --timeout-s 400 $BENCH_ARGS > "$OUT_DIR/bench.json"
bench_rc=$?

"$PY" - "$OUT_DIR" "$tests_rc" "$bench_rc" "$cuda_skips" "$(( $(date +%s) - t_start ))" <<'EOF' | tee "$OUT_DIR/summary.txt"
import json, sys
out, tests_rc, bench_rc, skips, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
print()
print("== summary")
print(f"device tests: {'passed' if tests_rc == 0 else f'FAILED (pytest exit {tests_rc})'}"
      + (f"; {skips} CUDA tests skipped (no CUDA device: the NPU is covered by the bench only)" if skips else ""))
r = None
if bench_rc == 0:
    try:
        lines = open(f"{out}/bench.json").read().strip().splitlines()
        r = json.loads(lines[-1])
    except Exception as e:  # noqa: BLE001
        print(f"bench: no result ({e})")
else:
    print(f"bench: FAILED (exit {bench_rc}); see the messages above")
if r:
    c = r["config"]
    rows = [
        f"pipeline bench on {c.get('device_name')} ({c['kv_device']}), torch {c.get('torch')}, {c['backend']} pool",
        f"  {c['layers']} layers x {c['blocks']} blocks x {c['block_bytes'] // 1024} KiB = {c['total_bytes'] / 2**20:.1f} MiB per step, median of {c['reps']}",
        f"  compute only   {r['t_compute_s'] * 1e3:8.2f} ms  ({r['per_layer_compute_ms']:.3f} ms/layer, matmul n={c['matmul_n']})",
        f"  transfer only  {r['t_transfer_s'] * 1e3:8.2f} ms  ({r['transfer_gbps']:.2f} GB/s pool -> device)",
        f"  bulk           {r['t_bulk_s'] * 1e3:8.2f} ms",
    ]
    for d in sorted(r["t_layerwise_s"], key=int):
        rows.append(f"  layerwise d={d}  {r['t_layerwise_s'][d] * 1e3:8.2f} ms  hidden {r['hidden_fraction'][d]:6.1%}  "
                    f"blocked in wait_layer {r['layer_wait_ms'][d]:.2f} ms")
    rows.append(f"  ceiling: plain H2D DMA next to the same compute hides {r['raw_hidden_fraction']:.1%} "
                f"({r['t_raw_copy_s'] * 1e3:.2f} ms alone)")
    best = max(r["hidden_fraction"], key=lambda d: r["hidden_fraction"][d])
    rows.append(f"  verified={r['verified']} load_failures={r['load_failures']} errors={r['errors'][:3]}")
    rows.append(f"result: best overlap {r['hidden_fraction'][best]:.1%} at prefetch depth {best} "
                f"(ceiling {r['raw_hidden_fraction']:.1%}); layerwise {r['t_layerwise_s'][best] * 1e3:.1f} ms "
                f"vs bulk {r['t_bulk_s'] * 1e3:.1f} ms vs compute alone {r['t_compute_s'] * 1e3:.1f} ms")
    print("\n".join(rows))
ok = tests_rc == 0 and bench_rc == 0 and bool(r) and r["verified"] and not r["load_failures"]
print(f"device check: {'OK' if ok else 'NOT OK'} in {secs}s; files in {out}")
sys.exit(0 if ok else 1)
EOF
