#!/usr/bin/env bash
# Open the UIs on the project's own state (127.0.0.1 only).
#   bash infra/ui.sh mlflow    MLflow UI on http://127.0.0.1:5000 over .opd/mlflow.db
#   bash infra/ui.sh prefect   Prefect server + UI on http://127.0.0.1:4200 with PREFECT_HOME=.opd/prefect
#   PORT=4300 bash infra/ui.sh prefect   another port: the UI's API calls go to that port too
set -euo pipefail
cd "$(dirname "$0")/.."
source infra/python.sh
STATE="${OPD_HOME:-$PWD/.opd}"
mkdir -p "$STATE/prefect"
case "${1:-}" in
  mlflow)
    export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
    exec mlflow ui --backend-store-uri "${MLFLOW_TRACKING_URI:-sqlite:///$STATE/mlflow.db}" \
      --default-artifact-root "$STATE/mlartifacts" --host 127.0.0.1 --port "${PORT:-5000}" --workers 1 ;;
  prefect)
    # The page asks /ui-settings where the API is: left alone, that is PREFECT_API_URL (a shell may still hold another
    # server's) or the default port 4200, whatever --port says. Both follow the port actually served.
    port="${PORT:-4200}"
    export PREFECT_HOME="$STATE/prefect" PREFECT_SERVER_ANALYTICS_ENABLED=false
    export PREFECT_API_URL="http://127.0.0.1:$port/api" PREFECT_UI_API_URL="http://127.0.0.1:$port/api"
    exec prefect server start --host 127.0.0.1 --port "$port" ;;
  *) echo "usage: bash infra/ui.sh mlflow|prefect" >&2; exit 2 ;;
esac
