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
# shellcheck disable=SC1091
source "$(dirname "$0")/setup_env.sh" # cds to the checkout, activates the venv
rc=0
# Two workers, each taking whole modules (pyproject.toml): on two cores one
# engine's start-up, mostly imports, overlaps another's. `-n 0`: one process.
python -m pytest -ra -n 2 "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit $rc
