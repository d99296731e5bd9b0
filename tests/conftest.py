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


@pytest.fixture(scope="session")
def short_pipeline(prefect_server):
    """A short quick-profile pipeline for tests that need a trained base and specialists, not good ones: base and
    specialist training cut short, any specialist accuracy accepted, a 20-step merge whose gate still samples.
    Returns (config, pipeline result)."""
    from flows.pipeline import pipeline
    from tasks.config import pipeline_config

    cfg = pipeline_config("quick", base_train={"steps": 120}, specialist_train={"steps": 40}, min_accuracy=0.0,
                          opd={"steps": 20, "eval_every": 1000, "gate_threshold": 0.05})
    return cfg, pipeline(cfg)


@pytest.fixture(scope="session")
def flow_env(prefect_server) -> dict[str, str]:
    """Environment for running a flow's command in a subprocess against this session's state and Prefect test server
    (no ephemeral Prefect server per process), one torch thread."""
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
