#!/usr/bin/env bash
# One machine of a merge whose student is sharded over several machines (FSDP over torchrun's c10d rendezvous; see
# tasks/training/launch.py). Every machine runs this, from a checkout of the same commit, with cluster.env's settings
# (above all OPD_HOME on a filesystem they all mount, and the same MLFLOW_TRACKING_URI):
#
#   bash infra/scale/merge-node.sh head [FLOW FLAGS...]
#       the head machine: python -m flows.merge FLOW FLAGS --opd.nnodes N --opd.nproc N*G
#       --opd.rdzv_endpoint HOST:PORT. The merge writes its job to $OPD_HOME/jobs/<run id>/, starts this machine's
#       torchrun and waits at the rendezvous for the others.
#   bash infra/scale/merge-node.sh worker
#       every other machine: waits for that job to appear, then runs
#       torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id <run id>
#           -m tasks.training.launch $OPD_HOME/jobs/<run id>
#   Under Slurm (merge.sbatch) the role may be left out: node 0 of the job (SLURM_NODEID) is the head.
#
# The head may also be a flow run of a deployment (the opd-gpu pool's worker on that machine) with the same opd.*
# parameters; the workers do not care how its merge started.
#
# Settings, from the environment (cluster.env holds the shared ones):
#   OPD_NNODES          machines in the job (N)
#   OPD_NPROC_PER_NODE  processes per machine, one per GPU (G)
#   OPD_RDZV_HOST       the head as the other machines reach it; OPD_RDZV_PORT its rendezvous port (29500)
#   OPD_RUN_ID          a worker: join the job of this MLflow run id (a resumed merge keeps its run id)
#   OPD_JOB_AFTER       a worker without OPD_RUN_ID: join the first job written after this file's time (merge.sbatch
#                       touches one before it starts the nodes); default: after this script started
#   OPD_JOB_WAIT        seconds a worker waits for the job (1800)
#   PY, TORCHRUN        the Python and torchrun to run (python3, torchrun)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
# shellcheck source=cluster.env
source "$ROOT/infra/scale/cluster.env"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # every rank imports the project from this checkout
PY="${PY:-python3}"
TORCHRUN="${TORCHRUN:-torchrun}"

role=""
case "${1:-}" in
  head|worker) role="$1"; shift ;;
esac
if [[ -z "$role" ]]; then
  [[ -n "${SLURM_NODEID:-}" ]] || { echo "error: say head or worker (or run it under Slurm: node 0 is the head)" >&2; exit 2; }
  if [[ "$SLURM_NODEID" == 0 ]]; then role=head; else role=worker; fi
fi
NNODES="${OPD_NNODES:?OPD_NNODES: the number of machines in the job}"
NPROC="${OPD_NPROC_PER_NODE:?OPD_NPROC_PER_NODE: processes per machine, one per GPU}"
ENDPOINT="${OPD_RDZV_HOST:?OPD_RDZV_HOST: the head machine as the others reach it}:$OPD_RDZV_PORT"
if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ && "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  echo "error: OPD_NNODES ($NNODES) and OPD_NPROC_PER_NODE ($NPROC) must be positive integers" >&2; exit 2
fi

if [[ "$role" == head ]]; then
  echo "head of $NNODES machine(s) x $NPROC process(es), rendezvous at $ENDPOINT, state $OPD_HOME"
  exec "$PY" -m flows.merge "$@" --opd.nnodes "$NNODES" --opd.nproc "$(( NNODES * NPROC ))" \
    --opd.rdzv_endpoint "$ENDPOINT"
fi

jobs="$OPD_HOME/jobs"
mkdir -p "$jobs"
marker="${OPD_JOB_AFTER:-}"
own_marker=""
if [[ -z "${OPD_RUN_ID:-}" && -z "$marker" ]]; then
  own_marker="$(mktemp "$jobs/.node-$(hostname)-XXXXXX")"  # its time, as the shared filesystem keeps it
  marker="$own_marker"
fi
find_job() {  # the folder of the job to join, or nothing yet
  if [[ -n "${OPD_RUN_ID:-}" ]]; then
    [[ -f "$jobs/$OPD_RUN_ID/job.pkl" ]] && echo "$jobs/$OPD_RUN_ID"
    return 0
  fi
  find "$jobs" -mindepth 2 -maxdepth 2 -name job.pkl -newer "$marker" -printf '%T@ %h\n' 2>/dev/null \
    | sort -n | tail -n 1 | cut -d' ' -f2-
}
echo "worker: waiting up to ${OPD_JOB_WAIT}s for the head's job in $jobs (rendezvous $ENDPOINT)"
waited=0
until job="$(find_job)"; [[ -n "$job" ]]; do
  if (( waited >= OPD_JOB_WAIT )); then
    [[ -n "$own_marker" ]] && rm -f "$own_marker"
    echo "error: no job in $jobs after ${OPD_JOB_WAIT}s: is the head's merge running, with OPD_HOME=$OPD_HOME on the same shared filesystem?" >&2
    exit 1
  fi
  sleep 2
  waited=$(( waited + 2 ))
done
[[ -n "$own_marker" ]] && rm -f "$own_marker"
run_id="$(basename "$job")"
echo "worker: joining the job of MLflow run $run_id"
exec "$TORCHRUN" --nnodes "$NNODES" --nproc-per-node "$NPROC" --rdzv-backend c10d --rdzv-endpoint "$ENDPOINT" \
  --rdzv-id "$run_id" -m tasks.training.launch "$job"
