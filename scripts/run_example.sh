#!/usr/bin/env bash
# Sets up the environment if needed, then runs the guide's offline example
# (vLLM's CPU backend here, with a generated model unless --model). Its flags:
# python examples/offline_inference_kv_offload.py --help.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n ${VLLM_ASCEND_KV_OFFLOAD_CACHE:-} ]]; then
  export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$VLLM_ASCEND_KV_OFFLOAD_CACHE/pip}
fi
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source "${VLLM_ASCEND_VENV:-.venv}/bin/activate"
exec python examples/offline_inference_kv_offload.py "$@"
