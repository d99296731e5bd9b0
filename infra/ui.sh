#!/usr/bin/env bash
# Open the UIs on the project's own state (127.0.0.1 only).
#   bash infra/ui.sh mlflow    MLflow UI on http://127.0.0.1:5000 over .opd/mlflow.db
#   bash infra/ui.sh prefect   Prefect server + UI on http://127.0.0.1:4200 with PREFECT_HOME=.opd/prefect
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${OPD_HOME:-$PWD/.opd}"
mkdir -p "$STATE/prefect"
case "${1:-}" in
  mlflow)
    export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
    exec mlflow ui --backend-store-uri "${MLFLOW_TRACKING_URI:-sqlite:///$STATE/mlflow.db}" \
      --default-artifact-root "$STATE/mlartifacts" --host 127.0.0.1 --port "${PORT:-5000}" --workers 1 ;;
  prefect)
    export PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false
    exec prefect server start --host 127.0.0.1 --port "${PORT:-4200}" ;;
  *) echo "usage: bash infra/ui.sh mlflow|prefect" >&2; exit 2 ;;
esac
