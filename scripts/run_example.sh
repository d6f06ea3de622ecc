#!/usr/bin/env bash
# Sets up the environment if needed, then runs the guide's offline example
# (vLLM's CPU backend here, with a generated model unless --model). Its flags:
# python examples/offline_inference_kv_offload.py --help.
set -euo pipefail
# shellcheck disable=SC1091
source "$(dirname "$0")/setup_env.sh" # cds to the checkout, activates the venv
exec python examples/offline_inference_kv_offload.py "$@"
