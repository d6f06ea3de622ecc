#!/usr/bin/env bash
# Sets up the environment if needed, then runs the guide's offline example
# (vLLM's CPU backend here, with a generated tiny model unless --model).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source "${VLLM_ASCEND_VENV:-.venv}/bin/activate"
exec python examples/offline_inference_kv_offload.py "$@"
