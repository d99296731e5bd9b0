#!/usr/bin/env bash
# The GPU check: on one CUDA GPU, in under 8 minutes, the quick profile's base, specialists and merge with every
# model on the GPU in bf16, the same merge again with vLLM rollouts (weight sync after every step) and vLLM-served
# teachers, and our OPD step against TRL's DistillationTrainer on the same GPU. It ends with a summary: each phase's
# result, retention per route of each merge, the vLLM-vs-transformers parity gaps and the tokens/s ratio to TRL.
#
# Run on any machine with one CUDA GPU, from the checkout (no edits needed):
#   pip install -e '.[vllm,bench]'          # after a CUDA build of torch, as for any GPU install
#   bash infra/gpu-check.sh                 # about 5-8 minutes; exit 0 only when every phase passed
#   bash infra/gpu-check.sh --dry-run       # print the commands, and which phases it would skip and why; run none
#   bash infra/gpu-check.sh --fresh         # forget an earlier check's base and specialists (else they are reused)
#
# Phases, each under `timeout`, all within GPU_CHECK_BUDGET seconds (default 450):
#   env       installs .whl/ if there is one; the GPU torch sees, and which packages import (the project's, trl, vllm)
#   pipeline  python3 -m flows.pipeline --profile quick: base, 3 specialists and their merge, every model on cuda in
#             bf16 (mixed precision for the trained ones), transformers rollouts and teachers
#   trl       python3 -m flows.bench.trl on the GPU in bf16: our OPD step's tokens/s over TRL's trainer's, one run
#   vllm      python3 -m flows.merge --profile quick on the pipeline's base and teachers, student on cuda in bf16,
#             rollouts from a vLLM engine synced after every step, every teacher scored by vLLM
# A phase that cannot run is skipped with the reason (no GPU, a package that does not import, a phase it needs that
# failed, the budget spent); the others still run. Exit: 0 every phase passed, 1 a phase failed, 3 none failed but
# one was skipped, 2 a bad argument.
#
# State: its own folder, GPU_CHECK_HOME (default .opd/gpu-check): OPD_HOME, the MLflow store
# (MLFLOW_TRACKING_URI=sqlite:///<it>/mlflow.db: experiments opd-merge and opd-bench), PREFECT_HOME and Prefect's
# results (a temporary Prefect server per flow: no server needed), and each phase's output in logs/. A second run
# reuses the base and specialists (Prefect's cache) and starts both merges over.
#
# Machines where nothing can be installed (this workplace's GPU machine has torch, transformers, peft, accelerate and
# safetensors, but not prefect, mlflow, datasets, pydantic, trl or vllm): carry the missing packages as wheels in
# .whl/ at the repository root; this script installs them first (pip --no-index --no-deps --target). Here, on a
# machine that reaches a package index:
#   echo /.whl/ >> .git/info/exclude
#   bash infra/gpu-check.sh --fetch-wheels   # the 107 wheels that image lacks (Python 3.12, x86-64), 54 MiB
# then run `bash infra/gpu-check.sh` there with .whl carried (about 5 MiB of checkout beside it: under the 64 MiB a
# call takes). vllm cannot travel that way (its CUDA wheel is hundreds of MB): without it the vllm phase is skipped.
set -uo pipefail  # no -e: a phase that fails is reported and the next one still runs

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-python3}"
DRY=0 FRESH=0 FETCH=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --fresh) FRESH=1 ;;
    --fetch-wheels) FETCH=1 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument '$arg' (expected --dry-run, --fresh, --fetch-wheels or --help)" >&2; exit 2 ;;
  esac
done

