"""Restoration (GLM-5's practice): after merge k of a chain, a route the student lost gets the best earlier checkpoint
of the chain, or the chain's base, as its teacher in merge k+1.

A chain is the MLflow runs of its merges, oldest first; each run holds what it started from (tag ``student_uri``),
what it made (tag ``merged_student_uri``), its teachers (tag ``teachers``) and, per route, the held-out accuracy of
its student (``accuracy/<route>``), of its start (``base_accuracy/<route>``) and the retention (``retention/<route>``).
:func:`restoration_plan` is pure: which routes to restore and from which checkpoint. :func:`read_chain` reads the
runs; the flow (flows/restore.py) registers each chosen checkpoint as a teacher of its route and runs merge k+1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChainRun:
    """One merge of a chain, as its MLflow run records it."""

    run_id: str
    start_uri: str  # the student it started from
    merged_uri: str  # the student it made
    teachers: list[str]  # its teacher names
    accuracy: dict[str, float] = field(default_factory=dict)  # route -> its student's held-out accuracy
    base_accuracy: dict[str, float] = field(default_factory=dict)  # route -> its start's held-out accuracy
    retention: dict[str, float] = field(default_factory=dict)  # route -> retention of its teacher


@dataclass(frozen=True)
class Restoration:
    """Route ``route`` restored in the next merge: its teacher the checkpoint ``uri`` (merge ``source``'s student, or
    the chain's base: ``source`` ``base``), which scored ``accuracy`` on the route against the last merge's ``lost``."""

    route: str
    source: str
    uri: str
    accuracy: float
    lost: float


def restoration_plan(chain: Sequence[ChainRun], restore_below: float) -> dict[str, Restoration]:
    """Route -> its restoration, for each route of the last merge whose retention is below ``restore_below`` and for
    which an earlier checkpoint of the chain (an earlier merge's student, or the first merge's start: the base) scored
    higher on it than the last merge's student did; the best such checkpoint (ties: the latest). Routes without a
    better earlier checkpoint keep their teacher."""
    if not chain:
        raise ValueError("a restoration needs the chain's merges (at least one MLflow run)")
    last, earlier = chain[-1], chain[:-1]
    plan: dict[str, Restoration] = {}
    for route, retained in sorted(last.retention.items()):
        if not retained < restore_below or route not in last.accuracy:
            continue
        candidates = [("base", chain[0].start_uri, chain[0].base_accuracy.get(route))]
        candidates += [(run.run_id, run.merged_uri, run.accuracy.get(route)) for run in earlier]
        scored = [(acc, i, source, uri) for i, (source, uri, acc) in enumerate(candidates) if acc is not None]
        if not scored:
            continue
        acc, _, source, uri = max(scored)
        if acc > last.accuracy[route]:
            plan[route] = Restoration(route, source, uri, acc, last.accuracy[route])
    return plan


def next_teachers(last: ChainRun, plan: Mapping[str, Restoration], teacher_route: Mapping[str, str],
                  restorers: Mapping[str, str]) -> list[str]:
    """Merge k+1's teachers: the last merge's, with each restored route's teacher(s) replaced by its restoration
    teacher (``restorers``: route -> the registered name). ``teacher_route``: teacher name -> its route."""
    kept = [name for name in last.teachers if teacher_route.get(name) not in plan]
    return kept + [restorers[r] for r in sorted(plan)]


def read_chain(run_ids: Sequence[str], client) -> list[ChainRun]:
    """The chain's merges from MLflow (``client``: an ``MlflowClient``), oldest first. ValueError naming a run that
    is not a finished merge (no merged student recorded)."""
    runs = []
    for run_id in run_ids:
        run = client.get_run(run_id)
        tags, metrics = run.data.tags, run.data.metrics
        if not tags.get("merged_student_uri"):
            raise ValueError(f"MLflow run {run_id} has no merged student (tag merged_student_uri): expected the run "
                             "of a finished merge")

        runs.append(ChainRun(run_id, tags.get("student_uri", ""), tags["merged_student_uri"],
                             [t for t in tags.get("teachers", "").split(",") if t], _per_route(metrics, "accuracy/"),
                             _per_route(metrics, "base_accuracy/"), _per_route(metrics, "retention/")))
    return runs


def _per_route(metrics: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Route -> value of the metrics ``<prefix><route>`` (not the per-teacher ``<prefix><route>/<teacher>``)."""
    return {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix) and "/" not in k[len(prefix):]}
