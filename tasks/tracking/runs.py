"""MLflow: where runs go, how configs become params, and the retention table and chart of a merge."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import mlflow
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from tasks.config import flatten
from tasks.common.log import redact  # noqa: F401  (re-exported: MLflow params and tags pass through it)
from tasks.common.paths import state_dir


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else a sqlite store inside the project state (never the cwd default)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{state_dir() / 'mlflow.db'}"


def setup_mlflow(experiment: str) -> str:
    """Point MLflow at the project store and return the experiment id (artifacts kept beside the database)."""
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if uri.startswith("sqlite:///"):
        artifact_location = (state_dir() / "mlartifacts").as_uri()
    try:
        return client.create_experiment(experiment, artifact_location=artifact_location)
    except mlflow.exceptions.MlflowException:  # created by a concurrent process in between
        return client.get_experiment_by_name(experiment).experiment_id


def config_params(cfg: BaseModel) -> dict[str, str]:
    """Every config field as an MLflow param, named as on the command line (``opd.steps``); URIs redacted. An inline
    route spec is logged as the path of the file it was written to (its text is the run's ``spec/`` artifact, its
    hash the param ``spec_sha256``), not as the whole mapping."""
    from tasks.specs.spec import is_inline, write_inline_spec

    out = {}
    for k, v in flatten(cfg).items():
        if k.rsplit(".", 1)[-1] == "spec" and is_inline(v):
            v = str(write_inline_spec(v))
        out[k] = redact(json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else str(v))
    return out


def _tags(tags: dict[str, Any] | None) -> dict[str, str]:
    return {k: redact(str(v)) for k, v in (tags or {}).items()}


def start_run(experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str] | None = None) -> str:
    """Create a run by id (safe from worker threads, unlike the fluent API's active run) with its params; returns id."""
    client = MlflowClient(tracking_uri())
    run_id = client.create_run(setup_mlflow(experiment), run_name=run_name, tags=_tags(tags)).info.run_id
    log_params(run_id, params)
    return run_id


def end_run(run_id: str, tags: dict[str, str] | None = None, status: str = "FINISHED") -> None:
    client = MlflowClient(tracking_uri())
    for k, v in _tags(tags).items():
        client.set_tag(run_id, k, v)
    client.set_terminated(run_id, status=status)


def log_params(run_id: str, params: dict[str, Any]) -> None:
    MlflowClient(tracking_uri()).log_batch(run_id, params=[Param(k, redact(str(v))) for k, v in params.items()])


def log_metrics(run_id: str, metrics: dict[str, float], step: int) -> None:
    """One batched write of ``metric/route`` keys for a step."""
    ts = int(time.time() * 1000)
    MlflowClient(tracking_uri()).log_batch(
        run_id, metrics=[Metric(k, float(v), ts, step) for k, v in sorted(metrics.items())]
    )


def reopen_run(run_id: str, resumed_from: str) -> None:
    """Mark a run RUNNING again (a resumed merge goes on logging into the run it started) and add where it resumed
    from to its ``resumed_from`` tag (one comma-separated entry per resume)."""
    client = MlflowClient(tracking_uri())
    before = client.get_run(run_id).data.tags.get("resumed_from")
    client.set_tag(run_id, "resumed_from", f"{before},{resumed_from}" if before else resumed_from)
    client.update_run(run_id, status="RUNNING")


def logged_metrics(run_id: str, from_step: int = 0) -> dict[tuple[str, int], float]:
    """``(key, step) -> value`` of the run's metrics at ``from_step`` and later (the last value logged per step)."""
    client = MlflowClient(tracking_uri())
    out: dict[tuple[str, int], float] = {}
    for key in client.get_run(run_id).data.metrics:
        for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.timestamp):
            if m.step >= from_step:
                out[(key, m.step)] = m.value
    return out