# What this workplace's CUDA image (its 'cuda' image, Python 3.12) lacks of the project's and TRL's dependencies,
# resolved for prefect 3.9.1, mlflow 3.17.2, datasets 5.2.0, pydantic 2.13.4, math-verify 0.9.0 and trl 1.16.0
# (2026-12). Left out: asyncpg, Prefect's Postgres driver (3.6 MiB; the check's Prefect database is sqlite).
MISSING_ON_CUDA_IMAGE="aiosqlite==0.22.1 alembic==1.20.1 amplitude-analytics==1.3.0 annotated-types==0.8.0
antlr4-python3-runtime==4.13.2 apprise==2.0.1 asgi-lifespan==2.1.0 beartype==0.23.1 blinker==1.9.0
burner-redis==0.1.7 cachetools==7.3.3 cffi==2.1.1 coolname==5.0.0 cronsim==2.8 cryptography==50.0.2 cyclopts==5.5.2
databricks-sdk==0.167.0 datasets==5.2.0 dateparser==1.5.0 dill==0.4.1 docker==7.2.0 docstring-parser==0.18.0
exceptiongroup==1.3.2 fastapi==0.150.0 flask==3.1.3 flask-cors==6.0.5 gitdb==4.0.12 gitpython==3.2.1
google-auth==2.63.0 graphene==3.4.3 graphql-core==3.2.14 graphql-relay==3.2.0 graphviz==0.21 greenlet==3.5.6
griffe==2.4.1 griffecli==2.4.1 griffelib==2.4.1 gunicorn==26.2.0 h2==4.4.1 hpack==4.2.0 httpcore2==2.16.2
httpx2==2.16.2 huey==3.5.4 hyperframe==6.1.0 importlib-metadata==9.1.0 itsdangerous==2.2.0
jinja2-humanize-extension==0.4.0 jsonpatch==1.48 jsonpointer==3.12 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 latex2sympy2-extended==1.11.0 mako==1.4.3 math-verify==0.9.0 mlflow==3.17.2
mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 multiprocess==0.70.19 oauthlib==4.0.1 opentelemetry-api==1.45.2
opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 orjson==3.13.0
pendulum==3.3.0 prefect==3.9.1 prettytable==3.19.0 py-key-value-aio==0.5.0 pyasn1==0.6.5 pyasn1-modules==0.4.2
pycparser==3.12 pydantic==2.13.4 pydantic-core==2.46.4 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3
pydocket==0.27.2 python-dotenv==1.2.4 python-json-logger==4.2.0 python-slugify==9.1.3 pytz==2026.6 readchar==4.2.2
redis==8.1.0 referencing==0.37.0 requests-oauthlib==2.0.0 rfc3339-validator==0.1.4 rich-rst==2.2.0
rpds-py==2026.9.1 ruamel-yaml==0.19.1 semver==3.1.2 skops==0.16.0 smmap==5.0.3 sniffio==1.3.1 sqlalchemy==2.1.9
sqlparse==0.6.1 starlette==1.10.0 text-unidecode==1.3 toml==0.10.2 trl==1.16.0 truststore==0.10.5
typing-inspection==0.4.5 tzdata==2026.6 tzlocal==5.4.5 uncalled-for==0.6.2 uvicorn==0.55.0 wcwidth==0.9.4
websockets==16.1.1 whenever==0.11.0"

if (( FETCH )); then
  # pip matches manylinux tags exactly: every level these wheels are published for is named.
  plats=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do plats+=(--platform "$p"); done
  # shellcheck disable=SC2086  # the list is split into words on purpose
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
    -d "$ROOT/.whl" $MISSING_ON_CUDA_IMAGE || exit 1
  echo "$(ls "$ROOT"/.whl/*.whl | wc -l) wheels, $(du -sm "$ROOT/.whl" | cut -f1) MiB in $ROOT/.whl"
  exit 0
fi

