"""End to end on a user's own route spec (tests/data/user_spec, the README's "Bring your own routes"): the whole
pipeline runs from the spec alone (chat-templated prompts, a module:function verifier); the MLflow run records the
spec and its hash and the retention per domain label; and the merged student, registered as a teacher with
`python -m teachers register`, serves a route of a second merge."""

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from tasks.config import pipeline_config
from tasks.evaluation.evaluate import route_mean
from tasks.common.paths import PROJECT_ROOT
from tasks.specs.prompt_set import spec_digest
from tasks.tracking.runs import tracking_uri

pytestmark = pytest.mark.e2e

SPEC = PROJECT_ROOT / "tests" / "data" / "user_spec" / "routes.yaml"


@pytest.fixture(scope="module")
def user_pipeline(prefect_server):
    """The quick profile on the user's spec, cut short (mechanics, not quality): any specialist accuracy accepted."""
    from flows.pipeline import pipeline

    cfg = pipeline_config("quick", spec=str(SPEC), base_train={"steps": 60}, specialist_train={"steps": 30},
                          min_accuracy=0.0, experiment="user-spec",
                          opd={"steps": 8, "eval_every": 1000, "batch_size": 12, "gate_threshold": 0.0, "pass_k": 0})
    return cfg, pipeline(cfg)


def test_the_pipeline_runs_from_the_users_spec_and_mlflow_records_it(user_pipeline):
    cfg, out = user_pipeline
    assert [row["route"] for row in out["rows"]] == ["reverse", "reverse-think", "letters"]
    assert sorted(out["teachers"]) == ["spec-letters", "spec-reverse", "spec-reverse-think"]
    client = MlflowClient(tracking_uri())
    run = client.get_run(out["run_id"])
    assert run.data.params["spec"] == str(SPEC)
    assert run.data.params["spec_sha256"] == spec_digest(SPEC.read_text())
    logged = mlflow.artifacts.download_artifacts(run_id=out["run_id"], artifact_path="spec/spec.yaml",
                                                 tracking_uri=tracking_uri())
    assert open(logged).read() == SPEC.read_text()  # the spec as its author wrote it
    # Retention per domain label: the mean over that domain's routes, logged beside the per-route keys.
    retention = {row["route"]: row["retention"] for row in out["rows"]}
    metrics = run.data.metrics
    assert metrics["retention_by/domain/words"] == pytest.approx(route_mean([retention["reverse"],
                                                                             retention["reverse-think"]]))
    assert metrics["retention_by/domain/count"] == pytest.approx(retention["letters"])
    assert metrics["retention_by/budget/high"] == pytest.approx(retention["reverse-think"])
    assert out["retention_by"]["domain/words"] == pytest.approx(metrics["retention_by/domain/words"])


def test_the_merged_student_registered_as_a_teacher_serves_a_second_merge(user_pipeline, capsys):
    from flows.merge import merge
    from teachers.cli import main as teachers_cli

    from pathlib import Path

    from tasks.specs.tokenizer import load_tokenizer

    cfg, first = user_pipeline
    folder = Path(first["student_uri"])
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()}
    assert load_tokenizer(folder).chat_template == load_tokenizer(first["base_uri"]).chat_template
    # The merged student's folder is a complete HF checkpoint (safetensors, tokenizer with its chat template,
    # generation config): registered against the student's (the base's) tokenizer like any specialist.
    code = teachers_cli(["register", "--name", "merged-letters", "--route", "letters", "--model_uri",
                         first["student_uri"], "--student_tokenizer", first["base_uri"], "--no_mlflow"])
    assert code == 0, capsys.readouterr().err
    second = merge(cfg.merge(first["base_uri"], ["spec-reverse", "spec-reverse-think", "merged-letters"],
                             opd={"steps": 2}, label="from-merged"))
    row = next(r for r in second["rows"] if r["route"] == "letters")
    assert row["teacher"] == "merged-letters"
    # The first merge's student, scored as the second merge's teacher on the same held-out prompts with the same
    # verifier and cap, gets exactly the accuracy the first merge measured for it.
    first_row = next(r for r in first["rows"] if r["route"] == "letters")
    assert row["teacher_accuracy"] == first_row["student_accuracy"]

