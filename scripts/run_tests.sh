#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite.
# Extra arguments go to pytest, e.g. the fast subset (unit tests, a few
# minutes): bash scripts/run_tests.sh -m "not e2e and not packaging"
#
# Caches (reused between runs): pip's (~/.cache/pip), and the tests' own
# (~/.cache/vllm-ascend-kv-offload: upstream vllm-ascend's sdist, vLLM
# 0.33.0's wheel and its unpacked offloading packages, the scratch venv of the
# packaging tests, about 3 GB in all). VLLM_ASCEND_KV_OFFLOAD_CACHE=DIR moves
# both: the tests' cache to DIR, pip's to DIR/pip (unless PIP_CACHE_DIR is set).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n ${VLLM_ASCEND_KV_OFFLOAD_CACHE:-} ]]; then
  export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$VLLM_ASCEND_KV_OFFLOAD_CACHE/pip}
fi
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source "${VLLM_ASCEND_VENV:-.venv}/bin/activate"
set +e
python -m pytest -ra "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit $rc
