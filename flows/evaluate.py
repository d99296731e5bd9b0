"""Flow `evaluate`: score any checkpoint on each route's held-out prompts against the routed teachers and the base,
as the merge reports it: retention = its accuracy / the teacher's, gain recovered = (its accuracy - the base's) /
(the teacher's - the base's). A route with several teachers (the spec's ``teachers``) is measured against the best of
them, each teacher's accuracy kept beside it. Logged to MLflow (experiment `opd-eval`), printed as the merge's retention
table (with its warning when the model is below the base on a route) and published as a Prefect table.

Run:  python -m flows.evaluate --profile quick                       # the @champion merged student
      python -m flows.evaluate --model_uri .opd/models/merged/<run id> --teachers '["spec-rev-low"]'
      python -m flows.evaluate --model_uri 'models:/opd-student/3'   # any MLflow model URI or local path
      python -m flows.evaluate --base_uri .opd/models/base-<hash>    # another base; --base_uri none: no base
"""

from __future__ import annotations

import re
import sys

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import Field

from flows.names import from_parameters, stamp
from tasks.config import SpecInput, WorldConfig, _Config, pipeline_config, spec_field
from tasks.evaluation.evaluate import (RouteScore, below_base, evaluate_prompt_set, mean_retention, retention_row,
                                      teacher_metrics)
from tasks.common.log import link, say
from tasks.modeling.models import load_model
from tasks.preflight import CONFIG, Problem, check_checkpoint
from teachers.preflight import registry_problems, routing_problems
from tasks.training.pretrain import latest_base, prompt_set_task
from tasks.specs.prompt_set import load_prompt_set
from tasks.specs.tokenizer import load_tokenizer
from tasks.tracking.runs import (CHAMPION, STUDENT_MODEL, config_params, end_run, format_retention_table, log_metrics,
                                 log_table, run_url, start_run)
from teachers.registry import TeacherRegistry
from teachers.router import Router


NO_BASE = "none"  # base_uri that skips the base


class EvaluateConfig(_Config):
    """What to evaluate, on which routes, against which teachers."""

    spec: SpecInput = spec_field()
    world: WorldConfig = Field(default_factory=WorldConfig)
    model_uri: str = Field(
        "", description=f"Local path, hub id or MLflow model URI; empty = models:/{STUDENT_MODEL}@{CHAMPION}."
    )
    teachers: list[str] = Field(default_factory=list, description="Teacher names; empty = newest teacher per route.")
    base_uri: str = Field(
        "", description="The base checkpoint (local path or hub id) measured on the same prompts, for each route's "
        "gain recovered = (model - base) / (teacher - base); empty = the latest base of this state folder (the merge's "
        f"default student) when there is one; '{NO_BASE}' = no base."
    )
    experiment: str = Field("opd-eval", min_length=1, description="MLflow experiment of the evaluation run.")


def _name(cfg: EvaluateConfig) -> str:
    return f"evaluate-{(cfg.model_uri or f'{STUDENT_MODEL}@{CHAMPION}').rstrip('/').split('/')[-1]}-{stamp()}"


def resolve_model(uri: str) -> str:
    """A local folder for ``uri``: MLflow model URIs (``models:/name@alias``, ``models:/name/3``) are downloaded."""
    uri = uri or f"models:/{STUDENT_MODEL}@{CHAMPION}"
    if uri.startswith("models:/") or uri.startswith("runs:/"):
        import mlflow.artifacts

        from tasks.tracking.runs import tracking_uri

        return mlflow.artifacts.download_artifacts(artifact_uri=uri, tracking_uri=tracking_uri())
    return uri


def resolve_base(uri: str) -> str | None:
    """The base checkpoint ``base_uri`` names: itself; empty = the state folder's latest base, None when there is none
    yet; :data:`NO_BASE` = None."""
    if uri == NO_BASE:
        return None
    if uri:
        return uri
    try:
        return latest_base()
    except FileNotFoundError:
        return None


