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
    m = run.data.metrics
    for route in cfg.world.routes:
        for key in ("retention", "accuracy", "reverse_kl", "response_length", "entropy/student", "entropy/teacher",
                    "entropy_gap", "teacher_nll", "rollout_length", "truncated", f"pass_at_{cfg.opd.pass_k}"):
            assert f"{key}/{route}" in m, f"{key}/{route}"
        assert m[f"entropy_gap/{route}"] == pytest.approx(m[f"entropy/student/{route}"] - m[f"entropy/teacher/{route}"])
        assert 0 <= m[f"topk_overlap/{route}"] <= 1 and 0 <= m[f"repetition/{route}"] < 1
        assert m[f"teacher_nll/{route}"] > 0 and m[f"rollout_length/{route}"] >= 1
        assert 0 <= m[f"pass_at_{cfg.opd.pass_k}/{route}"] <= 1
    for name in result["teachers"]:
        assert m[f"teacher_tokens/{name}"] > 0 and m[f"time/teacher_total/{name}"] > 0
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
    # The default runner is threads: the specialists were trained in this very process.
    import os
    import socket

    here = f"{socket.gethostname()}:{os.getpid()}"
    mine = client.search_runs([exp.experiment_id], "params.base_uri = '%s'" % result["base_uri"])
    assert mine and {r.data.tags["process"] for r in mine} == {here}


# ------------------------------------------------------------------ operating it: names, model registry, compare


def test_flow_and_mlflow_runs_are_named_for_what_ran(quick_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    cfg, result = quick_run
    name = MlflowClient(tracking_uri()).get_run(result["run_id"]).info.run_name
    assert name.startswith("merge-" + "+".join(result["teachers"]) + "-reverse_kl-")
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        assert len(runs) == 1 and runs[0].state.is_completed()
        pipeline_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(like_="pipeline-quick-3routes-reverse_kl-")))
        assert pipeline_runs


def test_teachers_and_student_are_in_the_mlflow_model_registry(quick_run):
    from tasks.tracking import STUDENT_MODEL, teacher_model_name

    cfg, result = quick_run
    client = MlflowClient(tracking_uri())
    for name in result["teachers"]:
        route = name[len("spec-"):]
        active = client.get_model_version_by_alias(teacher_model_name(route), "active")
        assert active.tags["teacher"] == name and active.tags["source"] == "train-specialists"
        assert {"config.json", "model.safetensors"} <= {a.path.split("/")[-1] for a in
                                                       client.list_artifacts(active.run_id, "checkpoint")}
    version = client.get_model_version(STUDENT_MODEL, result["model_version"])
    assert version.run_id == result["run_id"]
    assert float(version.tags["mean_retention"]) == pytest.approx(result["mean_retention"], abs=1e-4)


@pytest.fixture(scope="module")
def second_merge(quick_run):
    from flows.merge import merge

    cfg, result = quick_run
    mcfg = cfg.merge(result["base_uri"], result["teachers"]).model_copy(update={"opd": cfg.opd.model_copy(
        update={"loss": "forward_kl", "steps": 60, "eval_every": 60})})
    return merge(mcfg)


def test_champion_alias_follows_the_best_mean_retention(quick_run, second_merge):
    from tasks.tracking import CHAMPION, STUDENT_MODEL

    _, first = quick_run
    client = MlflowClient(tracking_uri())
    champion = client.get_model_version_by_alias(STUDENT_MODEL, CHAMPION)
    best = max([first, second_merge], key=lambda r: r["mean_retention"])
    assert champion.run_id == best["run_id"]
    assert second_merge["champion"] == (best is second_merge)


def test_compare_merges_tabulates_retention_and_the_fields_that_differ(quick_run, second_merge):
    from flows.compare import CompareConfig, compare_merges

    cfg, first = quick_run
    out = compare_merges(CompareConfig(run_ids=[first["run_id"], second_merge["run_id"]]))
    assert out["headers"] == ["run", "run id", *cfg.world.routes, "mean"]
    by_id = {row[1]: row for row in out["rows"]}
    for res in (first, second_merge):
        row = by_id[res["run_id"]]
        assert row[-1] == pytest.approx(res["mean_retention"])
        assert row[2:-1] == pytest.approx([r["retention"] for r in res["rows"]])
    assert {"opd.loss", "opd.steps", "opd.eval_every"} <= set(out["differing"])
    assert out["differing"]["opd.loss"] == ["reverse_kl", "forward_kl"]
    assert "world.routes" not in out["differing"]
    client = MlflowClient(tracking_uri())
    files = {a.path for a in client.list_artifacts(out["run_id"])}
    assert {"retention_by_run.json", "retention_by_run.png", "differing_params.json"} <= files
    # By search instead of ids: the newest finished merges of the experiment (here these two), and a filter.
    searched = compare_merges(CompareConfig(experiment=cfg.experiment, max_runs=2))
    assert {row[1] for row in searched["rows"]} == {first["run_id"], second_merge["run_id"]}
    with pytest.raises(ValueError, match="need at least 2 merge runs"):
        compare_merges(CompareConfig(experiment=cfg.experiment, filter="params.`opd.loss` = 'forward_kl'"))


def test_evaluate_scores_the_champion_like_its_merge_did(quick_run, second_merge):
    from flows.evaluate import EvaluateConfig, evaluate

    cfg, first = quick_run
    best = max([first, second_merge], key=lambda r: r["mean_retention"])
    out = evaluate(EvaluateConfig(world=cfg.world))  # empty model_uri: models:/opd-student@champion
    # Same held-out prompts, same greedy decoding, same weights: the same accuracies as the merge measured.
    assert [r["model_accuracy"] for r in out["rows"]] == pytest.approx([r["student_accuracy"] for r in best["rows"]])
    assert out["mean_retention"] == pytest.approx(best["mean_retention"])


def test_register_teacher_flow_validates_then_writes_registry_and_mlflow(quick_run, tmp_path):
    from flows.register import RegisterConfig, register_teacher
    from tasks.tracking import teacher_model_name
    from teachers.registry import IncompatibleTeacher

    cfg, result = quick_run
    registry = TeacherRegistry()
    spec = registry.get(result["teachers"][0])
    out = register_teacher(RegisterConfig(name="ui-registered", route=spec.route, model_uri=spec.model_uri))
    assert registry.get("ui-registered").provenance.source == "register-teacher"
    active = MlflowClient(tracking_uri()).get_model_version_by_alias(teacher_model_name(spec.route), "active")
    assert str(active.version) == out["mlflow_version"] and active.tags["teacher"] == "ui-registered"
    before = registry.names()
    with pytest.raises(IncompatibleTeacher, match="does not load"):
        register_teacher(RegisterConfig(name="broken", route=spec.route, model_uri=str(tmp_path / "missing")))
    assert registry.names() == before
    registry.remove("ui-registered")
