#!/usr/bin/env bash
# One-command device check for a machine with a GPU (or NPU) and torch but no vLLM, and no package
# index (what it lacks comes as wheels from scripts/device-bundle.sh).
#
#   bash scripts/device-check.sh            # from a checkout of this repository
#
# Sets up from the repository alone (lw-core, lw-bench, lw-dev, lw_vllm's copier and lw_mooncake's get arena on PYTHONPATH,
# no pip install of the project and no vLLM; missing modules such as msgspec and lmdb installed
# from the bundle's wheels into a temporary directory), then:
#   1. runs the device tests (tests/device: the copier and pipeline contract on the device, direct
#      copies between the registered pool and the KV blocks by both mechanisms, leases and commits
#      that wait for the copies, copies asynchronous yet ordered against the compute stream, GQA KV
#      read across TP sizes) and the pipeline's copier-hook tests;
#   2. runs `lw-bench pipeline --kv-device DEV`: the overlap with compute per mechanism, each
#      mechanism's pool rate against the pinned-DMA ceiling (--rates) and a model-shaped prefill
#      against loading its prefix (--model-shaped), then the host's own work per window on this
#      machine's CPU (--kv-device cpu-torch --host-work), and prints a short table last;
#   3. where Mooncake imports (installed, or from the bundle's wheel and libraries), the same rates
#      on a Mooncake pool started here (`--backend mooncake --rates`): its get and put arenas.
# Takes a few minutes. Results land in $OUT (when set, e.g. by a lent-device runner) or
# /tmp/lw-device-check: device-tests.txt, bench-*.json, summary.txt.
#
# Environment: MOONCAKE=0 skips step 3, MOONCAKE_BENCH_ARGS replaces its size options; PYTHON (default python3), KV_DEVICE (default: cuda, else npu), LW_WHEELS (the
# bundle's wheels; default .whl in or next to the repository), BENCH_ARGS (replaces the overlap
# run's size options), MODEL_SHAPES (default llama3-8b,llama3-70b), LW_TESTS_ALLOW_MISSING (default
# memcache_hybrid,mooncake,vllm: the tests of those are skipped), PIP (default: $PYTHON -m pip),
# PIP_INSTALL_MISSING=1 to try `pip install` of missing modules from an index instead.
set -uo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-/tmp/lw-device-check}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD/packages/lw-core/src:$PWD/packages/lw-bench/src:$PWD/packages/lw-vllm/src:$PWD/packages/lw-dev/src:$PWD/packages/lw-mooncake/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export LW_TESTS_ALLOW_MISSING=${LW_TESTS_ALLOW_MISSING:-memcache_hybrid,mooncake,vllm}
t_start=$(date +%s)
say() { printf '\n== %s\n' "$*"; }

say "environment"
"$PY" - <<'EOF' || { echo "device-check: torch is not importable with $PY (set PYTHON=...)"; exit 2; }
import importlib.util, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i}", torch.cuda.get_device_name(i))
else:
    print("no CUDA device visible to torch")
