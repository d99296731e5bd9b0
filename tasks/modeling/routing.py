"""What the merge reads of registered teachers and of their routing, as protocols (the teacher registry,
:mod:`teachers.registry` and :mod:`teachers.router`, provides them; the merge imports nothing of it), and the
fingerprint of a set of teachers. Light: no torch, so the registry's command line stays quick."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Literal, Protocol

# What a teacher reads (a registry record's ``wrapper``; tasks/modeling/teacher.py says what each does).
Wrapper = Literal["plain", "aligned", "context", "guided"]
WRAPPERS: tuple[Wrapper, ...] = ("plain", "aligned", "context", "guided")
OWN_TEXT_WRAPPERS: tuple[Wrapper, ...] = ("aligned", "context")  # those that render and read their own text


class TeacherRecord(Protocol):
    """What the merge reads of a registered teacher (:class:`teachers.registry.TeacherRecord` is one)."""

    name: str
    route: str
    model_uri: str
    tokenizer_fingerprint: str
    trust_remote_code: bool
    endpoint: str
    transport: str  # auto | checkpoint | engine | endpoint
    wrapper: str  # one of WRAPPERS
    context_template: str  # a context teacher's rendering of a row's context ('' the default)
    guide_fraction: float  # a guided teacher: share of its own sample its route's rollouts start from (0 others)
    guide_steps: int  # a guided teacher: on-policy steps over which that share is withdrawn to none (0 others)


class Routing(Protocol):
    """What the merge asks of its router (:class:`teachers.router.Router` is one): route -> its teachers (the first
    the primary) and how they combine."""

    def teacher_for(self, route: str) -> TeacherRecord:
        """The route's primary teacher (what needs one: off-policy samples, evaluation flows)."""

    def teachers_for(self, route: str) -> list[TeacherRecord]:
        """Every teacher of the route, the primary first."""

    def combine_for(self, route: str) -> tuple[str, list[float]]:
        """How the route's teachers combine (a :data:`tasks.specs.spec.CombineMode`) and their weights (empty:
        uniform); ``("select", [])`` for a route with one teacher."""

    def teachers(self) -> list[TeacherRecord]:
        """Every teacher of every route, by name."""

    def group(self, routes_per_row: Iterable[str]) -> dict[str, list[int]]: ...


def reads_own_text(record: TeacherRecord) -> bool:
    """Whether a registered teacher renders each row its own way and reads the student's response as text (an
    ``aligned`` or a ``context`` wrapper), rather than scoring the student's exact sequence."""
    return getattr(record, "wrapper", "plain") in OWN_TEXT_WRAPPERS


def combining_refusal(router: Routing, routes: Iterable[str], teacher_backend: str) -> str:
    """Why ``teacher_backend`` cannot serve ``routes`` ('' when it can): a route that combines several teachers needs
    their checkpoints' full distributions, i.e. the ``hf`` backend. The text follows the value it refuses."""
    combined = sorted(r for r in routes if len(router.teachers_for(r)) > 1)
    if not combined or teacher_backend == "hf":
        return ""
    return (f"{teacher_backend!r}, but route(s) {combined} combine several teachers, which needs 'hf' (their "
            "checkpoints' full distributions); expected opd.teacher_backend hf, or one teacher per route")


def guided_routes(router: Routing, routes: Iterable[str]) -> dict[str, TeacherRecord]:
    """Route -> its teacher, for the ``routes`` whose (primary) teacher is a guided one (guided OPD), sorted."""
    return {r: rec for r in sorted(routes) if getattr(rec := router.teacher_for(r), "wrapper", "plain") == "guided"}


def guided_refusal(router: Routing, routes: Iterable[str], rollout_backend: str) -> str:
    """Why ``rollout_backend`` cannot make ``routes``' rollouts ('' when it can): a route whose teacher is a guided one
    (its prefixes continued by the student) needs the transformers backend. The text follows the value it refuses."""
    guided = list(guided_routes(router, routes))
    if not guided or rollout_backend == "hf":
        return ""
    return (f"{rollout_backend!r}, but route(s) {guided} have a guided teacher, whose prefixes the student continues "
            "on the transformers backend; expected opd.rollout_backend hf")


def registry_fingerprint(records: Iterable[TeacherRecord]) -> str:
    """Short hash of which checkpoints (and tokenizers) serve as teachers, for MLflow tags and the merge's key."""
    payload = sorted([r.name, r.model_uri, r.tokenizer_fingerprint]
                     + ([r.wrapper] if getattr(r, "wrapper", "plain") != "plain" else [])
                     + ([r.context_template] if getattr(r, "context_template", "") else [])
                     + ([r.guide_fraction, r.guide_steps] if getattr(r, "guide_steps", 0) else []) for r in records)
    return "sha256:" + hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]
