#!/usr/bin/env bash
# One-shot check of the "cuda" backend of swap_blocks_batch on a machine with
# an NVIDIA GPU and a CUDA torch, but no vLLM and no network (the lent H200;
# docs/cuda_backend.md says how to start it there). About 5 minutes:
#   1. build vllm_ascend/kv_offload/_C_kv_offload in place with the cuda
#      backend: `python setup.py build_ext --inplace`, setup.py's CMake build
#      (backend auto-detected; no other build path),
#   2. pytest tests/unit/test_swap_blocks_cuda.py and test_swap_blocks_op.py,
#   3. the copy benchmark on cuda, once per VLLM_ASCEND_CUDA_COPY_METHOD
#      (auto with --concurrent; kernel; dma),
#   4. the doctor (python -m vllm_ascend.kv_offload.doctor --device cuda) on a
#      Qwen3-0.6B-shaped config.json.
# Everything goes to $OUT (.cache/device_check_cuda when unset), at most 8 files:
#   summary.txt      versions, GPU, each step's exit status and time
#   build.log        the build
#   tests.log        both pytest runs
#   bench_auto.jsonl bench_kernel.jsonl bench_dma.jsonl   benchmark rows
#   bench.err        the benchmarks' stderr (and the doctor's)
#   doctor.json      the doctor's report (its lines also in summary.txt)
# Exit status: 0 when every step passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/.cache/device_check_cuda}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-16}
failed=0

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# step NAME LIMIT_S LOG CMD...: runs CMD with a time limit, appending to LOG.
step() {
  local name=$1 limit=$2 log=$3 start=$SECONDS rc
  shift 3
  echo "=== $name: $*" >>"$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  rc=$?
  note "$name: rc=$rc ($((SECONDS - start)) s)"
  return "$rc"
}

has_cuda_backend() {
  "$PY" -c "import torch; from vllm_ascend.kv_offload import ops; assert 'cuda' in ops.native_backends(), ops.native_backends()"
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"
  "$PY" -c "import setuptools; print('setuptools', setuptools.__version__)"
  command -v nvcc && nvcc --version | tail -1
  cmake --version | head -1
} >>"$OUT/summary.txt" 2>&1

# --- 1. build ----------------------------------------------------------------
# setup.py's CMake build (backend auto-detected), the one that pip runs, in
# place: nothing is installed on that machine (pip would also want the
# setuptools that pyproject.toml names, which it may not have).
rm -f vllm_ascend/kv_offload/_C_kv_offload*.so
step "build (setup.py build_ext --inplace)" 360 "$OUT/build.log" \
  "$PY" setup.py build_ext --inplace
if ! has_cuda_backend >>"$OUT/build.log" 2>&1; then
  note "FAILED: no build with the cuda backend; see build.log"
  exit 1
fi
note "backends: $("$PY" -c 'from vllm_ascend.kv_offload import ops; print(ops.native_backends())')"

# --- 2. tests ----------------------------------------------------------------
step "pytest test_swap_blocks_cuda.py" 240 "$OUT/tests.log" \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/test_swap_blocks_cuda.py ||
  failed=1
# test_native_op_can_be_disabled_by_env reloads ops.py without the native op,
# whose fallback warning imports vllm: not installed on that machine.
step "pytest test_swap_blocks_op.py" 120 "$OUT/tests.log" \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/test_swap_blocks_op.py \
  -k "not test_native_op_can_be_disabled_by_env" || failed=1
grep -E "passed|failed|error" "$OUT/tests.log" | tail -4 >>"$OUT/summary.txt"

# --- 3. benchmark --------------------------------------------------------------
# --descriptor-fragments 0 and --layout-blocks 0: those sections import vllm.
for method in auto kernel dma; do
  extra=()
  [[ $method == auto ]] && extra=(--concurrent)
  echo "=== method=$method" >>"$OUT/bench.err"
  start=$SECONDS
  VLLM_ASCEND_CUDA_COPY_METHOD=$method timeout 150 "$PY" -m \
    benchmarks.copy_benchmark --device cuda --json \
    --descriptor-fragments 0 --layout-blocks 0 "${extra[@]}" \
    >"$OUT/bench_$method.jsonl" 2>>"$OUT/bench.err"
  rc=$?
  note "benchmark method=$method: rc=$rc ($((SECONDS - start)) s)"
  [[ $rc -eq 0 ]] || failed=1
done
"$PY" - "$OUT" <<'EOF' >>"$OUT/summary.txt" 2>&1
import json, pathlib, sys

print("GB/s        dir       fragment  contiguous  loop   op(auto)  op(kernel)  op(dma)")
rows = {}
for method in ("auto", "kernel", "dma"):
    path = pathlib.Path(sys.argv[1], f"bench_{method}.jsonl")
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        if r.get("kind") == "copy":
            key = (r["direction"], r["fragment_bytes"])
            name = method if r["method"] == "op" else r["method"]
            rows.setdefault(key, {}).setdefault(name, r["gbps"])
for (direction, frag), g in rows.items():
    cells = [g.get(k) for k in ("contiguous", "loop", "auto", "kernel", "dma")]
    text = "  ".join(f"{c:9.1f}" if c is not None else "      n/a" for c in cells)
    print(f"            {direction:<9} {frag >> 10:>6} KiB  {text}")
EOF
# --- 4. doctor -----------------------------------------------------------------
# Checks that need no vLLM must pass (backends, copy path, the verified
# bandwidth table); vllm, platform, sizing and pool alloc import vLLM.
model=.cache/device_check_cuda_model
mkdir -p "$model"
cat >"$model/config.json" <<'EOF'
{"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16,
 "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 1024,
 "torch_dtype": "bfloat16"}
EOF
echo "=== doctor" >>"$OUT/bench.err"
start=$SECONDS
timeout 120 "$PY" -m vllm_ascend.kv_offload.doctor --device cuda --json \
  --model "$model" --bandwidth-mib 256 >"$OUT/doctor.json" 2>>"$OUT/bench.err"
note "doctor: rc=$? ($((SECONDS - start)) s; non-zero expected without vLLM)"
"$PY" - "$OUT/doctor.json" <<'EOF' >>"$OUT/summary.txt" 2>&1 || failed=1
import json, sys

report = json.load(open(sys.argv[1]))
for c in report["checks"]:
    print(f"doctor [{c['status']:^4}] {c['name']:<11} {c['summary'][:150]}")
    for line in c["lines"]:
        print(f"doctor {'':18}{line}")
need = {"backends", "copy path", "bandwidth"}
bad = [c["name"] for c in report["checks"] if c["name"] in need and c["status"] == "FAIL"]
# The op's cuda backend: "native:cuda", or "native-batch" with copy_paths.py.
if report["copy_path"] not in ("native:cuda", "native-batch"):
    bad.append(f"copy_path={report['copy_path']}")
print("doctor, checks that need no vLLM:", "FAILED " + ", ".join(bad) if bad else "passed")
sys.exit(1 if bad else 0)
EOF
note "done in $SECONDS s, failed=$failed"
exit "$failed"