# --- the check's own state and environment: nothing of .opd, ~/.prefect or a running stack is read or written
STATE="${GPU_CHECK_HOME:-$ROOT/.opd/gpu-check}"
LOGS="$STATE/logs"
(( DRY )) && LOGS="$(mktemp -d)"  # a dry run leaves the state folder alone
BUDGET="${GPU_CHECK_BUDGET:-450}"  # seconds for everything; a phase starts only with MIN_PHASE seconds left
MIN_PHASE="${GPU_CHECK_MIN_PHASE:-30}"
SITE="${GPU_CHECK_SITE:-/tmp/opd-gpu-check-site}"  # where .whl/ is installed (outside the tree)
export OPD_HOME="$STATE"
export MLFLOW_TRACKING_URI="sqlite:///$STATE/mlflow.db" MLFLOW_DISABLE_TELEMETRY=true
export PREFECT_HOME="$STATE/prefect" PREFECT_RESULTS_LOCAL_STORAGE_PATH="$STATE/prefect/storage"
export PREFECT_LOCAL_STORAGE_PATH="$STATE/prefect/storage"
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW=ignore
unset PREFECT_API_URL  # a temporary server per flow, never a stack this shell may point at
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# --- the phases' commands (tests/test_infra_scale.py validates each against its flow's config)
ON_GPU=(--opd.device cuda --opd.dtype bf16 --opd.teacher_device cuda --opd.teacher_dtype bf16 --opd.resume false)
PIPELINE=("$PY" -m flows.pipeline --profile quick
          --base_train.device cuda --base_train.dtype bf16 --specialist_train.device cuda --specialist_train.dtype bf16
          "${ON_GPU[@]}")
TRL_BENCH=("$PY" -m flows.bench.trl --device cuda --dtype bf16 --shapes 256x4x4,512x6x8 --batch_size 32
           --max_new_tokens 32 --warmup 2 --steps 6)
# Four engines share the GPU (the rollout engine and one per teacher), each with this share of its memory. They
# compute in bf16, as GPU engines are run; the preflight checks each against the fp32 transformers forward, so the
# tolerance is half precision's (tasks/modeling/engines.py: HALF_PARITY_TOL; the config refuses less).
VLLM_MERGE=("$PY" -m flows.merge --profile quick "${ON_GPU[@]}"
            --opd.rollout_backend vllm --opd.teacher_backend vllm --opd.vllm_dtype bf16
            --opd.vllm_gpu_memory_utilization 0.12 --opd.parity_tol "${GPU_CHECK_PARITY_TOL:-0.1}"
            --label gpu-check-vllm)
declare -A CAP=([env]=150 [pipeline]=200 [trl]=90 [vllm]=220)  # seconds each phase may take at most
PHASES=(env pipeline trl vllm)
PROJECT_MODULES=(pydantic transformers tokenizers safetensors peft datasets prefect mlflow matplotlib math_verify)

declare -A RESULT WHY SECS MOD_OK MOD_WHY
T0=$SECONDS
START_MS=$(( $(date +%s) * 1000 ))
(( FRESH && ! DRY )) && rm -rf "$STATE"
mkdir -p "$LOGS"

quoted() {  # the command as one would type it: words that need it in single quotes
  local out="" a
  for a in "$@"; do
    [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]] || a="'${a//\'/\'\\\'\'}'"
    out+="${out:+ }$a"
  done
  printf '%s' "$out"
}

skip() {  # phase, reason
  RESULT[$1]=skipped WHY[$1]="$2" SECS[$1]=0
  if (( DRY )); then echo "[dry-run] $1: would skip: $2"; else echo "== [$1] skipped: $2"; fi
}

run_phase() {  # phase, command...: under `timeout`, its output to logs/PHASE.log and (progress bars folded) stdout
  local name="$1"; shift
  if (( DRY )); then echo "[dry-run] $name: $(quoted "$@")"; RESULT[$name]=dry-run; return; fi
  local left=$(( BUDGET - (SECONDS - T0) )) limit=${CAP[$name]} t=$SECONDS rc last
  (( left < limit )) && limit=$left
  if (( limit < MIN_PHASE )); then skip "$name" "no time left: ${left}s of GPU_CHECK_BUDGET=${BUDGET}s remain"; return; fi
  echo "== [$name] $(quoted "$@")   (limit ${limit}s)"
  # timeout signals its whole process group: vLLM's engine processes and torchrun's ranks stop with the flow.
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | awk -F'\r' '{ n = NF; while (n > 1 && $n == "") n--; print $n; fflush() }'
  rc=${PIPESTATUS[0]}
  SECS[$name]=$(( SECONDS - t ))
  if (( rc == 0 )); then
    RESULT[$name]=ok WHY[$name]="log: $LOGS/$name.log"
  elif (( rc == 124 || rc == 137 )); then
    RESULT[$name]=failed WHY[$name]="timed out after ${limit}s (log: $LOGS/$name.log)"
  else
    last=$(grep -E '^(error:|[A-Za-z_.]*(Error|Exception)\b)' "$LOGS/$name.log" | tail -1 | cut -c1-300)
    RESULT[$name]=failed WHY[$name]="exit $rc${last:+: $last} (log: $LOGS/$name.log)"
  fi
}

