"""A specialist that ends below ``min_accuracy`` is an expected outcome, not a crash: the main job says it in a few
``error:`` lines (route, accuracy reached, threshold, what to change), with no traceback, exits 2, and registers
nothing for that route. Run end to end through the command line on the quick profile, cut short (6 base steps, 3
specialist steps: far below a threshold of 1.0). With ``--below_min_accuracy skip`` the job goes on with the routes
whose specialist passed and lists the others as having no teacher."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
DATA = Path(__file__).parent / "data" / "user_spec"


def test_the_exception_says_each_route_its_accuracy_and_what_to_change():
    from flows.specialists import SpecialistsBelowThreshold
    from tasks.cli import error_lines

    lines = error_lines(SpecialistsBelowThreshold({"swap": 0.01}, 0.9, {"swap": 500}, ["spec-a"]))
    assert lines[:2] == ["error: specialist swap: accuracy 0.010 on its held-out prompts after 500 steps, below "
                         "min_accuracy 0.9; not registered", "error: registered and kept: spec-a"]
    assert len(lines) == 3 and "--train.steps" in lines[2] and "--min_accuracy" in lines[2]


def test_the_main_job_below_min_accuracy_exits_2_in_a_few_lines_without_a_traceback(prefect_server, latest_base_kept,
                                                                                   capfd):
    from flows.pipeline import main
    from tasks.cli import run_main
    from teachers.registry import TeacherRegistry

    before = {r.name: r.model_uri for r in TeacherRegistry().list()}
    code = run_main(main, ["--profile", "quick", "--world.routes", "shift-low,rev-high", "--base_train.steps", "6",
                           "--specialist_train.steps", "3", "--min_accuracy", "1.0"])
    out, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2
    assert "Traceback" not in out + err
    assert [e.split(":")[1].strip() for e in errors[:2]] == ["specialist shift-low", "specialist rev-high"], errors
    assert all("below min_accuracy 1.0; not registered" in e and "after 3 steps" in e for e in errors[:2])
    assert errors[2:] == ["error: no specialist registered", errors[3]] and "--min_accuracy" in errors[3]
    assert {r.name: r.model_uri for r in TeacherRegistry().list()} == before  # nothing registered, nothing lost


def test_below_min_accuracy_skip_merges_the_routes_that_passed_and_lists_the_others(flow_env, latest_base_kept,
                                                                                 tmp_path):
    """``--below_min_accuracy skip``: the main job goes on with the specialists that passed. Deterministic on any
    machine: one route's verifier accepts every answer (its specialist scores 1.0), the other's none (0.0). Run as
    the command a user types, in its own process (its output is what they read)."""
    import json
    import shutil
    import subprocess
    import sys

    from tasks.common.paths import PROJECT_ROOT
    from teachers.registry import TeacherRegistry

    shutil.copy(DATA / "words.jsonl", tmp_path / "words.jsonl")
    (tmp_path / "checks.py").write_text("def always(completion, reference, row):\n    return True\n\n\n"
                                        "def never(completion, reference, row):\n    return False\n")
    data = {"source": "words.jsonl", "prompt_column": "word", "answer_column": "reversed", "eval_size": 20, "seed": 0}
    route = {"render": {"kind": "chat", "system": "Answer."}, "generate": {"max_new_tokens": 10}, "data": data}
    spec = {"version": 1, "routes": [
        {"name": "skip-passes", **route, "verify": {"kind": "function", "function": "checks:always"}},
        {"name": "skip-fails", **route, "verify": {"kind": "function", "function": "checks:never"}}]}
    (tmp_path / "routes.yaml").write_text(json.dumps(spec))  # JSON is YAML
    flags = ["--profile", "quick", "--spec", str(tmp_path / "routes.yaml"), "--base_train.steps", "6",
             "--specialist_train.steps", "4", "--min_accuracy", "0.5", "--opd.steps", "3", "--opd.cold_start_steps",
             "0", "--opd.eval_every", "1000", "--opd.gate_threshold", "0", "--opd.recovery_prompts", "0"]
    before = {r.name for r in TeacherRegistry().list()}

    def job(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flows.pipeline", *flags, *extra], env=flow_env,
                              cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1200)

    failed = job()  # the default, below_min_accuracy fail
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "error: specialist skip-fails: accuracy 0.000" in failed.stderr
    assert "error: registered and kept: spec-skip-passes" in failed.stderr

    skipped = job("--below_min_accuracy", "skip")
    out = skipped.stdout + skipped.stderr
    assert skipped.returncode == 0, out[-3000:]
    assert "Traceback" not in out
    assert "going on without them (below_min_accuracy skip)" in out and "specialist skip-fails: accuracy 0.000" in out
    assert "routes without a teacher, left out: skip-fails" in out
    table = out.split("pipeline done in", 1)[1]
    assert [line.split()[:2] for line in table.splitlines() if line.startswith("skip-")] == [
        ["skip-passes", "spec-skip-passes"], ["skip-fails", "none"]], table
    assert "their specialist stayed below min_accuracy 0.5), not merged: skip-fails" in table
    assert {r.name for r in TeacherRegistry().list()} - before == {"spec-skip-passes"}  # none for the failed route
