"""Routing prompts to teachers. ``python -m pytest tests/test_router.py -q``"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tasks.world.domains import Route
from teachers.registry import Provenance, TeacherNotFound, TeacherRecord, TeacherRegistry
from teachers.router import Router, RoutingError, UnmappedRouteError


def rec(name: str, route: str, year: int = 2024, eval_score: float | None = None) -> TeacherRecord:
    return TeacherRecord(
        name=name,
        route=route,
        model_uri=f"/ckpt/{name}",
        tokenizer_fingerprint="sha256:abc",
        eval_score=eval_score,
        provenance=Provenance(source="test", created_at=datetime(year, 1, 1, tzinfo=UTC)),
    )


@pytest.fixture
def registry(tmp_path, monkeypatch) -> TeacherRegistry:
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "opd"))
    reg = TeacherRegistry(tmp_path / "registry.json")
    for r in [
        rec("add-high-v2", "add-high", 2025, 0.9),
        rec("add-high-v1", "add-high", 2024, 0.8),
        rec("rev-low-a", "rev-low", 2024, 1.0),
        rec("sort-high-a", "sort-high", 2024),
    ]:
        reg.add(r)
    return reg


def test_default_picks_newest_teacher_per_route(registry):
    router = Router.from_registry(registry, ["add-high", Route("rev", "low"), "add-high"])
    assert router.teacher_for("add-high").name == "add-high-v2"
    assert router.teacher_for(Route("rev", "low")).name == "rev-low-a"
    assert sorted(router.mapping) == ["add-high", "rev-low"]
    assert [t.name for t in router.teachers()] == ["add-high-v2", "rev-low-a"]
    assert router.warnings == []


def test_newest_tie_broken_by_name(tmp_path):
    reg = TeacherRegistry(tmp_path / "r.json")
    reg.add(rec("b", "add-low", 2024))
    reg.add(rec("a", "add-low", 2024))
    assert Router.from_registry(reg, ["add-low"]).teacher_for("add-low").name == "b"


def test_named_teachers_used_exactly_unused_one_warned(registry):
    router = Router.from_registry(registry, ["add-high", "rev-low"], ["add-high-v1", "rev-low-a", "sort-high-a"])
    assert router.teacher_for("add-high").name == "add-high-v1"
    assert router.warnings == ["teacher 'sort-high-a' serves route 'sort-high', which no prompt uses"]
    with pytest.raises(RoutingError) as info:
        Router.from_registry(registry, ["add-high"], ["add-high-v2", "add-high-v1"])
    assert str(info.value) == ("teachers 'add-high-v2' and 'add-high-v1' both serve route 'add-high'; "
                               "expected at most one named teacher per route. To combine several teachers on one "
                               "route, list them in the route spec: routes[add-high].teachers: [add-high-v2, "
                               "add-high-v1] with combine: select, mixture or average_logits")
    # A name given twice is one teacher, not two on one route.
    twice = Router.from_registry(registry, ["add-high"], ["add-high-v1", "add-high-v1"])
    assert twice.teacher_for("add-high").name == "add-high-v1" and twice.warnings == []
    with pytest.raises(TeacherNotFound, match="no teacher 'nope'"):
        Router.from_registry(registry, ["add-high"], ["nope"])


def test_unmapped_route_names_route_and_available(registry):
    with pytest.raises(UnmappedRouteError) as info:
        Router.from_registry(registry, ["add-high", "add-low", "rev-high"])
    assert isinstance(info.value, ValueError)
    assert info.value.routes == ["add-low", "rev-high"]
    assert info.value.available == ["add-high", "rev-low", "sort-high"]
    assert str(info.value) == (
        "no teacher for route(s) ['add-low', 'rev-high']; routes with a teacher: ['add-high', 'rev-low', 'sort-high']"
    )

    router = Router.from_registry(registry, ["rev-low"], ["rev-low-a"])
    with pytest.raises(UnmappedRouteError, match=r"\['add-high'\]; routes with a teacher: \['rev-low'\]"):
        router.teacher_for("add-high")
    with pytest.raises(UnmappedRouteError, match=r"\['add-high'\]; routes with a teacher: \['rev-low'\]"):
        Router.from_registry(registry, ["rev-low", "add-high"], ["rev-low-a"])


def test_group_batches_rows_per_teacher(registry):
    router = Router.from_registry(registry, ["add-high", "rev-low"])
    groups = router.group(["rev-low", "add-high", "rev-low", "add-high", "add-high"])
    assert groups == {"rev-low-a": [0, 2], "add-high-v2": [1, 3, 4]}
    assert list(groups) == ["rev-low-a", "add-high-v2"]
    assert router.group([]) == {}
    with pytest.raises(UnmappedRouteError, match=r"\['sort-low'\]"):
        router.group(["add-high", "sort-low"])

    # One teacher may serve several routes; its rows stay one batch.
    shared = rec("generalist", "add-high")
    both = Router({"add-high": shared, Route("add", "low"): shared})
    assert both.group(["add-low", "add-high", "add-low"]) == {"generalist": [0, 1, 2]}
    assert [t.name for t in both.teachers()] == ["generalist"]


def test_coverage_rows_and_text(registry):
    router = Router.from_registry(registry, ["add-high", "rev-low"], ["add-high-v2", "rev-low-a", "sort-high-a"])
    rows = router.coverage({"rev-low": 7, "add-high": 120, "add-low": 3})
    assert rows == [
        {"route": "add-high", "prompts": 120, "teacher": "add-high-v2", "model_uri": "/ckpt/add-high-v2",
         "eval_score": 0.9},
        {"route": "add-low", "prompts": 3, "teacher": None, "model_uri": None, "eval_score": None},
        {"route": "rev-low", "prompts": 7, "teacher": "rev-low-a", "model_uri": "/ckpt/rev-low-a", "eval_score": 1.0},
        {"route": "sort-high", "prompts": 0, "teacher": "sort-high-a", "model_uri": "/ckpt/sort-high-a",
         "eval_score": None},
    ]
    assert router.format_coverage({"rev-low": 7, "add-high": 120, "add-low": 3}).splitlines() == [
        "route      prompts  teacher      eval_score  model_uri",
        "---------  -------  -----------  ----------  -----------------",
        "add-high       120  add-high-v2       0.900  /ckpt/add-high-v2",
        "add-low          3  -                     -  -",
        "rev-low          7  rev-low-a         1.000  /ckpt/rev-low-a",
        "sort-high        0  sort-high-a           -  /ckpt/sort-high-a",
    ]


def test_repr_names_each_routes_teacher_sorted_by_route(registry):
    router = Router.from_registry(registry, ["rev-low", "add-high"])
    assert repr(router) == "Router({'add-high': 'add-high-v2', 'rev-low': 'rev-low-a'})"
    assert repr(Router({})) == "Router({})"