probe() {  # fills MOD_OK / MOD_WHY for 'gpu' and each module; one line each, printed as it goes, so a crash in one
  # import (a broken CUDA library, say) keeps the lines before it
  local out="$LOGS/probe.tsv" name state text rc
  timeout --kill-after=10 "${CAP[env]}" "$PY" - "${PROJECT_MODULES[@]}" trl vllm >"$out" 2>"$LOGS/probe.err" <<'PYTHON'
import importlib
import sys


def line(name, ok, text):
    print(name, "ok" if ok else "missing", " ".join(str(text).split())[:240], sep="\t", flush=True)


try:
    import torch

    if torch.cuda.is_available():
        line("gpu", True, f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        line("gpu", False, f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)")
except Exception as e:
    line("gpu", False, f"torch does not import ({type(e).__name__}: {e})")
for mod in sys.argv[1:]:
    try:
        line(mod, True, getattr(importlib.import_module(mod), "__version__", "?"))
    except Exception as e:
        line(mod, False, f"{type(e).__name__}: {e}")
PYTHON
  rc=$?
  while IFS=$'\t' read -r name state text; do MOD_OK[$name]=$state MOD_WHY[$name]=$text; done <"$out"
  echo "== [env] the GPU, and what imports (PYTHONPATH=$PYTHONPATH)"
  for name in gpu "${PROJECT_MODULES[@]}" trl vllm; do
    if [[ -z "${MOD_OK[$name]:-}" ]]; then
      MOD_OK[$name]=missing
      MOD_WHY[$name]="the import probe ended (exit $rc) before it got here: $(tail -1 "$LOGS/probe.err")"
    fi
    printf '   %-12s %-8s %s\n' "$name" "${MOD_OK[$name]}" "${MOD_WHY[$name]}"
  done
}

needs() {  # modules...: why a phase that needs the GPU and these modules cannot run (empty when it can)
  local mod
  if [[ "${MOD_OK[gpu]}" != ok ]]; then echo "no GPU: ${MOD_WHY[gpu]}"; return; fi
  for mod in "$@"; do
    [[ "${MOD_OK[$mod]}" == ok ]] && continue
    case "$mod" in
      vllm) echo "vllm does not import (${MOD_WHY[$mod]}): pip install -e '.[vllm]' (the CUDA wheel: hundreds of MB, too big to carry in .whl/)" ;;
      trl) echo "trl does not import (${MOD_WHY[$mod]}): pip install -e '.[bench]', or carry its wheel in .whl/" ;;
      *) echo "$mod does not import (${MOD_WHY[$mod]}): pip install -e ., or carry the wheels in .whl/ (bash infra/gpu-check.sh --fetch-wheels)" ;;
    esac
    return
  done
}

attempt() {  # phase, why-not (empty: run it), command...
  local name="$1" why="$2"; shift 2
  if [[ -z "$why" ]]; then run_phase "$name" "$@"; return; fi
  skip "$name" "$why"
  (( DRY )) && echo "[dry-run] $name: $(quoted "$@")"
}

report() {  # this check's merges in MLflow (runs started after it began): retention per route, parity gaps
  timeout 90 "$PY" - "$START_MS" <<'PYTHON'
import sys

from mlflow.tracking import MlflowClient

client = MlflowClient()
exp = client.get_experiment_by_name("opd-merge")
found = [] if exp is None else client.search_runs(
    [exp.experiment_id], f"attributes.start_time >= {sys.argv[1]}", order_by=["attributes.start_time ASC"])
for run in found:
    p, m = run.data.params, run.data.metrics
    print(f"merge {run.info.run_name} ({run.info.status.lower()}): student {p.get('opd.device')}/{p.get('opd.dtype')}, "
          f"teachers {p.get('opd.teacher_device')}/{p.get('opd.teacher_dtype')}, rollouts {p.get('opd.rollout_backend')}, "
          f"teacher scoring {p.get('opd.teacher_backend')}, {p.get('opd.steps')} steps")
    routes = sorted(k.split("/", 1)[1] for k in m if k.startswith("retention/") and k != "retention/mean")
    if routes:
        print(f"  retention: mean {m.get('retention/mean', float('nan')):.3f}; "
              + ", ".join(f"{r} {m['retention/' + r]:.3f}" for r in routes))
    parity = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("parity/")}
    if parity:
        print("  parity, max |log p| gap to the transformers forward: "
              + ", ".join(f"{k} {v:.2g}" for k, v in sorted(parity.items())))
