"""Retention and pass@k, the numbers the merge reports per route: ``tasks.evaluation.evaluate.retention``,
``tasks.evaluation.evaluate.pass_at_k`` and ``tasks.merging.merge.route_metrics``, against values computed by hand.
``python -m pytest tests/test_retention.py -q``"""

from __future__ import annotations

import math

import pytest

from tasks.evaluation.evaluate import RouteScore, pass_at_k, retention
from tasks.merging.merge import route_metrics


def test_retention_is_student_over_teacher_and_zero_for_a_teacher_at_zero():
    assert retention(0.45, 0.9) == pytest.approx(0.5, abs=1e-15)
    assert retention(0.9, 0.9) == 1.0
    assert retention(0.6, 0.4) == pytest.approx(1.5, abs=1e-15)  # a student above its teacher: above 1, not capped
    assert retention(0.0, 0.7) == 0.0
    assert retention(0.3, 0.0) == 0.0 and retention(0.0, 0.0) == 0.0  # no division by zero


@pytest.mark.parametrize("n,c,k,expected", [
    (10, 3, 1, 0.3),  # pass@1 is the fraction right
    (5, 1, 2, 1 - 6 / 10),  # 1 - C(4, 2) / C(5, 2)
    (3, 1, 2, 1 - 1 / 3),  # 1 - C(2, 2) / C(3, 2): n - c == k, the last case the product computes
    (6, 2, 3, 1 - 4 / 20),  # 1 - C(4, 3) / C(6, 3)
    (4, 0, 2, 0.0),  # nothing right
    (4, 4, 2, 1.0),  # everything right
    (3, 2, 2, 1.0),  # n - c < k: every draw of k holds a right one
    (4, 1, 4, 1.0),  # k = n
    (1, 0, 1, 0.0),
    (1, 1, 1, 1.0),
])
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_binomial_formula():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k", [(4, -1, 2), (4, 5, 2), (4, 2, 0), (4, 2, 5), (0, 0, 1), (4, -1, 0)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError) as info:
        pass_at_k(n, c, k)
    assert str(info.value) == f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}"


def test_route_metrics_per_route_and_means():
    scores = {
        "add-high": RouteScore(accuracy=0.6, response_length=12.0, truncated=0.0, n=50),
        "rev-low": RouteScore(accuracy=0.2, response_length=30.0, truncated=0.1, n=40),
        "sort-high": RouteScore(accuracy=0.5, response_length=3.0, truncated=0.0, n=10),
    }
    teacher_acc = {"add-high": 0.8, "rev-low": 0.0, "sort-high": 0.5, "unused": 0.9}
    m = route_metrics(scores, teacher_acc)
    expected = {
        "accuracy/add-high": 0.6, "retention/add-high": 0.75, "response_length/add-high": 12.0,
        "accuracy/rev-low": 0.2, "retention/rev-low": 0.0, "response_length/rev-low": 30.0,
        "accuracy/sort-high": 0.5, "retention/sort-high": 1.0, "response_length/sort-high": 3.0,
        # unweighted means over the routes (not over prompts)
        "accuracy/mean": 1.3 / 3, "retention/mean": 1.75 / 3, "response_length/mean": 15.0,
    }
    assert m.keys() == expected.keys()
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, abs=1e-12), key
    with pytest.raises(KeyError):
        route_metrics(scores, {"add-high": 0.8})  # a route without its teacher's score is an error, not a 0
    # With the spec's labels: the mean retention of each label value over its routes (a route without the label
    # counts in no group of it).
    labels = {"add-high": {"domain": "math", "budget": "high"}, "rev-low": {"domain": "words", "budget": "low"},
              "sort-high": {"domain": "math", "budget": "high"}}
    with_labels = route_metrics(scores, teacher_acc, labels)
    assert {k: v for k, v in with_labels.items() if k not in m} == pytest.approx({
        "retention_by/domain/math": (0.75 + 1.0) / 2, "retention_by/budget/high": (0.75 + 1.0) / 2,
        "retention_by/domain/words": 0.0, "retention_by/budget/low": 0.0})
    assert route_metrics(scores, teacher_acc, {"rev-low": {"domain": "words"}})["retention_by/domain/words"] == 0.0
    assert "retention_by/domain/math" not in route_metrics(scores, teacher_acc, {"rev-low": {"domain": "words"}})


