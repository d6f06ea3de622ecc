#!/usr/bin/env bash
# One-shot check on an NVIDIA GPU (e.g. a lent H200) that KV copies go
# through vLLM's own swap_blocks_batch (copy path "vllm-batch"); nothing of
# ours is built for cuda. Assumes a CUDA torch and a CUDA build of vLLM are
# installed; no network. About 3 minutes:
#   1. versions, the GPU, whether vLLM's op is registered,
#   2. the GPU-only unit tests (tests/unit/test_cuda_copy_path.py) and the
#      copy-path selection tests,
#   3. the doctor on cuda (copy path, self-check, bandwidth table),
#   4. the copy benchmark on cuda (op = vLLM's op; --concurrent, 10 repeats).
# Everything goes to $OUT (.cache/device_check_cuda when unset):
#   summary.txt   versions, GPU, each step's exit status and time, results
#   tests.log     pytest output
#   doctor.json   the doctor's report (its lines also in summary.txt)
#   bench.jsonl   benchmark rows; bench.err its stderr (and the doctor's)
# Exit status: 0 when every step passed, else 1.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/.cache/device_check_cuda}
mkdir -p "$OUT"
rm -f "$OUT/doctor.json" "$OUT/bench.jsonl" # one JSON report each, this run's
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=0

note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# Nothing below can pass without both; say so at once rather than spend
# device time on four failing steps. (This workplace's H200 image has no
# vLLM, and vLLM's CUDA wheel, 336 MB and pinned to another torch, cannot be
# carried there: docs/benchmarks.md.)
if ! "$PY" -c 'import torch, vllm; assert torch.cuda.is_available(), "no GPU"' 2>>"$OUT/summary.txt"; then
  note "FAILED: needs a CUDA GPU and a CUDA build of vLLM importable by $PY; nothing was checked"
  exit 1
fi

# step NAME LIMIT_S OUT ERR CMD...: runs CMD with a time limit, appending its
# output to OUT and its errors to ERR (they may be one file).
step() {
  local name=$1 limit=$2 out=$3 err=$4 start=$SECONDS rc
  shift 4
  echo "=== $name: $*" >>"$err"
  timeout "$limit" "$@" >>"$out" 2>>"$err"
  rc=$?
  note "$name: rc=$rc ($((SECONDS - start)) s)"
  return "$rc"
}

# --- 1. versions -----------------------------------------------------------------
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1
  "$PY" - <<'EOF'
import sys, torch, vllm
from vllm_ascend.kv_offload.copy_paths import Available, candidate_paths
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
      torch.version.cuda, "vllm", vllm.__version__, "gpu",
      torch.cuda.is_available() and torch.cuda.get_device_name())
print("vLLM swap_blocks_batch registered:", Available.here("cuda").vllm_swap is not None)
print("copy paths on cuda:", [p.name for p in candidate_paths("cuda")])
EOF
} >>"$OUT/summary.txt" 2>&1

# --- 2. tests --------------------------------------------------------------------
step "pytest (GPU-only + copy paths)" 240 "$OUT/tests.log" "$OUT/tests.log" \
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/test_cuda_copy_path.py \
  tests/unit/test_self_check.py tests/unit/test_submit_frames.py || failed=1
grep -E "passed|failed|error|SKIPPED" "$OUT/tests.log" | tail -6 >>"$OUT/summary.txt"

# --- 3. doctor -------------------------------------------------------------------
model=.cache/device_check_cuda_model
mkdir -p "$model"
cat >"$model/config.json" <<'EOF'
{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
 "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
 "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
 "vocab_size": 151936, "max_position_embeddings": 40960,
 "torch_dtype": "bfloat16"}
EOF
# Its verdict is the summary's below, which also requires the path vllm-batch.
step doctor 180 "$OUT/doctor.json" "$OUT/bench.err" "$PY" -m vllm_ascend.kv_offload.doctor \
  --device cuda --json --model "$model" --bandwidth-mib 256
"$PY" - "$OUT/doctor.json" <<'EOF' >>"$OUT/summary.txt" 2>&1 || failed=1
import json, sys

report = json.load(open(sys.argv[1]))
for c in report["checks"]:
    print(f"doctor [{c['status']:^4}] {c['name']:<11} {c['summary'][:150]}")
    for line in c["lines"]:
        print(f"doctor {'':18}{line}")
bad = [c["name"] for c in report["checks"] if c["status"] == "FAIL"]
if report.get("copy_path") != "vllm-batch":
    bad.append(f"copy_path={report.get('copy_path')}")
print("doctor:", "FAILED " + ", ".join(bad) if bad else "passed on vllm-batch")
sys.exit(1 if bad else 0)
EOF

# --- 4. benchmark ----------------------------------------------------------------
step "copy benchmark" 240 "$OUT/bench.jsonl" "$OUT/bench.err" \
  "$PY" -m benchmarks.copy_benchmark --device cuda --json --concurrent --repeats 10 || failed=1
"$PY" - "$OUT/bench.jsonl" <<'EOF' >>"$OUT/summary.txt" 2>&1 || failed=1
import json, pathlib, sys

rows = [json.loads(l) for l in pathlib.Path(sys.argv[1]).read_text().splitlines()]
print("GB/s  dir       fragment  contiguous      loop        op  op path")
for r in rows:
    if r.get("kind") == "copy" and r["method"] == "op":
        g = {x["method"]: x["gbps"] for x in rows if x.get("kind") == "copy"
             and (x["direction"], x["fragment_bytes"]) == (r["direction"], r["fragment_bytes"])}
        print(f"      {r['direction']:<9} {r['fragment_bytes'] >> 10:>6} KiB"
              f"  {g['contiguous']:10.1f}{g['loop']:10.1f}{g['op']:10.1f}  {r['op_path']}")
for r in rows:
    if r.get("kind") in ("descriptor_cost", "layout_job"):
        print(json.dumps(r))
ops = [r for r in rows if r.get("kind") == "copy" and r["method"] == "op"]
sys.exit(0 if ops and all(r["op_path"] == "vllm-batch" for r in ops) else 1)
EOF
note "done in $SECONDS s, failed=$failed"
exit "$failed"