def have(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ImportError:
        return False
print("optional:", ", ".join(f"{m} {'yes' if have(m) else 'no'}" for m in ("cuda.bindings", "cupy", "triton")))
EOF
df -h /dev/shm 2>/dev/null | tail -1 | awk '{print "/dev/shm: " $4 " free of " $2}'

# The bundle's wheels: LW_WHEELS, else .whl in or next to the repository.
find_wheels() {
  local d
  if [ -n "${LW_WHEELS:-}" ]; then echo "$LW_WHEELS"; return; fi
  for d in "$PWD/.whl" "$PWD/../.whl"; do [ -d "$d" ] && { echo "$d"; return; }; done
}
wheels=$(find_wheels)
# One temporary site for what this run installs (the bundle's wheels, lw-mooncake's metadata), on
# PYTHONPATH once it exists.
site=""
use_site() {
  if [ -z "$site" ]; then
    site=$(mktemp -d /tmp/lw-device-site.XXXXXX)
    export PYTHONPATH="$PYTHONPATH:$site"
  fi
}
install_wheels() {
  use_site
  ${PIP:-"$PY" -m pip} install --quiet --no-index --no-deps --target "$site" "$@"
}
need="numpy msgspec lmdb tqdm pytest"
missing_now() { "$PY" -c "import importlib.util as u, sys; print(' '.join(m for m in sys.argv[1:] if u.find_spec(m) is None))" $need; }
missing=$(missing_now)
if [ -n "$missing" ]; then
  if [ -n "$wheels" ] && [ -d "$wheels" ]; then
    files=()
    for m in $missing; do
      for f in "$wheels/$m"-*.whl; do [ -e "$f" ] && files+=("$f"); done
    done
    if [ ${#files[@]} -gt 0 ]; then
      say "installing from $wheels: ${files[*]##*/}"
      install_wheels "${files[@]}" \
        || echo "device-check: installing the bundle's wheels failed (built for another Python? see scripts/device-bundle.sh)"
    fi
  fi
  missing=$(missing_now)
fi
if [ -n "$missing" ] && [ "${PIP_INSTALL_MISSING:-0}" = 1 ]; then
  say "installing missing modules: $missing"
  "$PY" -m pip install --quiet $missing || true
  missing=$(missing_now)
fi
if [ -n "$missing" ]; then
  echo "device-check: missing Python modules: $missing (run scripts/device-bundle.sh where a package index is"
  echo "  reachable and bring its .whl here, or pip install $missing, or rerun with PIP_INSTALL_MISSING=1)"
  exit 2
fi

# Mooncake, when this Python has it or the bundle brings it (scripts/device-bundle.sh): its wheel
# into the temporary site, and of the bundle's mooncake-libs.tar.xz only the libraries this machine
# lacks (each a link in a directory put first on LD_LIBRARY_PATH; linked in rounds, as a library
# found shows what it loads in turn). Without it the Mooncake bench below is skipped.
mooncake_ok() { "$PY" -c "import mooncake.store" 2>/dev/null; }
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('mooncake') is None)" 2>/dev/null \
    && [ -n "$wheels" ] && ls "$wheels"/mooncake_transfer_engine*.whl >/dev/null 2>&1; then
  say "installing Mooncake from $wheels"
  install_wheels "$(ls -t "$wheels"/mooncake_transfer_engine*.whl | head -1)"
fi
if ! mooncake_ok && [ -n "$wheels" ] && [ -f "$wheels/mooncake-libs.tar.xz" ]; then
  mc_dir=$("$PY" -c "import importlib.util as u; s = u.find_spec('mooncake'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null)
  if [ -n "$mc_dir" ]; then
    libs=$(mktemp -d /tmp/lw-device-libs.XXXXXX)
    mkdir -p "$libs/all" "$libs/use"
    tar -xJf "$wheels/mooncake-libs.tar.xz" -C "$libs/all"
    export LD_LIBRARY_PATH="$libs/use${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    for _ in 1 2 3 4 5 6; do
      lacking=$(ldd "$mc_dir/store.so" "$mc_dir/mooncake_master" 2>/dev/null | awk '/not found/ {print $1}' | sort -u)
      linked=0
      for l in $lacking; do
        [ -e "$libs/all/$l" ] && [ ! -e "$libs/use/$l" ] && ln -s "$libs/all/$l" "$libs/use/$l" && linked=1
      done
      [ $linked = 1 ] || break
    done
    echo "Mooncake: system libraries taken from the bundle: $(ls "$libs/use" | tr '\n' ' ')"
  fi
fi
if mooncake_ok; then
  have_mooncake=1
  # lw-core finds backends by their entry points; lw-mooncake's source tree on PYTHONPATH has no
  # distribution metadata, so a minimal one names its plugin (as its pyproject.toml does).
  if ! "$PY" -c "from lw_core.backends.registry import backend_names as b; import sys; sys.exit('mooncake' not in b())" 2>/dev/null; then
    use_site
    meta="$site/lw_mooncake-0+source.dist-info"
    mkdir -p "$meta"
    printf 'Metadata-Version: 2.1\nName: lw-mooncake\nVersion: 0+source\n' > "$meta/METADATA"
    printf '[lw_pool.backends]\nmooncake = lw_mooncake.plugin:PLUGIN\n' > "$meta/entry_points.txt"
  fi
else
  have_mooncake=0
  echo "Mooncake: not importable here (no wheel in the bundle, or a library missing); its bench is skipped"
fi

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
  echo "device-check: no CUDA or NPU device visible to torch; nothing to check here (KV_DEVICE=cpu-torch runs it on the CPU)"
  exit 3
fi
echo "KV device: $KV_DEVICE | results: $OUT_DIR"

say "device tests (tests/device, tests/core/test_pipeline_copier_hooks.py, tests/core/test_pipeline_device.py)"
timeout_opt=""
"$PY" -c "import pytest_timeout" 2>/dev/null && timeout_opt="--timeout=120"
timeout "${TESTS_TIMEOUT_S:-240}" "$PY" -m pytest tests/device tests/core/test_pipeline_copier_hooks.py tests/core/test_pipeline_device.py \
  -q -rs -p no:cacheprovider $timeout_opt 2>&1 | tee "$OUT_DIR/device-tests.txt"
tests_rc=${PIPESTATUS[0]}

# Which mechanisms this device offers: the GPU gather everywhere, batched DMA with cuda.bindings.
mechs="kernel"
"$PY" -c "from cuda.bindings import driver; assert hasattr(driver, 'cuMemcpyBatchAsync')" 2>/dev/null && mechs="kernel batch_dma"
[ "$KV_DEVICE" = cpu-torch ] && mechs="kernel batch_dma"
# 32 layers x 64 blocks x 128 KiB = 256 MiB per step (a mid-size model's prefix hit).
BENCH_ARGS=${BENCH_ARGS:---layers 32 --blocks 64 --block-bytes 131072 --reps 5 --depths 1,2,3,4}
bench_rc=0
first=1
for m in $mechs; do
  extra=""
  [ $first = 1 ] && extra="--rates --model-shaped ${MODEL_SHAPES:-llama3-8b,llama3-70b}"
  say "lw-bench pipeline --kv-device $KV_DEVICE --mechanism $m $extra"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-360}" "$PY" -m lw_bench.cli pipeline --json --kv-device "$KV_DEVICE" --backend embedded \
    --mechanism "$m" --timeout-s 340 $BENCH_ARGS $extra > "$OUT_DIR/bench-$m.json" || bench_rc=1
  first=0
done

# Mooncake's pool on this device: the rates of loads (per-layer ranged gets lent from the get arena,
# whole ones into it) and saves (put arena) against the pinned-DMA ceiling, bytes verified. Its
# master and holder run on this machine (their clients listen on every address: a lent machine with
# no network beyond itself). MOONCAKE=0 skips it.
if [ "$have_mooncake" = 1 ] && [ "${MOONCAKE:-1}" = 1 ]; then
  say "lw-bench pipeline --kv-device $KV_DEVICE --backend mooncake --rates"
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-360}" "$PY" -m lw_bench.cli pipeline --json --kv-device "$KV_DEVICE" --backend mooncake \
    --rates --timeout-s 340 ${MOONCAKE_BENCH_ARGS:---layers 4 --blocks 16 --block-bytes 65536 --reps 2 --depths 2} \
    > "$OUT_DIR/bench-mooncake.json" || bench_rc=1
fi

# The host's own part of the device path on this machine's CPU (copies that move nothing): the rate
# it alone allows bounds the rates above. HOST_WORK=0 skips it (about a minute).
if [ "${HOST_WORK:-1}" = 1 ]; then
  say "lw-bench pipeline --kv-device cpu-torch --host-work"
  timeout "${BENCH_TIMEOUT_S:-360}" "$PY" -m lw_bench.cli pipeline --json --kv-device cpu-torch --backend embedded \
    --host-work --layers 2 --blocks 8 --depths 1 --reps 3 --timeout-s 340 > "$OUT_DIR/bench-host.json" || bench_rc=1
fi

"$PY" - "$OUT_DIR" "$tests_rc" "$bench_rc" "$(( $(date +%s) - t_start ))" $mechs <<'EOF' | tee "$OUT_DIR/summary.txt"
import json, sys
from lw_bench.pipeline_tables import host_lines, model_lines, rate_lines
out, tests_rc, bench_rc, secs, mechs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
print("\n== summary")
print(f"device tests: {'passed' if tests_rc == 0 else f'FAILED (pytest exit {tests_rc})'}")
ok = tests_rc == 0 and bench_rc == 0
runs = {}
for m in mechs:
    try:
        runs[m] = json.loads(open(f"{out}/bench-{m}.json").read().strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        print(f"bench ({m}): no result ({e})")
        ok = False
if runs:
    c = next(iter(runs.values()))["config"]
    print(f"device: {c.get('device_name')} ({c['kv_device']}), torch {c.get('torch')}, {c['backend']} pool")
    print(f"overlap, {c['layers']} layers x {c['blocks']} blocks x {c['block_bytes'] // 1024} KiB "
          f"({c['total_bytes'] / 2**20:.0f} MiB per step), median of {c['reps']}:")
    print(f"  {'mechanism':>9} {'load GB/s':>9} {'save s':>7} {'best hidden':>11} {'depth':>5} {'plain DMA hides':>15} {'ratio':>6}  moved by")
for m, r in runs.items():
    best = max(r["hidden_fraction"], key=lambda d: r["hidden_fraction"][d])
    hid, raw = r["hidden_fraction"][best], r["raw_hidden_fraction"]
    moved = ",".join(f"{k}={v}" for k, v in (r.get("mechanism_counts") or {}).items() if v)
    print(f"  {m:>9} {r['transfer_gbps']:9.2f} {r.get('save_s') or 0:7.3f} {hid:11.3f} {best:>5} {raw:15.3f} "
          f"{hid / raw if raw else 0:6.3f}  {moved}{'' if r['verified'] and not r['load_failures'] else '  NOT VERIFIED'}")
    ok = ok and r["verified"] and not r["load_failures"]
for r in runs.values():
    if r.get("rates"):
        print("pool rate / pinned-DMA ceiling of the same run (loads and saves through the pipeline, bytes verified):")
        print("\n".join(rate_lines(r["rates"])))
        ok = ok and all(x["verified"] for x in r["rates"])
    if r.get("model_shaped"):
        print("a hit's load / a dense prefill of the same prefix (at the model-shaped case's rates):")
        print("\n".join(model_lines(r["model_shaped"])))
try:
    mc = json.loads(open(f"{out}/bench-mooncake.json").read().strip().splitlines()[-1])
except Exception:  # noqa: BLE001 (no Mooncake here: said above)
    mc = None
if mc and mc.get("rates"):
    print("Mooncake pool (get and put arenas) rate / pinned-DMA ceiling of the same run (bytes verified):")
    print("\n".join(rate_lines(mc["rates"])))
    ok = ok and all(x["verified"] for x in mc["rates"])
    tot = {k: sum(x.get("store_counts", {}).get(k, 0) for x in mc["rates"])
           for k in ("put_direct_bytes", "put_staged_bytes", "arena_gets", "arena_range_gets")}
    print(f"  Mooncake moved: puts {tot['put_direct_bytes'] / 2**20:.0f} MiB from the put arena, "
          f"{tot['put_staged_bytes'] / 2**20:.0f} MiB through its staging; gets into the get arena: "
          f"{tot['arena_gets']} whole, {tot['arena_range_gets']} ranged")
try:
    host = json.loads(open(f"{out}/bench-host.json").read().strip().splitlines()[-1]).get("host_work")
except Exception:  # noqa: BLE001 (skipped with HOST_WORK=0, or failed: said above)
    host = None
if host:
    print("this machine's host work per window, copies moving nothing (the rate it alone allows):")
    print("\n".join(host_lines(host)))
print(f"device check: {'OK' if ok else 'NOT OK'} in {secs}s; files in {out}")
sys.exit(0 if ok else 1)
EOF