def retention_figure(rows: list[dict[str, Any]], title: str):
    """Bar chart: teacher, base and student accuracy per route, with retention written above each student bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routes = [r["route"] for r in rows]
    x = range(len(routes))
    w = 0.27
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(routes)), 4))
    ax.bar([i - w for i in x], [r["base_accuracy"] for r in rows], w, label="base", color="#bbbbbb")
    ax.bar(list(x), [r["teacher_accuracy"] for r in rows], w, label="teacher", color="#4c72b0")
    bars = ax.bar([i + w for i in x], [r["student_accuracy"] for r in rows], w, label="student", color="#dd8452")
    for b, r in zip(bars, rows):
        ax.annotate(f"{r['retention']:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(x), routes, rotation=20)
    ax.set_ylim(0, 1.3)
    ax.set_ylabel("accuracy (retention above student bars)")
    ax.set_title(title)
    ax.legend(loc="upper center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def log_spec(run_id: str, prompt_set: str | os.PathLike) -> None:
    """The route spec a run read, as its author wrote it (artifact ``spec/<file>``), and its hash as the param
    ``spec_sha256``: two runs are compared on what their routes were."""
    from pathlib import Path

    from tasks.specs.prompt_set import load_prompt_set

    ps = load_prompt_set(prompt_set)
    client = MlflowClient(tracking_uri())
    client.log_param(run_id, "spec_sha256", ps.spec_sha256)
    client.log_artifact(run_id, str(Path(prompt_set) / "spec.yaml"), "spec")


def log_table(run_id: str, records: list[dict[str, Any]], artifact_file: str) -> None:
    """Rows of dicts as an MLflow table artifact (shown by the UI's artifact view and comparable across runs)."""
    MlflowClient(tracking_uri()).log_table(
        run_id, data={k: [row[k] for row in records] for k in records[0]}, artifact_file=artifact_file
    )


def log_figure(run_id: str, fig, artifact_file: str) -> None:
    import matplotlib.pyplot as plt

    MlflowClient(tracking_uri()).log_figure(run_id, fig, artifact_file)
    plt.close(fig)


def log_retention(run_id: str, rows: list[dict[str, Any]], student_dir: str | os.PathLike) -> None:
    """The end of a merge run: the retention table, its bar chart and the student checkpoint as artifacts."""
    log_table(run_id, rows, "retention.json")
    log_figure(run_id, retention_figure(rows, f"OPD merge {run_id[:8]}: accuracy per route, retention above the "
                                              "student bars"), "retention.png")
    MlflowClient(tracking_uri()).log_artifacts(run_id, str(student_dir), "student")


EXACT_KEYS = ("base_exact", "teacher_exact", "student_exact")


def format_retention_table(rows: list[dict[str, Any]]) -> str:
    """The retention table: accuracies by each route's verifier, retention and gain recovered; where a route's
    verifier is lenient (an answer extractor, so some row's exact-format score differs from its accuracy), the
    exact-format scores of base, teacher and student beside them."""
    from tasks.common.table import format_table

    keys = ["route", "teacher", "base_accuracy", "teacher_accuracy", "student_accuracy", "retention"]
    headers = ["route", "teacher", "base acc", "teacher acc", "student acc", "retention", "gain rec."]
    # gain recovered: (student - base) / (teacher - base); "-" where the teacher gained nothing over the base.
    body = [[r[k] for k in keys] + [r.get("gain_recovered")] for r in rows]
    lenient = any(r.get(e) is not None and r.get(e) != r.get(a)
                  for r in rows for e, a in zip(EXACT_KEYS, ("base_accuracy", "teacher_accuracy", "student_accuracy")))
    if lenient:
        headers += ["base exact", "teacher exact", "student exact"]
        body = [line + [r.get(e) for e in EXACT_KEYS] for line, r in zip(body, rows)]
    return format_table(headers, body)


# ---------------------------------------------------------------------------------------------- model registry

STUDENT_MODEL = "opd-student"
CHAMPION = "champion"


def teacher_model_name(route: str) -> str:
    """One registered model per route: every teacher ever registered for it is a version."""
    return f"teacher-{route}"


def ui_url() -> str:
    """Base URL of the MLflow UI for links: ``$OPD_MLFLOW_UI``, else the tracking server itself when it is one, else
    where ``make ui-mlflow`` serves it."""
    uri = tracking_uri()
    return os.environ.get("OPD_MLFLOW_UI") or (uri if uri.startswith("http") else "http://127.0.0.1:5000")


def run_url(run_id: str) -> str:
    run = MlflowClient(tracking_uri()).get_run(run_id)
    return f"{ui_url().rstrip('/')}/#/experiments/{run.info.experiment_id}/runs/{run_id}"


def registered_version(name: str, run_id: str) -> str | None:
    """The version of model ``name`` that run ``run_id`` registered, if it did."""
    versions = MlflowClient(tracking_uri()).search_model_versions(f"run_id = '{run_id}'")
    return next((str(v.version) for v in versions if v.name == name), None)


def register_version(name: str, run_id: str, artifact_path: str, tags: dict[str, str], description: str = "") -> str:
    """Register the run's artifact folder as a new version of model ``name`` (created on first use); returns the
    version number."""
    client = MlflowClient(tracking_uri())
    try:
        client.get_registered_model(name)
    except mlflow.exceptions.MlflowException:
        try:
            client.create_registered_model(name, description=description or None)
        except mlflow.exceptions.MlflowException:  # created concurrently
            pass
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/{artifact_path}"
    mv = client.create_model_version(name, source, run_id=run_id, tags=_tags(tags))
    return str(mv.version)


def promote_if_best(name: str, version: str, metric: str = "retention/mean", alias: str = CHAMPION) -> bool:
    """Move ``@alias`` to ``version`` when its run's ``metric`` beats the current holder's (or nobody holds it)."""
    client = MlflowClient(tracking_uri())
    mine = client.get_run(client.get_model_version(name, version).run_id).data.metrics.get(metric, float("-inf"))
    try:
        holder = client.get_model_version_by_alias(name, alias)
        best = client.get_run(holder.run_id).data.metrics.get(metric, float("-inf"))
    except mlflow.exceptions.MlflowException:
        best = float("-inf")
    if mine > best:
        client.set_registered_model_alias(name, alias, version)
        return True
    return False


def publish_teacher(record, checkpoint_run_id: str | None = None) -> str:
    """Mirror a teacher registry record into the MLflow model registry as a version of ``teacher-<route>`` and point
    ``@active`` at it. The checkpoint is logged to a run of experiment ``opd-teachers`` (or taken from
    ``checkpoint_run_id``'s ``checkpoint/`` artifacts). Returns the version number."""
    from pathlib import Path

    client = MlflowClient(tracking_uri())
    run_id = checkpoint_run_id
    if run_id is None:
        run_id = start_run("opd-teachers", f"teacher-{record.name}",
                           {"route": record.route, "model_uri": record.model_uri, "eval_score": record.eval_score},
                           {"teacher": record.name, "source": record.provenance.source})
        if Path(record.model_uri).is_dir():
            client.log_artifacts(run_id, record.model_uri, "checkpoint")
        end_run(run_id)
    tags = {"teacher": record.name, "route": record.route, "model_uri": record.model_uri,
            "tokenizer_fingerprint": record.tokenizer_fingerprint, "eval_score": record.eval_score,
            "source": record.provenance.source}
    name = teacher_model_name(record.route)
    version = register_version(name, run_id, "checkpoint", tags,
                               f"Specialist teachers for route {record.route} (one version per registration).")
    client.set_registered_model_alias(name, "active", version)
    return version
