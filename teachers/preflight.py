"""The preflight of the flows that read the teacher registry (merge, evaluate, pipeline): the registry file, the
routing of every route to a teacher and every routed teacher's checkpoint, on top of :mod:`tasks.preflight`'s checks
of the config, the route spec and the student. Every bad input is refused before any model is loaded, all at once
(:class:`tasks.common.problems.InputError`).

    from tasks.config import pipeline_config
    from teachers.preflight import preflight_merge
    report = preflight_merge(pipeline_config("quick").merge("", []))   # raises InputError listing every problem
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tasks.common.paths import models_dir, registry_path
from tasks.specs.spec import spec_label
from tasks.modeling.routing import combining_refusal, guided_refusal
from tasks.preflight import (
    CONFIG,
    device_problems,
    Checkpoint,
    Problem,
    Report,
    checkpoint_fingerprint_of,
    check_checkpoint,
    credential_problems,
    context_problems,
    finish,
    first_prompt_messages,
    spec_problems,
    teacher_problems,
)
from teachers.registry import RegistryError, TeacherNotFound, TeacherRegistry, check_name
from teachers.router import Router, RoutingError, UnmappedRouteError


def registry_problems(registry=None) -> tuple[Any, list[Problem]]:
    """The registry (default: :func:`tasks.common.paths.registry_path`'s), None with the problem that keeps it from being
    opened or read (file, field, expected)."""
    try:
        registry = registry or TeacherRegistry()
        registry.list()
    except RegistryError as e:
        where = e.path or (registry.path if registry is not None else registry_path())
        return None, [Problem(str(where), e.field or "document", e.detail)]
    return registry, []


def routing_problems(registry, routes: list[str], named: list[str], spec=None):
    """The router of ``routes`` (:meth:`teachers.router.Router.for_merge`: the ``named`` teachers, else the spec's),
    None when it cannot be formed; its warnings and the problems."""
    file = str(registry.path)
    try:
        router = Router.for_merge(registry, routes, named, spec)
    except UnmappedRouteError as e:
        return None, [], [Problem(file, "routes", f"{e}; expected a registered teacher for every route "
                                  "(python -m teachers register ..., or train specialists)")]
    except TeacherNotFound as e:
        return None, [], [Problem(file, "teachers", f"{e}; expected names of registered teachers")]
    except RoutingError as e:
        return None, [], [Problem(file, "teachers", str(e))]
    return router, list(router.warnings), []


def preflight_merge(cfg, registry=None, say_warnings: bool = True) -> Report:
    """Check everything the merge flow will read, before it loads a model: the config's URIs, the prompt sets, the
    registry and routing, the student and every routed teacher. Raises :class:`InputError` listing every problem."""
    problems = credential_problems({"student_uri": cfg.student_uri, "opd.reference_uri": cfg.opd.reference_uri})
    problems += device_problems(cfg)
    student_uri = cfg.student_uri
    if not student_uri:
        marker = models_dir() / "LATEST_BASE"
        student_uri = marker.read_text().strip() if marker.is_file() else ""
        if not student_uri:
            problems.append(Problem(str(marker), "student_uri", "empty, and no base model recorded here; expected a "
                                    "checkpoint (--student_uri PATH) or a prior `python -m flows.base` run"))
    student = Checkpoint(student_uri)
    if student_uri and not any(p.field == "student_uri" for p in problems):  # not a URI carrying credentials
        student = check_checkpoint(student_uri, "student_uri", grant=" (the student never runs custom code)")
        problems += student.problems
    ps = None
    if not any(p.field == "student_uri" for p in problems):  # the prompts are rendered with the student's tokenizer
        ps, found = spec_problems(cfg, student_uri)
        problems += found
    if ps is not None and cfg.routes:  # a merge of some of the routes (the pipeline's below_min_accuracy skip)
        if unknown := [r for r in cfg.routes if r not in ps.routes]:
            where = spec_label(cfg.spec) if cfg.spec else "world.routes"
            problems.append(Problem(CONFIG, "routes", f"no route(s) {unknown} in {where}; expected some of {ps.routes}"))
        ps = ps.restricted([r for r in cfg.routes if r in ps.routes] or ps.routes)
    routes = ps.routes if ps is not None else (cfg.world.routes if not cfg.spec else [])
    current = ps.path.name if ps is not None else ""
    held_out = ps.eval_sets() if ps is not None else {}

    registry, found = registry_problems(registry)
    problems += found
    router, warnings = None, []
    if registry is not None and routes:
        router, warnings, found = routing_problems(registry, routes, cfg.teachers, ps.spec if ps is not None else None)
        problems += found
    ref_uri = cfg.opd.reference_uri
    if cfg.opd.reward_scale != 1.0 and ref_uri and not any(p.field == "opd.reference_uri" for p in problems):
        problems += check_checkpoint(ref_uri, "opd.reference_uri", grant=" (the reference never runs custom code)").problems

    report = Report(student_uri=student_uri, routes=list(routes), warnings=warnings)
    if router is not None:
        for route in sorted(router.mapping):
            report.teachers[route] = "+".join(rec.name for rec in router.teachers_for(route))
        refusal = combining_refusal(router, router.mapping, cfg.opd.teacher_backend)
        if refusal:
            problems.append(Problem(CONFIG, "opd.teacher_backend", refusal))
        if refusal := guided_refusal(router, router.mapping, cfg.opd.rollout_backend):
            problems.append(Problem(CONFIG, "opd.rollout_backend", refusal))
        student_fp = cache(lambda: checkpoint_fingerprint_of(student.uri))  # read once, only if a provenance names it
        for rec in router.teachers():
            eval_prompts = held_out[rec.route][0] if rec.route in held_out else None
            problems += teacher_problems(rec, student, str(registry.path), eval_prompts, current, student_fp,
                                         lambda route=rec.route: first_prompt_messages(ps, route))
            problems += context_problems(ps, rec, str(registry.path))
    return finish(problems, report, say_warnings)


def preflight_pipeline(cfg, registry=None, say_warnings: bool = True) -> Report:
    """Check what the pipeline reads before it trains anything: the route spec and its prompt set, the registry it
    will write the specialists into (a bad file would only fail after every specialist trained) and the teacher names it will
    give them. Raises :class:`InputError` listing every problem."""
    from tasks.modeling.convert import ConversionError, resolve_base

    try:
        base_model = resolve_base(cfg.base_model)
    except ConversionError as e:
        return finish([Problem(CONFIG, "base_model", str(e))], Report(), say_warnings)
    ps, problems = spec_problems(cfg, base_model, cfg.model.max_positions)
    problems += device_problems(cfg) + registry_problems(registry)[1]
    specialists = cfg.specialists("")
    if ps is not None:  # each route's spec `specialist` fields against the recipe its specialist trains with
        from tasks.training.specialist import recipe_problems

        problems += recipe_problems(ps.spec, specialists.rl if specialists.trainer == "rl" else specialists.train)
    prefix = specialists.name_prefix
    for route in (ps.routes if ps is not None else []):
        try:
            check_name(f"{prefix}-{route}")
        except ValueError as e:
            problems.append(Problem(CONFIG, "name_prefix", str(e)))
    report = Report(routes=ps.routes if ps is not None else [])
    return finish(problems, report, say_warnings)