def input_problems(cfg: EvaluateConfig) -> list[Problem]:
    """What :func:`main` refuses before Prefect starts: an MLflow model URI that names no registered version (an empty
    ``model_uri`` means the champion, which only a merge creates), a base checkpoint that is not there or does not
    load, a registry that does not read, routes without a teacher."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from tasks.common.log import redact
    from tasks.tracking.runs import tracking_uri

    problems = []
    uri = cfg.model_uri or f"models:/{STUDENT_MODEL}@{CHAMPION}"
    m = re.match(r"^models:/([^/@]+)(?:@([^/]+)|/(\d+))$", uri)
    if m:
        client = MlflowClient(tracking_uri())
        try:
            client.get_model_version_by_alias(m[1], m[2]) if m[2] else client.get_model_version(m[1], m[3])
        except MlflowException as e:
            if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise
            found = f"{uri} is not in the MLflow model registry at {redact(tracking_uri())}"
            problems.append(Problem(CONFIG, "model_uri", f"empty, and no merged student yet: {found}; expected "
                                    "a checkpoint (--model_uri PATH), or a merge first (python -m flows.merge)"
                                    if not cfg.model_uri else f"{found}; expected a registered model version"))
    if base := resolve_base(cfg.base_uri):
        problems += check_checkpoint(base, "base_uri", grant=" (the base never runs custom code)").problems
    registry, found = registry_problems()
    problems += found
    if registry is not None and not cfg.spec:  # a spec's routes are checked against the registry when it is read
        problems += routing_problems(registry, cfg.world.routes, cfg.teachers)[2]
    return problems


@flow(name="evaluate", flow_run_name=from_parameters(EvaluateConfig, _name))
def evaluate(cfg: EvaluateConfig = EvaluateConfig()) -> dict:
    """Greedy accuracy per route for the model, the base and each of the route's teachers; the retention table."""
    local, base = resolve_model(cfg.model_uri), resolve_base(cfg.base_uri)
    ps = load_prompt_set(prompt_set_task(cfg.spec, cfg.world, local))
    tok = load_tokenizer(local)
    router = Router.for_merge(TeacherRegistry(), ps.routes, cfg.teachers, ps.spec)
    sets = ps.eval_sets()

    def scores(uri: str, routes: list[str]) -> dict[str, RouteScore]:
        model = load_model(uri).eval()  # one load per checkpoint, for all of its routes
        return evaluate_prompt_set(model, tok, ps, {r: sets[r] for r in routes})

    model_s = scores(local, ps.routes)
    base_s = scores(base, ps.routes) if base else dict.fromkeys(ps.routes)
    if not base:
        why = f"base_uri {NO_BASE!r}" if cfg.base_uri == NO_BASE else "no base model recorded here"
        say(f"no base measured ({why}): base_accuracy and gain_recovered are left empty")
    names = {r: [t.name for t in router.teachers_for(r)] for r in ps.routes}  # the primary first
    measured = {t.name: scores(t.model_uri, [r for r in ps.routes if t.name in names[r]]) for t in router.teachers()}
    each = {r: {name: measured[name][r].accuracy for name in names[r]} for r in ps.routes}
    rows = []
    for r in ps.routes:
        best = max(each[r], key=each[r].get)  # a tie goes to the first (the primary)
        rows.append({**retention_row(r, best, model_s[r].accuracy, each[r][best],
                                     base_s[r] and base_s[r].accuracy),
                     "base_exact": base_s[r] and base_s[r].exact, "teacher_exact": measured[best][r].exact,
                     "student_exact": model_s[r].exact, "model_accuracy": model_s[r].accuracy,
                     "teacher_accuracies": each[r]})
    run_id = start_run(cfg.experiment, _name(cfg), config_params(cfg),
                       {"model_local_path": local, **({"base_local_path": base} if base else {})})
    metrics = {f"{k}/{row['route']}": row[k] for row in rows
               for k in ("retention", "model_accuracy", "base_accuracy", "gain_recovered") if row[k] is not None}
    metrics |= {f"exact/{row['route']}": row["student_exact"] for row in rows}
    metrics |= teacher_metrics("teacher_accuracy", each)
    metrics["retention/mean"] = mean_retention(rows)
    log_metrics(run_id, metrics, 0)
    log_table(run_id, rows, "retention.json")
    end_run(run_id)
    say(f"retention per route (mean {metrics['retention/mean']:.3f}):\n{format_retention_table(rows)}")
    if warning := below_base(rows):
        say(warning)
    create_table_artifact(table=rows, key="evaluation", description=f"{cfg.model_uri or 'champion'}; MLflow {run_id}")
    link(run_url(run_id), "MLflow evaluation run", "evaluation-mlflow-run")
    return {"run_id": run_id, "rows": rows, "mean_retention": metrics["retention/mean"], "model_path": local,
            "base_path": base}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config

    cfg = parse_config(argv, lambda profile="default": EvaluateConfig(world=pipeline_config(profile).world), __doc__,
                       with_profile=True, check=input_problems)  # refused before Prefect starts
    return evaluate(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
