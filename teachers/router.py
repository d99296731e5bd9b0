"""Routing: which teacher scores the student's rollouts for each prompt, by the prompt's route.

    from teachers.registry import TeacherRegistry
    from teachers.router import Router
    router = Router.from_registry(TeacherRegistry(), ["shift-high", "rev-low"])   # newest teacher per route
    router.group(["shift-high", "rev-low", "shift-high"])                         # {"shift-high-v1": [0, 2], ...}
    print(router.format_coverage({"shift-high": 512, "rev-low": 512}))
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


from teachers.registry import TeacherRecord, TeacherRegistry, route_name
from tasks.common.table import format_table


def teacher_names(named: list[str], spec=None) -> list[str] | None:
    """The teachers a merge is told to use: ``named`` (the config's ``teachers``) when given, else the registry names
    the route spec's routes give (``teacher: NAME``; pass ``fill_newest=True`` so that its ``newest`` routes get
    their newest teacher), else None (the newest teacher of every route)."""
    if named:
        return list(named)
    if spec is None or all(r.teacher == "newest" for r in spec.routes):
        return None
    return [r.teacher for r in spec.routes if r.teacher != "newest"]


class RoutingError(ValueError):
    """The requested teachers cannot form a route -> teacher map."""


class UnmappedRouteError(RoutingError):
    """Prompts of a route that no teacher serves; names the routes that do have one."""

    def __init__(self, routes: Iterable[str], available: Iterable[str]):
        self.routes, self.available = sorted(set(routes)), sorted(set(available))
        super().__init__(f"no teacher for route(s) {self.routes}; routes with a teacher: {self.available}")


class Router:
    """A fixed map from route name to teacher record. ``warnings`` holds what was odd but allowed."""

    def __init__(self, mapping: Mapping[str, TeacherRecord], warnings: list[str] | None = None):
        self._mapping: dict[str, TeacherRecord] = {route_name(k): v for k, v in mapping.items()}
        self.warnings: list[str] = list(warnings or [])

    def __repr__(self) -> str:
        return f"Router({ {k: v.name for k, v in sorted(self._mapping.items())} })"

    @classmethod
    def from_registry(
        cls,
        registry: TeacherRegistry,
        routes: Iterable[str],
        teacher_names: list[str] | None = None,
        fill_newest: bool = False,
    ) -> Router:
        """Map every route in ``routes`` to a teacher.

        With ``teacher_names`` exactly those teachers are used (two on one route is an error; one whose route no
        prompt uses is a warning), and with ``fill_newest`` the routes they leave get their newest teacher. Without,
        each route gets its most recently created teacher (ties: by name).
        """
        wanted = list(dict.fromkeys(route_name(r) for r in routes))
        records = registry.list()
        warnings: list[str] = []
        mapping: dict[str, TeacherRecord] = {}
        if teacher_names is not None:
            by_name = {r.name: r for r in records}
            for name in dict.fromkeys(teacher_names):
                rec = by_name.get(name) or registry.get(name)  # get() raises TeacherNotFound listing the names
                if rec.route in mapping:
                    raise RoutingError(
                        f"teachers {mapping[rec.route].name!r} and {rec.name!r} both serve route {rec.route!r}; "
                        "expected at most one named teacher per route"
                    )
                mapping[rec.route] = rec
                if rec.route not in wanted:
                    warnings.append(f"teacher {rec.name!r} serves route {rec.route!r}, which no prompt uses")
        if teacher_names is None or fill_newest:
            for route in (r for r in wanted if r not in mapping):
                candidates = [r for r in records if r.route == route]
                if candidates:
                    mapping[route] = max(candidates, key=lambda r: (r.provenance.created_at, r.name))
        missing = [r for r in wanted if r not in mapping]
        if missing:
            # Name the routes the caller could actually get: the chosen ones, or the registry's if none were named.
            available = mapping if teacher_names is not None else {r.route for r in records}
            raise UnmappedRouteError(missing, available)
        return cls(mapping, warnings)

    @classmethod
    def for_merge(cls, registry: TeacherRegistry, routes: Iterable[str], named: list[str], spec=None) -> Router:
        """The router of a merge or an evaluation: the config's ``named`` teachers when given (exactly those), else
        the route spec's ``teacher: NAME`` routes (:func:`teacher_names`) with every other route's newest teacher,
        else every route's newest teacher."""
        return cls.from_registry(registry, routes, teacher_names(named, spec), fill_newest=not named)

    @property
    def mapping(self) -> dict[str, TeacherRecord]:
        return dict(self._mapping)

    def teacher_for(self, route: str) -> TeacherRecord:
        key = route_name(route)
        try:
            return self._mapping[key]
        except KeyError:
            raise UnmappedRouteError([key], self._mapping) from None

    def teachers(self) -> list[TeacherRecord]:
        return sorted({r.name: r for r in self._mapping.values()}.values(), key=lambda r: r.name)

    def group(self, routes_per_row: Iterable[str]) -> dict[str, list[int]]:
        """Row indices per teacher name, in row order, so each teacher scores its rows in one batch."""
        groups: dict[str, list[int]] = {}
        missing: list[str] = []
        for i, route in enumerate(routes_per_row):
            rec = self._mapping.get(route_name(route))
            if rec is None:
                missing.append(route_name(route))
            else:
                groups.setdefault(rec.name, []).append(i)
        if missing:
            raise UnmappedRouteError(missing, self._mapping)
        return groups

    def coverage(self, prompt_counts: Mapping[str, int]) -> list[dict[str, Any]]:
        """One row per route that has prompts or a teacher, sorted by route; a gap shows as teacher None."""
        counts = {route_name(k): v for k, v in prompt_counts.items()}
        rows = []
        for route in sorted(set(counts) | set(self._mapping)):
            rec = self._mapping.get(route)
            rows.append({
                "route": route,
                "prompts": counts.get(route, 0),
                "teacher": rec.name if rec else None,
                "model_uri": rec.model_uri if rec else None,
                "eval_score": rec.eval_score if rec else None,
            })
        return rows

    def format_coverage(self, prompt_counts: Mapping[str, int]) -> str:
        keys = ("route", "prompts", "teacher", "eval_score", "model_uri")
        return format_table(keys, [[row[k] for k in keys] for row in self.coverage(prompt_counts)])
