# Two commands do everything on a fresh machine:
#   make main   install, then run the main job (the whole pipeline, default profile) on the built-in world
#   make test   install, then run the test suite (what .ci/run calls)
PY ?= python3
PIP = $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup main quick test ui-prefect ui-mlflow clean-state

setup:
	$(PIP) install torch==2.13.0          # first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(PIP) install -e ".[dev]"

main: setup
	$(PY) -m flows.pipeline

quick: setup
	$(PY) -m flows.pipeline --profile quick

test: setup
	$(PY) -m pytest

ui-mlflow:
	bash infra/ui.sh mlflow

ui-prefect:
	bash infra/ui.sh prefect

clean-state:
	rm -rf .opd