if not found:
    print("(no merge of this check in MLflow)")
PYTHON
}

# --- env: the wheels, the GPU, the imports
t=$SECONDS
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
  INSTALL=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE")
  if (( DRY )); then
    echo "[dry-run] wheels: $(quoted "${INSTALL[@]}") .whl/*.whl   ($(ls "$ROOT"/.whl/*.whl | wc -l) wheels)"
  else
    echo "== [env] installing $(ls "$ROOT"/.whl/*.whl | wc -l) wheels from .whl/ into $SITE"
    "${INSTALL[@]}" "$ROOT"/.whl/*.whl 2>&1 | tail -5
  fi
  export PYTHONPATH="$ROOT:$SITE${PYTHONPATH#"$ROOT"}"
fi
probe
SECS[env]=$(( SECONDS - t ))
if [[ "${MOD_OK[gpu]}" == ok ]]; then RESULT[env]=ok WHY[env]="${MOD_WHY[gpu]}"
else RESULT[env]=failed WHY[env]="${MOD_WHY[gpu]}"; fi

# --- the phases, cheapest first that others need; the vLLM merge takes what is left of the budget
attempt pipeline "$(needs "${PROJECT_MODULES[@]}")" "${PIPELINE[@]}"
attempt trl "$(needs "${PROJECT_MODULES[@]}" trl)" "${TRL_BENCH[@]}"
why="$(needs "${PROJECT_MODULES[@]}" vllm)"
if [[ -z "$why" && "${RESULT[pipeline]}" != ok && "${RESULT[pipeline]}" != dry-run ]]; then
  why="it merges the pipeline phase's base and teachers, and that phase ${RESULT[pipeline]}"
fi
attempt vllm "$why" "${VLLM_MERGE[@]}"
(( DRY )) && { rm -rf "$LOGS"; exit 0; }

# --- the summary
echo
echo "================================ GPU check summary ================================"
echo "machine: ${MOD_WHY[gpu]}"
echo "state:   $STATE (MLflow: $MLFLOW_TRACKING_URI)"
printf '%-9s %-8s %7s  %s\n' phase result seconds detail
for name in "${PHASES[@]}"; do printf '%-9s %-8s %7s  %s\n' "$name" "${RESULT[$name]}" "${SECS[$name]}" "${WHY[$name]}"; done
if [[ "${MOD_OK[mlflow]}" == ok && -f "$STATE/mlflow.db" ]]; then
  echo "--- the merges, from MLflow:"
  report 2>"$LOGS/report.err" || echo "(the MLflow report failed: $(tail -1 "$LOGS/report.err"))"
fi
if [[ "${RESULT[trl]}" == ok ]]; then
  echo "--- our OPD step against TRL's trainer (flows.bench.trl, one run):"
  grep -E 'vs TRL .*DistillationTrainer|/TRL tokens per second' "$LOGS/trl.log"
fi
echo "total: $(( SECONDS - T0 ))s (GPU_CHECK_BUDGET=${BUDGET}s)"
failed="" skipped=""
for name in "${PHASES[@]}"; do
  [[ "${RESULT[$name]}" == failed ]] && failed+="$name "
  [[ "${RESULT[$name]}" == skipped ]] && skipped+="$name "
done
if [[ -n "$failed" ]]; then echo "GPU check FAILED: ${failed}(exit 1)"; exit 1; fi
if [[ -n "$skipped" ]]; then echo "GPU check incomplete, skipped: ${skipped}(exit 3)"; exit 3; fi
echo "GPU check passed: every phase ran"
