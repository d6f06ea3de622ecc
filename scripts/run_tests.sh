#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite.
# Extra arguments go to pytest (e.g. `-m "not e2e"` for the fast tests only).
set -euo pipefail
cd "$(dirname "$0")/.."
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
