"""Routing: which teacher scores the student's rollouts for each prompt, by the prompt's route.

    from teachers.registry import TeacherRegistry
    from teachers.router import Router
    router = Router.from_registry(TeacherRegistry(), ["shift-high", "rev-low"])   # newest teacher per route
    router.group(["shift-high", "rev-low", "shift-high"])                         # {"shift-high-v1": [0, 2], ...}
    print(router.format_coverage({"shift-high": 512, "rev-low": 512}))

A route spec's route may list several teachers (``teachers: [a, b]`` with ``combine``): the router then maps that
route to all of them (:meth:`Router.teachers_for`, the first the primary, which :meth:`Router.teacher_for` returns)
and says how they combine (:meth:`Router.combine_for`); :meth:`Router.group` gives each of them the route's rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


from teachers.registry import TeacherRecord, TeacherRegistry, route_name
from tasks.common.table import format_table


def teacher_names(named: list[str], spec=None) -> list[str] | None:
    """The teachers a merge is told to use: ``named`` (the config's ``teachers``) when given, else the registry names
    the route spec's routes give (``teacher: NAME`` and ``teachers: [NAME, ...]``; pass ``fill_newest=True`` so that
    its ``newest`` routes get their newest teacher), else None (the newest teacher of every route)."""
    if named:
        return list(named)
    names = [n for r in (spec.routes if spec is not None else ()) for n in r.teacher_names]
    return names or None


Combination = tuple[list[str], str, list[float]]  # a route's teacher names (primary first), combine mode, weights


def spec_combinations(spec=None) -> dict[str, Combination]:
    """Route -> (teacher names, combine mode, weights) for every route of the spec that lists ``teachers``."""
    return {r.name: (list(r.teachers), r.combine, list(r.teacher_weights))
            for r in (spec.routes if spec is not None else ()) if r.teachers}


class RoutingError(ValueError):
    """The requested teachers cannot form a route -> teacher map."""


class UnmappedRouteError(RoutingError):
    """Prompts of a route that no teacher serves; names the routes that do have one."""

    def __init__(self, routes: Iterable[str], available: Iterable[str]):
        self.routes, self.available = sorted(set(routes)), sorted(set(available))
        super().__init__(f"no teacher for route(s) {self.routes}; routes with a teacher: {self.available}")


class Router:
    """A fixed map from route name to its teacher records (one, or several that ``combine`` says how to join: route
    -> (mode, weights)). ``warnings`` holds what was odd but allowed."""

    def __init__(self, mapping: Mapping[str, TeacherRecord | Sequence[TeacherRecord]],
                 warnings: list[str] | None = None, combine: Mapping[str, tuple[str, list[float]]] | None = None):
        self._mapping: dict[str, list[TeacherRecord]] = {
            route_name(k): list(v) if isinstance(v, Sequence) else [v] for k, v in mapping.items()}
        self._combine = {route_name(k): (mode, list(w)) for k, (mode, w) in (combine or {}).items()
                         if len(self._mapping.get(route_name(k), ())) > 1}
        self.warnings: list[str] = list(warnings or [])

    def __repr__(self) -> str:
        return f"Router({ {k: '+'.join(r.name for r in v) for k, v in sorted(self._mapping.items())} })"

    @classmethod
    def from_registry(
        cls,
        registry: TeacherRegistry,
        routes: Iterable[str],
        teacher_names: list[str] | None = None,
        fill_newest: bool = False,
        combinations: Mapping[str, Combination] | None = None,
    ) -> Router:
        """Map every route in ``routes`` to its teachers.

        With ``teacher_names`` exactly those teachers are used (one whose route no prompt uses is a warning), and with
        ``fill_newest`` the routes they leave get their newest teacher. Without, each route gets its most recently
        created teacher (ties: by name). Two named teachers on one route are an error unless ``combinations`` (route
        -> (names, combine mode, weights), :func:`spec_combinations`: the spec's ``teachers`` lists) lists both for
        it; such a route keeps the list's order (its first named teacher is the primary) and the weights of the
        named ones. A listed teacher registered for another route is an error.
        """
        wanted = list(dict.fromkeys(route_name(r) for r in routes))
        combinations = {route_name(k): v for k, v in (combinations or {}).items()}
        records = registry.list()
        warnings: list[str] = []
        mapping: dict[str, list[TeacherRecord]] = {}
        if teacher_names is not None:
            by_name = {r.name: r for r in records}
            for name in dict.fromkeys(teacher_names):
                rec = by_name.get(name) or registry.get(name)  # get() raises TeacherNotFound listing the names
                listed = next(((route, names) for route, (names, _, _) in combinations.items() if name in names),
                              None)
                if listed is not None and listed[0] != rec.route:
                    raise RoutingError(f"teacher {name!r} is registered for route {rec.route!r}, not {listed[0]!r}; "
                                       f"the teachers: of route {listed[0]!r} must be teachers registered for it")
                if rec.route in mapping and not (listed is not None and all(
                        r.name in listed[1] for r in mapping[rec.route])):
                    raise RoutingError(
                        f"teachers {mapping[rec.route][0].name!r} and {rec.name!r} both serve route {rec.route!r}; "
                        "expected at most one named teacher per route. To combine several teachers on one route, "
                        f"list them in the route spec: routes[{rec.route}].teachers: [{mapping[rec.route][0].name}, "
                        f"{rec.name}] with combine: select, mixture or average_logits")
                mapping.setdefault(rec.route, []).append(rec)
                if rec.route not in wanted:
                    warnings.append(f"teacher {rec.name!r} serves route {rec.route!r}, which no prompt uses")
        if teacher_names is None or fill_newest:
            for route in (r for r in wanted if r not in mapping):
                candidates = [r for r in records if r.route == route]
                if candidates:
                    mapping[route] = [max(candidates, key=lambda r: (r.provenance.created_at, r.name))]
        missing = [r for r in wanted if r not in mapping]
        if missing:
            # Name the routes the caller could actually get: the chosen ones, or the registry's if none were named.
            available = mapping if teacher_names is not None else {r.route for r in records}
            raise UnmappedRouteError(missing, available)
        combine = {}
        for route, (names, mode, weights) in combinations.items():
            if len(mapping.get(route, ())) > 1:  # in the list's order, with the named ones' weights
                mapping[route].sort(key=lambda r: names.index(r.name))
                combine[route] = (mode, [weights[names.index(r.name)] for r in mapping[route]] if weights else [])
        return cls(mapping, warnings, combine)

    @classmethod
    def for_merge(cls, registry: TeacherRegistry, routes: Iterable[str], named: list[str], spec=None) -> Router:
        """The router of a merge or an evaluation: the config's ``named`` teachers when given (exactly those; two of
        one route only where the spec's route lists both in ``teachers``), else the route spec's ``teacher: NAME``
        and ``teachers: [...]`` routes (:func:`teacher_names`) with every other route's newest teacher, else every
        route's newest teacher."""
        return cls.from_registry(registry, routes, teacher_names(named, spec), fill_newest=not named,
                                 combinations=spec_combinations(spec))

    @property
    def mapping(self) -> dict[str, TeacherRecord]:
        """Route -> its primary teacher."""
        return {route: recs[0] for route, recs in self._mapping.items()}

    def teacher_for(self, route: str) -> TeacherRecord:
        """The route's primary teacher (the first of :meth:`teachers_for`)."""
        return self.teachers_for(route)[0]

    def teachers_for(self, route: str) -> list[TeacherRecord]:
        """Every teacher of the route, the primary first."""
        key = route_name(route)
        try:
            return list(self._mapping[key])
        except KeyError:
            raise UnmappedRouteError([key], self._mapping) from None

    def combine_for(self, route: str) -> tuple[str, list[float]]:
        """How the route's teachers combine and their weights (empty: uniform); ``("select", [])`` with one."""
        self.teachers_for(route)  # an unmapped route is an error here too
        mode, weights = self._combine.get(route_name(route), ("select", []))
        return mode, list(weights)

    def teachers(self) -> list[TeacherRecord]:
        """Every teacher of every route, by name."""
        return sorted({r.name: r for recs in self._mapping.values() for r in recs}.values(), key=lambda r: r.name)

    def group(self, routes_per_row: Iterable[str]) -> dict[str, list[int]]:
        """Row indices per teacher name, in row order, so each teacher scores its rows in one batch (every teacher of
        a route gets all of its rows)."""
        groups: dict[str, list[int]] = {}
        missing: list[str] = []
        for i, route in enumerate(routes_per_row):
            recs = self._mapping.get(route_name(route))
            if recs is None:
                missing.append(route_name(route))
            for rec in recs or ():
                groups.setdefault(rec.name, []).append(i)
        if missing:
            raise UnmappedRouteError(missing, self._mapping)
        return groups

    def coverage(self, prompt_counts: Mapping[str, int]) -> list[dict[str, Any]]:
        """One row per route that has prompts or a teacher, sorted by route; a gap shows as teacher None. A route
        with several teachers shows their names joined by '+' and the best eval score."""
        counts = {route_name(k): v for k, v in prompt_counts.items()}
        rows = []
        for route in sorted(set(counts) | set(self._mapping)):
            recs = self._mapping.get(route, [])
            scores = [r.eval_score for r in recs if r.eval_score is not None]
            rows.append({
                "route": route,
                "prompts": counts.get(route, 0),
                "teacher": "+".join(r.name for r in recs) if recs else None,
                "model_uri": " ".join(r.model_uri for r in recs) if recs else None,
                "eval_score": max(scores) if scores else None,
            })
        return rows

    def format_coverage(self, prompt_counts: Mapping[str, int]) -> str:
        keys = ("route", "prompts", "teacher", "eval_score", "model_uri")
        return format_table(keys, [[row[k] for k in keys] for row in self.coverage(prompt_counts)])
