"""The test command cannot pass without running its tiers: infra/run-tests.sh fails when a tier collects nothing, and
its vLLM tier (OPD_REQUIRE_VLLM=1, tests/conftest.py) fails when vllm does not import or no vLLM test passed, and
prints how many ran."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pytest(tmp_path: Path, body: str, *args: str, fake_vllm: bool, require: bool = True):
    """Run pytest on one generated test file with the suite's conftest loaded as a plugin, optionally with an
    importable stand-in ``vllm`` package (only its importability is under test here, not vLLM)."""
    (tmp_path / "test_generated.py").write_text(body)
    path = [str(ROOT)]
    if fake_vllm:
        (tmp_path / "site" / "vllm").mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / "vllm" / "__init__.py").write_text("")
        path.insert(0, str(tmp_path / "site"))
    env = {k: v for k, v in os.environ.items() if k != "OPD_REQUIRE_VLLM"}
    env.update(PYTHONPATH=os.pathsep.join(path), **({"OPD_REQUIRE_VLLM": "1"} if require else {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-c", str(ROOT / "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-p", "no:cacheprovider", "-m", "vllm",
                           str(tmp_path / "test_generated.py"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


PASSING = "import pytest\npytestmark = pytest.mark.vllm\n\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n"
SKIPPING = "import pytest\npytestmark = pytest.mark.vllm\n\ndef test_a():\n    pytest.skip('no engine')\n"


def test_vllm_tier_fails_when_vllm_does_not_import(tmp_path):
    out = _pytest(tmp_path, PASSING, fake_vllm=False)
    assert out.returncode != 0, out.stdout
    assert "vllm does not import" in out.stdout + out.stderr and "make vllm-env" in out.stdout + out.stderr


def test_vllm_tier_counts_what_ran_and_passes_only_when_some_vllm_test_passed(tmp_path):
    ok = _pytest(tmp_path, PASSING, fake_vllm=True)
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "vLLM tests: 2 passed, 0 failed, 0 error, 0 skipped" in ok.stdout
    none = _pytest(tmp_path, PASSING, "-k", "no_such_test", fake_vllm=True)
    assert none.returncode == 1, none.stdout[-3000:]  # pytest alone would exit 5, which a wrapper may forgive
    assert "vLLM tests: 0 passed" in none.stdout and "the vLLM tier did not run" in none.stdout
    skipped = _pytest(tmp_path, SKIPPING, fake_vllm=True)
    assert skipped.returncode == 1 and "0 passed, 0 failed, 0 error, 1 skipped" in skipped.stdout, skipped.stdout
    # Outside the vLLM tier (no OPD_REQUIRE_VLLM) nothing changes: a selection with no test is pytest's own exit 5.
    assert _pytest(tmp_path, PASSING, "-k", "no_such_test", fake_vllm=True, require=False).returncode == 5


def _stub(tmp_path: Path, name: str, rc: int) -> str:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\necho \"{name} $*\"\necho \"OPD_REQUIRE_VLLM=$OPD_REQUIRE_VLLM\"\nexit {rc}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("main_rc, vllm_rc, expected", [(0, 0, 0), (5, 0, 5), (0, 5, 5), (1, 0, 1), (0, 3, 3)])
def test_run_tests_fails_when_a_tier_collects_nothing(tmp_path, main_rc, vllm_rc, expected):
    """The wrapper's exit logic, with stand-ins for the two pytest runs (the runs themselves are the suite)."""
    env = {**os.environ, "PY": _stub(tmp_path, "main-py", main_rc), "VLLM_PY": _stub(tmp_path, "vllm-py", vllm_rc)}
    out = subprocess.run(["bash", str(ROOT / "infra" / "run-tests.sh")], env=env, capture_output=True, text=True)
    assert out.returncode == expected, out.stdout + out.stderr
    assert "vllm-py -m pytest -m vllm" in out.stdout and "OPD_REQUIRE_VLLM=1" in out.stdout
    assert f"main tier: exit {main_rc}" in out.stdout and f"vllm tier: exit {vllm_rc}" in out.stdout
    if 5 in (main_rc, vllm_rc):
        assert "collected no tests" in out.stderr


def test_run_tests_on_a_subset_forgives_an_empty_tier_and_does_not_require_vllm(tmp_path):
    env = {**os.environ, "PY": _stub(tmp_path, "main-py", 0), "VLLM_PY": _stub(tmp_path, "vllm-py", 5)}
    out = subprocess.run(["bash", str(ROOT / "infra" / "run-tests.sh"), "tests/test_losses.py"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OPD_REQUIRE_VLLM=0" in out.stdout


def test_run_tests_fails_without_the_vllm_environment(tmp_path):
    env = {**os.environ, "PY": _stub(tmp_path, "main-py", 0), "VLLM_PY": str(tmp_path / "missing" / "python")}
    out = subprocess.run(["bash", str(ROOT / "infra" / "run-tests.sh")], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "make vllm-env" in out.stderr, out.stdout + out.stderr
