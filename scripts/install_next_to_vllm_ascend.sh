#!/usr/bin/env bash
# bash scripts/install_next_to_vllm_ascend.sh: installs vllm-ascend-kv-offload
# (--no-deps, from a copy of the tracked sources) next to the vLLM and the
# vllm-ascend >= 0.30 already there, changing neither, then runs the doctor.
# PYTHON selects another interpreter. Exit status: 1 with one line saying why
# (the log is kept), else the doctor's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
log=$(mktemp "${TMPDIR:-/tmp}/install_kv_offload.XXXXXX.log")
work=$(mktemp -d "${TMPDIR:-/tmp}/install_kv_offload.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "[install] FAILED: $* (log: $log)" >&2 && exit 1; }

command -v "$PY" >/dev/null 2>&1 || fail "no Python interpreter '$PY' (set PYTHON)"
npu=$("$PY" - <<'PY'
import importlib.metadata as md, importlib.util as iu, subprocess, sys

for module in ("torch", "vllm"):
    if iu.find_spec(module) is None:
        sys.exit(f"[install] FAILED: {module} is not importable: install vLLM (and its torch) first")
def load(name):  # from the checkout: nothing is installed yet
    spec = iu.spec_from_file_location(name, f"vllm_ascend/kv_offload/{name}.py")
    spec.loader.exec_module(module := iu.module_from_spec(spec))
    return module
try:  # the plugin's own refusal of an upstream that owns our files
    load("upstream_guard").refuse_conflicting_upstream(load("__init__").__version__)
except ImportError as e:
    sys.exit(f"[install] FAILED: {e}")
upstream = next((d.version for d in md.distributions(name="vllm-ascend")), None)
# In a child: a broken CANN can abort the interpreter on import.
npu = iu.find_spec("torch_npu") is not None and subprocess.run(
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
