#!/usr/bin/env bash
# bash scripts/install_next_to_vllm_ascend.sh: installs vllm-ascend-kv-offload
# next to the vLLM (and vllm-ascend >= 0.30; older ones ship their own
# kv_offload: refused) already there, then runs the doctor. --no-deps: nothing
# of vLLM, torch(_npu) or vllm-ascend is changed; built from a copy of the
# tracked sources (nothing left here). PYTHON selects another interpreter.
# Exit status: 1 with one line saying why (the log is kept), else the doctor's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
log=$(mktemp "${TMPDIR:-/tmp}/install_kv_offload.XXXXXX.log")
work=$(mktemp -d "${TMPDIR:-/tmp}/install_kv_offload.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "[install] FAILED: $* (log: $log)" >&2 && exit 1; }

command -v "$PY" >/dev/null 2>&1 || fail "no Python interpreter '$PY' (set PYTHON)"
npu=$("$PY" - <<'PY'
import importlib.metadata as md
import importlib.util
import subprocess
import sys

for module in ("torch", "vllm"):
    if importlib.util.find_spec(module) is None:
        sys.exit(f"[install] FAILED: {module} is not importable: install vLLM (and its torch) first")
# The first on sys.path, as importlib.metadata.version("vllm-ascend") finds it.
upstream = next((d.version for d in md.distributions(name="vllm-ascend")), None)
from packaging.version import Version  # noqa: E402 (vLLM's dependency)

if upstream is not None and Version(upstream) < Version("0.30.0rc0"):
    sys.exit(f"[install] FAILED: vllm-ascend {upstream} is installed: vllm-ascend-kv-offload needs "
             ">= 0.30 (older ones ship their own vllm_ascend/kv_offload); upgrade it")
# In a child: a broken CANN can abort the interpreter on import.
npu = importlib.util.find_spec("torch_npu") is not None and subprocess.run(
    [sys.executable, "-c", "import torch_npu"], capture_output=True).returncode == 0
print(f"[install] vllm-ascend {upstream or 'not installed'}; torch_npu: "
      + ("found: the npu backend is built" if npu else "not installed or not "
         "importable: the npu backend of the copy op is not built"), file=sys.stderr)
print(int(npu))
PY
) || exit 1

need=()
"$PY" -c 'import setuptools as s, sys; sys.exit(int(s.__version__.split(".")[0]) < 77)' \
  2>/dev/null || need+=("setuptools>=77")
cmake --version 2>/dev/null | awk 'NR==1 {split($3, v, "."); exit !(v[1] > 3 || v[1] == 3 && v[2] >= 21)}' ||
  need+=("cmake>=3.21")
if ((${#need[@]})); then
  echo "[install] adding build tools: ${need[*]}"
  "$PY" -m pip install "${need[@]}" >>"$log" 2>&1 || fail "pip could not install ${need[*]}"
fi
echo "[install] building vllm-ascend-kv-offload (a few minutes)"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work" ||
  fail "could not copy the sources to $work"
"$PY" -m pip install --no-build-isolation --no-deps "$work" >>"$log" 2>&1 ||
  fail "the build failed: $(grep -E 'error|Error' "$log" | tail -1)"

# Outside the checkout, with only our general plugin where there is no NPU
# (upstream's platform plugin imports torch_npu).
mkdir "$work/.run" && cd "$work/.run" || exit 1
if [[ $npu == 1 ]]; then unset VLLM_PLUGINS; else export VLLM_PLUGINS=ascend_kv_offload; fi
"$PY" -c 'import vllm_ascend.kv_offload.npu as s; from vllm_ascend.kv_offload import ops
print(f"[install] {s.__name__} from {s.__file__}\n[install] native op: {ops.HAS_NATIVE_OP}")' 2>>"$log" ||
  fail "the installed package does not import: $(tail -1 "$log")"
done="not an Ascend machine: installed, npu backend not built"
[[ $npu == 1 ]] && done="installed with the npu backend"
echo "[install] done: $done"
rm -f "$log"
"$PY" -m vllm_ascend.kv_offload.doctor
