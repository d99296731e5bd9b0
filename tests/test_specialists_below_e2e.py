"""A specialist that ends below ``min_accuracy`` is an expected outcome, not a crash: the main job says it in a few
``error:`` lines (route, accuracy reached, threshold, what to change), with no traceback, exits 2, and registers
nothing for that route. Run end to end through the command line on the quick profile, cut short (6 base steps, 3
specialist steps: far below a threshold of 1.0)."""

import pytest

pytestmark = pytest.mark.e2e


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
