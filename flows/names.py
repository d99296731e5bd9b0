"""Flow run names that say what ran (``merge-spec-rev-low+spec-sort-low-reverse_kl-20261129-1802``): the same
string names the MLflow run, so the Prefect UI and MLflow list the same runs under the same names."""

from __future__ import annotations

from datetime import datetime
from typing import Callable, TypeVar

from pydantic import BaseModel

C = TypeVar("C", bound=BaseModel)


def stamp() -> str:
    return f"{datetime.now():%Y%m%d-%H%M%S}"


def teachers_part(teachers: list[str], n_routes: int) -> str:
    return "+".join(teachers) if 0 < len(teachers) <= 3 else f"{len(teachers) or n_routes}teachers"


def routes_part(cfg) -> str:
    """``3routes`` for the built-in world, the spec file's name (``routes.yaml`` -> ``routes``) for a user's spec
    (its routes are known once the file is read; the name must not read it), ``inline-<sha12>`` for an inline one."""
    from pathlib import Path

    from tasks.specs.spec import inline_name, is_inline

    if is_inline(cfg.spec):
        return inline_name(cfg.spec)
    return Path(cfg.spec).stem if cfg.spec else f"{len(cfg.world.routes)}routes"


def merge_name(cfg) -> str:
    teachers = teachers_part(cfg.teachers, len(cfg.world.routes)) if cfg.teachers or not cfg.spec else \
        f"{routes_part(cfg)}-newest"
    return f"merge-{teachers}-{cfg.label or cfg.opd.loss}-{stamp()}"


def pipeline_name(cfg) -> str:
    return f"pipeline-{cfg.profile}-{routes_part(cfg)}-{cfg.opd.loss}-{stamp()}"


def specialists_name(cfg) -> str:
    steps = cfg.rl.steps if cfg.trainer == "rl" else cfg.train.steps
    return f"specialists-{cfg.trainer}-{routes_part(cfg)}-{steps}steps-{stamp()}"


def from_parameters(config_cls: type[C], build: Callable[[C], str], param: str = "cfg") -> Callable[[], str]:
    """A ``flow_run_name`` callable: builds the name from the run's config parameter (an instance when the flow is
    called from Python, a dict when a deployment runs it; defaults when it was not passed)."""

    def name() -> str:
        from prefect.runtime import flow_run

        value = (flow_run.parameters or {}).get(param)
        cfg = value if isinstance(value, config_cls) else config_cls.model_validate(value or {})
        return build(cfg)

    return name


def current_run_name(default: str) -> str:
    """The Prefect flow run's name inside a flow run, else ``default``."""
    from prefect.runtime import flow_run

    return flow_run.name or default
