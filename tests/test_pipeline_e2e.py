"""End to end, for real: the quick profile of the whole pipeline through Prefect, tracked in MLflow."""

import json

import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import pipeline
from flows.specialists import train_specialists
from tasks.config import pipeline_config
from tasks.tracking import tracking_uri
from teachers.registry import TeacherRegistry

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def quick_run(prefect_server):
    cfg = pipeline_config("quick")
    return cfg, pipeline(cfg)


def test_student_beats_base_on_every_route(quick_run):
    cfg, result = quick_run
    rows = {r["route"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(cfg.world.routes)
    for route, row in rows.items():
        assert row["teacher_accuracy"] >= cfg.min_accuracy, route
        assert row["student_accuracy"] > row["base_accuracy"], (route, row)
        assert row["retention"] == pytest.approx(row["student_accuracy"] / row["teacher_accuracy"])


def test_mlflow_holds_per_route_metrics_params_and_artifacts(quick_run):
    cfg, result = quick_run
    client = MlflowClient(tracking_uri())
    run = client.get_run(result["run_id"])
    for route in cfg.world.routes:
        for key in ("retention", "accuracy", "reverse_kl", "response_length"):
            assert f"{key}/{route}" in run.data.metrics, f"{key}/{route}"
        history = client.get_metric_history(run.info.run_id, f"retention/{route}")
        assert [m.step for m in history][0] == 0 and history[-1].step == cfg.opd.steps
    assert run.data.metrics["retention/mean"] == pytest.approx(result["mean_retention"])
    assert run.data.params["opd.steps"] == str(cfg.opd.steps)
    assert json.loads(run.data.params["world.routes"]) == cfg.world.routes
    assert set(run.data.tags["teachers"].split(",")) == set(result["teachers"])
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"retention.json", "retention.png", "student"} <= files
    table = json.loads(open(client.download_artifacts(run.info.run_id, "retention.json")).read())
    assert sorted(table["data"][i][0] for i in range(len(table["data"]))) == sorted(cfg.world.routes)


def test_registry_holds_one_teacher_per_route(quick_run):
    cfg, result = quick_run
    records = {r.name: r for r in TeacherRegistry().list()}
    for name in result["teachers"]:
        rec = records[name]
        assert rec.provenance.source == "train-specialists"
        assert rec.eval_score >= cfg.min_accuracy
    assert sorted(records[n].route for n in result["teachers"]) == sorted(cfg.world.routes)


def test_rerun_skips_finished_specialists(quick_run):
    cfg, result = quick_run
    client = MlflowClient(tracking_uri())
    exp = client.get_experiment_by_name("opd-specialists")
    before = len(client.search_runs([exp.experiment_id]))
    names = train_specialists(cfg.specialists(result["base_uri"]))
    assert sorted(names) == sorted(result["teachers"])
    # Cached tasks do not run their body, so no new specialist training run appears in MLflow.
    assert len(client.search_runs([exp.experiment_id])) == before