def test_the_one_mean_over_routes_counts_each_route_once_and_refuses_none():
    from tasks.evaluation.evaluate import mean_retention, route_mean

    assert route_mean({"a": 1.0, "b": 0.5, "c": 0.0}) == pytest.approx(0.5)
    assert route_mean([0.25, 0.75]) == 0.5 and route_mean(x for x in (0.9,)) == 0.9
    rows = [{"route": "a", "retention": 0.9, "n": 500}, {"route": "b", "retention": 0.6, "n": 5}]
    assert mean_retention(rows) == pytest.approx(0.75)  # not weighted by prompt counts
    with pytest.raises(ValueError, match="^a mean over no routes$"):
        route_mean([])
    with pytest.raises(ValueError, match="^a mean over no routes$"):
        mean_retention([])


def test_no_other_module_computes_a_mean_over_routes_by_hand():
    """Mean retention is computed in one place (tasks.evaluation.evaluate.route_mean): a `sum(...) / len(...)` over retention
    rows or route metrics anywhere else is a second definition waiting to drift."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    hand_made = re.compile(r"sum\((?:[^()]|\([^()]*\))*retention(?:[^()]|\([^()]*\))*\)\s*/\s*len\(")
    files = sorted([*root.glob("[tf]*/*.py"), *root.glob("flows/bench/*.py")])
    offenders = [f"{p.relative_to(root)}:{i}" for p in files if p.parent.name != "tests"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if hand_made.search(line)]
    assert offenders == []


def test_a_route_left_below_its_base_is_named_in_the_summary_with_both_accuracies():
    from tasks.evaluation.evaluate import below_base

    rows = [{"route": "sort-high", "base_accuracy": 0.675, "student_accuracy": 0.660},  # retention 0.684, gain -0.05
            {"route": "sort-low", "base_accuracy": 0.825, "student_accuracy": 0.950},
            {"route": "rev-low", "base_accuracy": 0.400, "student_accuracy": 0.400}]  # equal: not below
    assert below_base(rows) == ("warning: the student ended below its base on 1 route(s): sort-high (student 0.660 < "
                                "base 0.675)")
    assert below_base(rows[1:]) == ""


def test_the_retention_table_shows_exact_format_scores_only_where_a_verifier_is_lenient():
    from tasks.evaluation.evaluate import retention_row
    from tasks.tracking.runs import format_retention_table

    strict = [{**retention_row("rev", "t", 0.8, 0.9, 0.1), "base_exact": 0.1, "teacher_exact": 0.9,
               "student_exact": 0.8}]
    assert "exact" not in format_retention_table(strict)  # exact match everywhere: the columns would repeat
    lenient = [{**retention_row("arith", "t", 0.75, 0.9, 0.06), "base_exact": 0.0, "teacher_exact": 0.9,
                "student_exact": 0.7}]
    lines = format_retention_table(strict + lenient).splitlines()
    assert lines[0].split()[-6:] == ["base", "exact", "teacher", "exact", "student", "exact"]
    cells = lines[3].split()
    assert cells[0] == "arith" and [float(c) for c in cells[-3:]] == [0.0, 0.9, 0.7]
    # gain recovered (0.75 - 0.06) / (0.9 - 0.06) = 0.821..., retention 0.75 / 0.9 = 0.833...
    assert [float(c) for c in cells[-5:-3]] == pytest.approx([0.8333, 0.8214], abs=6e-4)
