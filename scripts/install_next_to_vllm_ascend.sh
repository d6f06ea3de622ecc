#!/usr/bin/env bash
# Installs vllm-ascend-kv-offload into the active Python environment, next to
# the vLLM and vllm-ascend (>= 0.30) already there, and checks the result:
#
#   bash scripts/install_next_to_vllm_ascend.sh
#
# 1. Checks what it needs, one line each: vLLM and torch (required), upstream
#    vllm-ascend (>= 0.30, or absent; older is refused: it ships its own
#    vllm_ascend/kv_offload), torch_npu and CANN (without them the package is
#    installed without its npu backend).
# 2. Builds from a copy of this checkout in a temporary directory (no build/
#    or egg-info left here) against the torch (and torch_npu) installed, with
#    --no-deps: nothing of vLLM, torch, torch_npu or vllm-ascend is installed,
#    upgraded or removed. Only missing build tools (cmake, setuptools) are
#    added. pip's output goes to a log; its dependency-conflict report
#    (about packages already installed) is summed up in one line.
# 3. Verifies the installed package in a fresh interpreter. vLLM is started
#    with VLLM_PLUGINS naming only this package's plugin, so that upstream's
#    platform plugin, which imports torch_npu, is not loaded on a machine
#    without an NPU.
#
# Exit status: 0 when installed and verified (on a machine without torch_npu:
# "not an Ascend machine: installed, npu backend not built"), else 1 with one
# line saying why. PYTHON selects another interpreter; the log is kept in
# $TMPDIR on failure.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python}
log=$(mktemp "${TMPDIR:-/tmp}/install_kv_offload.XXXXXX.log")
work=$(mktemp -d "${TMPDIR:-/tmp}/install_kv_offload.XXXXXX")
trap 'rm -rf "$work"' EXIT

fail() {
  echo "[install] FAILED: $*" >&2
  echo "[install] log: $log" >&2
  exit 1
}

# --- 1. what is there ---------------------------------------------------------
command -v "$PY" >/dev/null 2>&1 || fail "no Python interpreter '$PY' (set PYTHON)"
checks=$("$PY" - <<'PY' 2>>"$log"
import glob
import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def say(line):
    print(f"[install] {line}")


fatal = []
for module, dist in (("torch", "torch"), ("vllm", "vllm")):
    if importlib.util.find_spec(module) is None:
        fatal.append(f"{module} is not importable: install vLLM (and its torch) first")
    else:
        v = version(dist) or version(f"{dist}-cpu") or "?"
        say(f"{module} {v}: found")
upstream = version("vllm-ascend")
if upstream is None:
    say("vllm-ascend: not installed: no NPU platform plugin; vLLM keeps its own platforms")
else:
    from packaging.version import Version

    if Version(upstream) < Version("0.30.0rc0"):
        fatal.append(
            f"vllm-ascend {upstream} is installed: vllm-ascend-kv-offload needs "
            "vllm-ascend >= 0.30; versions before 0.30 ship their own "
            "vllm_ascend/kv_offload. Upgrade vllm-ascend first"
        )
    else:
        say(f"vllm-ascend {upstream}: found (>= 0.30: installs next to it)")
npu = False
if importlib.util.find_spec("torch_npu") is None:
    say("torch_npu: not installed: the npu backend of the copy op is not built")
else:
    # In a child: a broken CANN can abort the interpreter on import.
    probe = subprocess.run(
        [sys.executable, "-c", "import torch_npu"], capture_output=True, text=True
    )
    if probe.returncode == 0:
        npu = True
        say(f"torch_npu {version('torch-npu') or '?'}: found: the npu backend is built")
    else:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        say(f"torch_npu: installed but does not import ({last}): npu backend not built")
cann = [
    d
    for d in (
        os.environ.get("ASCEND_TOOLKIT_HOME"),
        os.environ.get("ASCEND_HOME_PATH"),
        "/usr/local/Ascend/ascend-toolkit/latest",
    )
    if d and glob.glob(os.path.join(d, "lib64", "libascendcl.so"))
]
if cann:
    say(f"CANN: {cann[0]}")
elif npu:
    fatal.append(
        "torch_npu imports but no CANN toolkit (libascendcl.so) was found: "
        "source CANN's set_env.sh (ASCEND_TOOLKIT_HOME) first"
    )
else:
    say("CANN: not found (needed for the npu backend only)")
for line in fatal:
    print(f"FATAL {line}")
print(f"NPU {int(npu)}")
PY
) || fail "the environment check did not run (see the log)"
grep '^\[install\]' <<<"$checks"
if grep -q '^FATAL ' <<<"$checks"; then
  fail "$(grep '^FATAL ' <<<"$checks" | head -1 | cut -c7-)"
