#!/usr/bin/env bash
# The local stack, on 127.0.0.1 unless OPD_HOST says otherwise: a Prefect server (API + UI), a process work pool with
# one worker, and an MLflow tracking server (API + UI + artifact proxy). Every bit of state stays under $OPD_HOME
# (default <repo>/.opd): the Prefect and MLflow databases, artifacts, logs and pid files (in .opd/stack/).
#
#   bash infra/stack.sh up       start all three, deploy infra/prefect.yaml, print the URLs (about a minute)
#   bash infra/stack.sh down     stop everything `up` started
#   bash infra/stack.sh status   what runs, where
#   bash infra/stack.sh deploy   (re)apply infra/prefect.yaml to the running server
#   eval "$(bash infra/stack.sh env)"   point this shell's prefect/mlflow/python at the stack
#
# Ports: PREFECT_PORT (4200), MLFLOW_PORT (5000); the Prefect UI calls its API on PREFECT_PORT (PREFECT_UI_API_URL).
# Work pool: OPD_WORK_POOL (opd-local).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STATE="${OPD_HOME:-$ROOT/.opd}"
RUN="$STATE/stack"
HOST="${OPD_HOST:-127.0.0.1}"
PREFECT_PORT="${PREFECT_PORT:-4200}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
POOL="${OPD_WORK_POOL:-opd-local}"
source "$ROOT/infra/python.sh"
START_TIMEOUT="${OPD_STACK_TIMEOUT:-180}"

stack_env() {
  cat <<EOF
export OPD_HOME="$STATE" OPD_REPO_ROOT="$ROOT" OPD_WORK_POOL="$POOL"
export PREFECT_HOME="$STATE/prefect" PREFECT_API_URL="http://$HOST:$PREFECT_PORT/api"
export PREFECT_UI_API_URL="http://$HOST:$PREFECT_PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_WORKER_QUERY_SECONDS=2 PREFECT_RUNNER_POLL_FREQUENCY=2
export PREFECT_RESULTS_LOCAL_STORAGE_PATH="$STATE/prefect/storage"
export MLFLOW_TRACKING_URI="http://$HOST:$MLFLOW_PORT" OPD_MLFLOW_UI="http://$HOST:$MLFLOW_PORT"
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false MLFLOW_DISABLE_TELEMETRY="${MLFLOW_DISABLE_TELEMETRY:-true}"
EOF
}
eval "$(stack_env)"

alive() { [[ -f "$RUN/$1.pid" ]] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

start() {  # name, command...: its own session (so `down` stops its children too), output to .opd/stack/NAME.log
  local name="$1"; shift
  if alive "$name"; then echo "$name already running (pid $(cat "$RUN/$name.pid"))"; return 0; fi
  setsid "$@" >"$RUN/$name.log" 2>&1 </dev/null &
  echo $! >"$RUN/$name.pid"
}

wait_http() {  # name, url: until it answers 200, or its process died, or the timeout
  local name="$1" url="$2" t0=$SECONDS
  until curl -sf -o /dev/null "$url"; do
    if ! alive "$name"; then echo "error: $name exited; last lines of $RUN/$name.log:" >&2; tail -20 "$RUN/$name.log" >&2; exit 1; fi
    if (( SECONDS - t0 > START_TIMEOUT )); then echo "error: $name not healthy at $url after ${START_TIMEOUT}s" >&2; exit 1; fi
    sleep 1
  done
  echo "$name healthy after $((SECONDS - t0))s: $url"
}

port_free() {
  if curl -s -o /dev/null --max-time 2 "http://$HOST:$1/"; then
    echo "error: something already answers on $HOST:$1 (set ${2}=another port, or stop it)" >&2; exit 1
  fi
}

deploy() {
  (cd "$ROOT" && prefect --no-prompt deploy --all --prefect-file infra/prefect.yaml) >"$RUN/deploy.log" 2>&1 || {
    echo "error: prefect deploy failed; see $RUN/deploy.log" >&2; tail -30 "$RUN/deploy.log" >&2; exit 1; }
  echo "deployed: $(grep -o "Deployment '[^']*'" "$RUN/deploy.log" | sort -u | tr '\n' ' ')"
}

up() {
  mkdir -p "$RUN" "$STATE/prefect" "$STATE/mlartifacts"
  alive prefect-server || port_free "$PREFECT_PORT" PREFECT_PORT
  alive mlflow-server || port_free "$MLFLOW_PORT" MLFLOW_PORT
  start prefect-server prefect server start --host "$HOST" --port "$PREFECT_PORT"
  start mlflow-server mlflow server --backend-store-uri "sqlite:///$STATE/mlflow.db" \
    --artifacts-destination "$STATE/mlartifacts" --host "$HOST" --port "$MLFLOW_PORT" --workers 1
  wait_http prefect-server "http://$HOST:$PREFECT_PORT/api/health"
  prefect --no-prompt work-pool inspect "$POOL" >/dev/null 2>&1 || prefect --no-prompt work-pool create "$POOL" --type process >/dev/null
  start worker prefect worker start --pool "$POOL" --type process --name "$POOL-worker"
  deploy
  wait_http mlflow-server "http://$HOST:$MLFLOW_PORT/health"
  sleep 1
  alive worker || { echo "error: the worker exited; see $RUN/worker.log" >&2; tail -20 "$RUN/worker.log" >&2; exit 1; }
  echo "Prefect UI  http://$HOST:$PREFECT_PORT   (deployments: http://$HOST:$PREFECT_PORT/deployments)"
  echo "MLflow UI   http://$HOST:$MLFLOW_PORT"
  echo "work pool   $POOL (process worker, logs in $RUN/worker.log)"
  echo "state       $STATE      stop with: bash infra/stack.sh down"
}

down() {
  local name pid
  for name in worker mlflow-server prefect-server; do
    [[ -f "$RUN/$name.pid" ]] || continue
    pid="$(cat "$RUN/$name.pid")"
    if kill -0 "$pid" 2>/dev/null; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -KILL -- "-$pid" 2>/dev/null || true
      echo "stopped $name (pid $pid)"
    fi
    rm -f "$RUN/$name.pid"
  done
}

status() {
  local name
  for name in prefect-server mlflow-server worker; do
    if alive "$name"; then echo "$name: running (pid $(cat "$RUN/$name.pid"))"; else echo "$name: stopped"; fi
  done
  echo "Prefect http://$HOST:$PREFECT_PORT  MLflow http://$HOST:$MLFLOW_PORT  state $STATE"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  deploy) deploy ;;
  env) stack_env ;;
  *) echo "usage: bash infra/stack.sh up|down|status|deploy|env" >&2; exit 2 ;;
esac
