"""Test isolation: every pytest session gets its own project state (models, registry, MLflow store, Prefect home and
result storage) in a temp dir, set before anything imports prefect or mlflow. Flows run against one Prefect test
server per session (its start-up takes 15-20 s here, hence the long timeout). The test-only fault points
(tests/faults) are installed in this process, and in every Python process the tests start: their folder with its
``sitecustomize.py`` goes first on ``PYTHONPATH``.

The suite leaves nothing in the home folder: HOME (and XDG_CACHE_HOME / XDG_CONFIG_HOME) point into the session's
state for this process and every process it starts, since the tools the tests drive keep files there by themselves
(Ray's ~/.ray/auth_token, vLLM's ~/.cache/vllm, Chromium's ~/.config/chromium and ~/.cache/dconf). At the end the
real home is compared with what it held at the start, and anything new fails the session (HOME_WRITES names it)."""

import os
import tempfile
from pathlib import Path

_STATE = Path(tempfile.mkdtemp(prefix="opd-test-"))
os.environ["OPD_HOME"] = str(_STATE)
os.environ["PREFECT_HOME"] = str(_STATE / "prefect")
os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(_STATE / "prefect" / "storage")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_STATE / 'mlflow.db'}"
os.environ.pop("OPD_REGISTRY", None)

_REAL_HOME = Path(os.path.expanduser("~"))
# Where tools put their own files: the home's top level and its .cache and .config folders.
_HOME_SPOTS = (_REAL_HOME, _REAL_HOME / ".cache", _REAL_HOME / ".config")


def home_entries() -> set[str]:
    return {str(p) for d in _HOME_SPOTS if d.is_dir() for p in d.iterdir()}


_HOME_BEFORE = home_entries()
for _var, _sub in (("HOME", "home"), ("XDG_CACHE_HOME", "home/.cache"), ("XDG_CONFIG_HOME", "home/.config")):
    (_STATE / _sub).mkdir(parents=True, exist_ok=True)
    os.environ[_var] = str(_STATE / _sub)

from tests.faults import SITE, install  # noqa: E402

# $OPD_FAULT rules work in this process whenever a test sets them, and in its subprocesses (a flow's command, the
# spawned ranks of a sharded merge) through tests/faults/site/sitecustomize.py, which installs them there when set.
os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [os.environ.get("PYTHONPATH")])])
install()

import importlib.util  # noqa: E402

import pytest  # noqa: E402

# vllm lives in its own environment on CPU machines (make vllm-env): infra/run-tests.sh runs tests/test_vllm.py there.
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore = [] if HAVE_VLLM else ["test_vllm.py"]


# infra/run-tests.sh sets OPD_REQUIRE_VLLM=1 for its vLLM tier: there a missing vllm, or a tier in which no vLLM test
# passed, fails the run loudly instead of ending as "no tests collected" (which a wrapper could take for success).
REQUIRE_VLLM = os.environ.get("OPD_REQUIRE_VLLM") == "1"


def pytest_report_header(config):
    if not HAVE_VLLM:
        return "vllm is not importable here: tests/test_vllm.py is left out (it runs in .venv-vllm, see infra/run-tests.sh)"


def pytest_configure(config):
    if REQUIRE_VLLM and not HAVE_VLLM:
        import sys

        raise pytest.UsageError(
            f"OPD_REQUIRE_VLLM=1 but vllm does not import in {sys.executable}: the vLLM tier cannot run. "
            "Build it with `make vllm-env` (on GPUs: pip install -e '.[vllm]')")


def vllm_outcomes(stats: dict) -> dict[str, int]:
    """How many tests marked ``vllm`` ended in each outcome (passed, failed, error, skipped), from pytest's
    terminal-reporter stats; a test counts once, by its call phase (its setup phase when that failed or skipped)."""
    outcome_of: dict[str, str] = {}
    for outcome in ("passed", "failed", "error", "skipped"):
        for report in stats.get(outcome, []):
            if "vllm" in getattr(report, "keywords", {}) and report.nodeid not in outcome_of:
                outcome_of[report.nodeid] = outcome
    counts = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
    for outcome in outcome_of.values():
        counts[outcome] += 1
    return counts


def pytest_sessionfinish(session, exitstatus):
    # Runs before the terminal reporter's summary, and what it leaves in session.exitstatus is the exit code.
    session.config._opd_home_writes = sorted(home_entries() - _HOME_BEFORE)
    if session.config._opd_home_writes and session.exitstatus in (0, 5):
        session.exitstatus = 1
    if not REQUIRE_VLLM:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    counts = session.config._opd_vllm_counts = vllm_outcomes(reporter.stats if reporter else {})
    if counts["passed"] == 0 and session.exitstatus in (0, 5):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for path in getattr(config, "_opd_home_writes", []):
        terminalreporter.write_line(f"HOME_WRITES: the suite left {path} in the home folder", red=True)
    counts = getattr(config, "_opd_vllm_counts", None)
    if counts is None:
        return
    ran = counts["passed"] > 0
    terminalreporter.write_sep("=", "vLLM tests: " + ", ".join(f"{n} {k}" for k, n in counts.items()),
                               red=not ran, green=ran, bold=True)
    if not ran:
        terminalreporter.write_line("ERROR: OPD_REQUIRE_VLLM=1 and no vLLM test passed: the vLLM tier did not run",
                                    red=True)


@pytest.fixture(scope="session")
def state_dir() -> Path:
    return _STATE


@pytest.fixture
def latest_base_kept(state_dir):
    """For a test that trains a tiny base of its own: the state folder's LATEST_BASE marker is put back afterwards,
    since other tests' empty base URIs mean the session's base, not this tiny one."""
    marker = state_dir / "models" / "LATEST_BASE"
    latest = marker.read_text() if marker.exists() else None
    yield
    if latest is not None:
        marker.write_text(latest)
    else:
        marker.unlink(missing_ok=True)


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
            "PYTHONPATH": os.pathsep.join([str(SITE), str(Path(__file__).resolve().parent.parent)])}


@pytest.fixture(scope="module")
def lora_experts(tmp_path_factory):
    """A tiny Llama base (saved with a real tokenizer) and two LoRA fine-tunes of it, saved as the specialists are
    (merged, the adapter beside: tests/test_adapter_merge.py, tests/test_shared_base.py)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tasks.config import TrainConfig
    from tasks.modeling.models import load_model, save_model
    from tasks.common.paths import PROJECT_ROOT
    from tasks.training.sft import save_trained, with_lora

    tok = AutoTokenizer.from_pretrained(PROJECT_ROOT / "tests" / "data" / "smollm2-tokenizer")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    root = tmp_path_factory.mktemp("adapters")
    base_dir = save_model(base, tok, root / "base")
    experts = []
    for i in range(2):
        model = with_lora(load_model(base_dir), TrainConfig(lora_rank=4, lora_alpha=8, seed=i))
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        ids_B_T = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(i))
        for _ in range(3):
            model(ids_B_T, labels=ids_B_T).loss.backward()
            opt.step()
            opt.zero_grad()
        experts.append(save_trained(model, tok, root / f"expert{i}")[1])
    return base_dir, experts