fi
npu=$(grep '^NPU ' <<<"$checks" | cut -d' ' -f2)

# --- 2. build and install -----------------------------------------------------
missing_tools=$("$PY" - <<'PY'
import importlib.metadata as md
import re
import shutil
import subprocess

from packaging.version import Version

need = []
try:
    if Version(md.version("setuptools")) < Version("77"):
        need.append("setuptools>=77")
except md.PackageNotFoundError:
    need.append("setuptools>=77")
cmake = shutil.which("cmake")
found = None
if cmake:
    out = subprocess.run([cmake, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+\.\d+(\.\d+)?)", out)
    found = m and Version(m.group(1))
if found is None or found < Version("3.21"):
    need.append("cmake>=3.21")
print(" ".join(need))
PY
) || fail "could not check the build tools"
if [[ -n $missing_tools ]]; then
  echo "[install] adding build tools: $missing_tools"
  # shellcheck disable=SC2086
  "$PY" -m pip install $missing_tools >>"$log" 2>&1 ||
    fail "pip could not install the build tools ($missing_tools)"
fi

# A copy of the tracked sources: the build writes build/ and an egg-info next
# to setup.py, which would then shadow the installed metadata in this checkout.
echo "[install] building vllm-ascend-kv-offload (a few minutes; log: $log)"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z --cached --others --exclude-standard |
    tar --null -T - -cf - 2>>"$log" | tar -xf - -C "$work" ||
    fail "could not copy the sources to $work"
else
  tar --exclude=.venv --exclude=.models --exclude=build --exclude='*.egg-info' \
    -cf - . | tar -xf - -C "$work" || fail "could not copy the sources to $work"
fi
"$PY" -m pip install --no-build-isolation --no-deps "$work" >>"$log" 2>&1 ||
  fail "the build failed: $(grep -E 'error|Error' "$log" | tail -1)"
# pip checks the whole environment after installing and reports conflicts
# between packages that were there before (e.g. upstream vllm-ascend's pins
# against a CPU build of vLLM); --no-deps means none of them was touched.
conflicts=$(grep -c "requires .*, but you have\|which is not installed" "$log" || true)
if [[ $conflicts -gt 0 ]]; then
  echo "[install] pip reports $conflicts dependency conflict(s) among packages" \
    "that were already installed; none was changed (--no-deps): see $log"
fi

# --- 3. verify ------------------------------------------------------------------
# Only our general plugin: upstream's platform plugin imports torch_npu.
plugins=ascend_kv_offload
[[ $npu == 1 ]] && plugins=
mkdir "$work/.verify"
verify=$(cd "$work/.verify" && VLLM_PLUGINS=$plugins "$PY" - 2>>"$log" <<'PY'
import importlib.metadata as md
import os

if not os.environ.get("VLLM_PLUGINS"):
    os.environ.pop("VLLM_PLUGINS", None)

import vllm_ascend.kv_offload.npu as spec
from vllm_ascend.kv_offload import ops
from vllm_ascend.kv_offload.plugin import register

register()
print(f"[install] {spec.__name__} from {spec.__file__}")
print(f"[install] native op: {ops.HAS_NATIVE_OP}, backends: {ops.native_backends()}")
try:
    dist = md.distribution("vllm-ascend")
except md.PackageNotFoundError:
    pass
else:
    platform = [e.name for e in dist.entry_points if e.group == "vllm.platform_plugins"]
    print(f"[install] vllm-ascend {dist.version} intact: platform plugins {platform}")
print("BACKENDS " + " ".join(ops.native_backends()))
PY
) || fail "the installed package does not import: $(tail -1 "$log")"
grep '^\[install\]' <<<"$verify"
backends=$(grep '^BACKENDS ' <<<"$verify" | cut -d' ' -f2-)
if [[ $npu == 1 ]]; then
  [[ " $backends " == *" npu "* ]] ||
    fail "torch_npu is there but the npu backend was not built (backends: $backends)"
  echo "[install] done: installed with the npu backend"
else
  echo "[install] done: not an Ascend machine: installed, npu backend not built" \
    "(backends: $backends)"
fi
rm -f "$log"
