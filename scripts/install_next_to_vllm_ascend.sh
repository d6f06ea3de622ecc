#!/usr/bin/env bash
# Installs vllm-ascend-kv-offload into the active Python environment, next to
# the vLLM and vllm-ascend (>= 0.30) already there, and checks the result:
#
#   bash scripts/install_next_to_vllm_ascend.sh
#
# Nothing of vLLM, torch, torch_npu or vllm-ascend is installed, upgraded or
# removed: the native op is compiled against the torch (and torch_npu, when
# importable: the npu backend) of this environment, so only the build tools
# pybind11, cmake and ninja are added if missing. PYTHON selects another
# interpreter. A vllm-ascend older than 0.30 is refused before anything is
# installed (it owns a vllm_ascend/kv_offload of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}

"$PY" - <<'PY'
import importlib.metadata as md
import importlib.util
import sys

from packaging.version import Version

try:
    upstream = md.version("vllm-ascend")
except md.PackageNotFoundError:
    upstream = None
if upstream is not None and Version(upstream) < Version("0.30.0rc0"):
    sys.exit(
        f"vllm-ascend {upstream} is installed: vllm-ascend-kv-offload needs "
        "vllm-ascend >= 0.30 (vLLM 0.30-0.33); versions before 0.30 ship their "
        "own vllm_ascend/kv_offload. Upgrade vllm-ascend first."
    )
if not all(importlib.util.find_spec(m) for m in ("vllm", "torch")):
    sys.exit("install vLLM (and torch) into this environment first")
npu = importlib.util.find_spec("torch_npu") is not None
print(
    f"[install] vllm-ascend {upstream or 'not installed'}; torch_npu "
    f"{'found: npu backend' if npu else 'not found: no npu backend'}"
)
PY

"$PY" -m pip install -q "pybind11>=2.10" "cmake>=3.21" ninja "setuptools>=77"
"$PY" -m pip install --no-build-isolation --no-deps .

"$PY" - <<'PY'
import importlib.metadata as md

import vllm_ascend.kv_offload.npu as spec
from vllm_ascend.kv_offload import ops

print(f"[install] {spec.__name__} from {spec.__file__}")
print(f"[install] native op: {ops.HAS_NATIVE_OP}, backends: {ops.native_backends()}")
try:
    dist = md.distribution("vllm-ascend")
except md.PackageNotFoundError:
    pass
else:
    platform = [e.name for e in dist.entry_points if e.group == "vllm.platform_plugins"]
    print(f"[install] vllm-ascend {dist.version} intact: platform plugins {platform}")
PY
