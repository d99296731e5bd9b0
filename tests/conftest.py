"""Test isolation: every pytest session gets its own project state (models, registry, MLflow store, Prefect home and
result storage) in a temp dir, set before anything imports prefect or mlflow. Flows run against one Prefect test
server per session (its start-up takes 15-20 s here, hence the long timeout)."""

import os
import tempfile
from pathlib import Path

_STATE = Path(tempfile.mkdtemp(prefix="opd-test-"))
os.environ["OPD_HOME"] = str(_STATE)
os.environ["PREFECT_HOME"] = str(_STATE / "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_STATE / "prefect" / "storage")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_STATE / 'mlflow.db'}"
os.environ.pop("OPD_REGISTRY", None)

import importlib.util  # noqa: E402

import pytest  # noqa: E402

# vllm lives in its own environment on CPU machines (make vllm-env): infra/run-tests.sh runs tests/test_vllm.py there.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if HAVE_VLLM else ["test_vllm.py"]


def pytest_report_header(config):
    if not HAVE_VLLM:
        return "vllm is not importable here: tests/test_vllm.py is left out (it runs in .venv-vllm, see infra/run-tests.sh)"


@pytest.fixture(scope="session")
def state_dir() -> Path:
    return _STATE


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
