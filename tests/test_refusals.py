"""A refusal is a message, not a traceback: every command line refuses bad input with ``error: ...`` lines (the file
or field, what was found, what was expected) and exit code 2, before Prefect starts; ``--debug`` shows the traceback.

    OMP_NUM_THREADS=1 python -m pytest tests/test_refusals.py -q   (1-2 min: real command lines, as a user runs them)

Each command runs once, as a subprocess on its own fresh state folder, in :func:`refusals` (two at a time); each test
then reads its case.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tasks.cli import InvalidConfig, looks_like_path, parse_config, run_main
from tasks.config import pipeline_config
from tasks.preflight import InputError, Problem

ROOT = Path(__file__).resolve().parents[1]
REGISTER = ["flows.register", "--name", "x", "--route", "rev-low", "--model_uri", "/nonexistent"]
CASES = {
    "register-missing-folder": REGISTER,
    "register-debug": [*REGISTER, "--debug"],
    "evaluate-missing-folder": ["flows.evaluate", "--profile", "quick", "--model_uri", "/nonexistent"],
    "compare-before-any-merge": ["flows.compare"],
    "teachers-register-missing-folder": ["teachers", "register", "--name", "x", "--route", "rev-low",
                                         "--model_uri", "/nonexistent"],
    "merge-negative-steps": ["flows.merge", "--profile", "quick", "--opd.steps", "-3"],
    "merge-unknown-route": ["flows.merge", "--profile", "quick", "--world.routes", "rev-low,foo-low"],
}


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OPD_REGISTRY", "PREFECT_API_URL")}
    return {**env, "OPD_HOME": str(state), "MLFLOW_TRACKING_URI": f"sqlite:///{state / 'mlflow.db'}",
            "PREFECT_HOME": str(state / "prefect"), "PREFECT_RESULTS_LOCAL_STORAGE_PATH": str(state / "prefect" / "s"),
            "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    def run(case: str) -> subprocess.CompletedProcess:
        state = tmp_path_factory.mktemp(case)
        return subprocess.run([sys.executable, "-m", *CASES[case]], cwd=ROOT, env=_env(state), capture_output=True,
                              text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(CASES, pool.map(run, CASES)))


def assert_refused(proc: subprocess.CompletedProcess, *names: str) -> list[str]:
    """Exit 2; a few ``error:`` lines that name every one of ``names``; no traceback, no pydantic docs link, and no
    flow run (the refusal came before Prefect started)."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "errors.pydantic.dev" not in err, err[-3000:]
    assert "Beginning flow run" not in err and "Starting temporary server" not in err, err
    lines = err.splitlines()
    assert len(lines) <= 10 and any(line.startswith("error: ") for line in lines), err
    for name in names:
        assert name in err, (name, err)
    return [line for line in lines if line.startswith("error: ")]


def test_register_names_the_missing_folder(refusals):
    errors = assert_refused(refusals["register-missing-folder"], "model_uri", "/nonexistent", "no such folder")
    # Every problem at once: the built-in world's tokenizer (the default student tokenizer) is not there either.
    assert any("student_tokenizer" in e and "run the pipeline first" in e for e in errors), errors


def test_evaluate_names_the_missing_folder(refusals):
    assert_refused(refusals["evaluate-missing-folder"], "model_uri", "/nonexistent", "no such folder")


def test_compare_before_any_merge_says_so(refusals):
    assert_refused(refusals["compare-before-any-merge"], "0 finished merge run(s)", "need at least 2 merge runs",
                   "python -m flows.merge")


def test_teachers_register_names_the_missing_folder(refusals):
    assert_refused(refusals["teachers-register-missing-folder"], "model_uri", "/nonexistent", "no such folder")


def test_bad_field_value_names_field_constraint_and_input(refusals):
    (line,) = assert_refused(refusals["merge-negative-steps"])
    assert line == "error: config: opd.steps: Input should be greater than or equal to 1 (got '-3')", line


def test_unknown_route_is_named(refusals):
    assert_refused(refusals["merge-unknown-route"], "world.routes", "unknown domain 'foo'", "known:")


def test_debug_shows_the_traceback(refusals):
    proc = refusals["register-debug"]
    assert proc.returncode == 2 and "Traceback (most recent call last)" in proc.stderr, proc.stderr[-3000:]
    assert "InvalidConfig" in proc.stderr and "/nonexistent: no such folder" in proc.stderr


# ------------------------------------------------------------------------------------------- in process, fast


def test_a_bug_is_not_a_refusal():
    def buggy(argv):
        raise KeyError("a genuine bug")

    with pytest.raises(KeyError):
        run_main(buggy, [])


def test_debug_reraises_a_refusal(capsys):
    def refused(argv):
        raise InputError([Problem("config", "model_uri", "/x: no such folder")])

    assert run_main(refused, []) == 2 and capsys.readouterr().err == "error: config: model_uri: /x: no such folder\n"
    with pytest.raises(InputError):
        run_main(refused, ["--debug"])


def test_refusal_raised_in_a_flow_keeps_its_line_and_loses_its_traceback(capsys):
    # Prefect logs an exception raised in a flow with logger.exception on prefect.flow_runs (console and API).
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("prefect.flow_runs")
    # Only this handler: Prefect's own (console, API), configured by whichever test ran a flow first, are not
    # what is under test and may fail outside a flow run ("--- Logging error ---" on stderr).
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False

    def flow_body(error: Exception):
        def main(argv):
            try:
                raise error
            except Exception:
                logger.exception("Encountered exception during execution: %r", error)
                raise
        return main

    try:
        refusal = InputError([Problem("config", "student_uri", "/x: no such folder; expected a folder")])
        assert run_main(flow_body(refusal), []) == 2
        assert capsys.readouterr().err == "error: config: student_uri: /x: no such folder; expected a folder\n"
        with pytest.raises(RuntimeError):
            run_main(flow_body(RuntimeError("a bug")), [])
    finally:
        logger.handlers, logger.propagate = saved
    assert [r.exc_info is None for r in records] == [True, False]  # the bug keeps its traceback
    assert "InputError" in records[0].getMessage()


def test_validation_lists_every_field_without_the_docs_link():
    with pytest.raises(InvalidConfig) as info:
        parse_config(["--opd.steps", "-3", "--opd.lr", "0"], lambda profile="default": pipeline_config(profile),
                     "t", with_profile=True)
    assert [(p.field, p.message) for p in info.value.problems] == [
        ("opd.steps", "Input should be greater than or equal to 1 (got '-3')"),
        ("opd.lr", "Input should be greater than 0 (got '0')"),
    ] and "pydantic.dev" not in str(info.value)


@pytest.mark.parametrize("uri, is_path", [
    ("/nonexistent", True), ("./ckpt", True), ("~/ckpt", True), (".opd/models/base", True), ("a/b/c", True),
    ("org/name", False), ("gpt2", False), ("models:/opd-student@champion", False), ("runs:/abc/model", False),
    ("hf://org/name", False), ("", False),
])
def test_what_looks_like_a_path(uri, is_path):
    # A hub id has at most one "/" (org/name); anything with a scheme is a URI for MLflow or the hub.
    assert looks_like_path(uri) is is_path
