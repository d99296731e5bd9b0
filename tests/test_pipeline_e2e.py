"""End to end, for real: the quick profile of the whole pipeline through Prefect, tracked in MLflow."""

import json

import pytest
from mlflow.tracking import MlflowClient

from flows.pipeline import pipeline
from flows.specialists import train_specialists
from tasks.config import pipeline_config
from tasks.tracking.runs import tracking_uri
from teachers.registry import TeacherRegistry
from tests.figures import QUICK_MEAN_RETENTION_FLOOR

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


def test_quick_merge_mean_retention_stays_in_its_band(quick_run):
    """The README's quick-profile figure (tests/figures.py), on this profile's fixed seeds."""
    _, result = quick_run
    print(f"\nquick merge: mean retention {result['mean_retention']:.3f} (floor {QUICK_MEAN_RETENTION_FLOOR}); "
          + ", ".join(f"{r['route']} {r['retention']:.3f}" for r in result["rows"]))
    assert result["mean_retention"] >= QUICK_MEAN_RETENTION_FLOOR


# ------------------------------------------------------------------ the student follows each route's own teacher


def greedy_completions(uri: str, prompts: list[str], cap: int) -> list[str]:
    from tasks.modeling.models import load_model
    from tasks.modeling.rollout import decode_responses, generate
    from tasks.specs.tokenizer import load_tokenizer

    tok = load_tokenizer(uri)
    return decode_responses(tok, generate(load_model(uri).eval(), tok, list(prompts), cap, greedy=True))


def merge_prompt_set(cfg, student_uri: str):
    """The prompt set a merge of ``cfg``'s built-in world reads (rendered with the student's tokenizer, as
    flows.merge builds it; cached, so this is the merge's own folder)."""
    from tasks.world.data import build_world
    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set
    from tasks.world.spec import write_world_spec

    return load_prompt_set(build_prompt_set(write_world_spec(cfg.world, build_world(cfg.world)), student_uri))


def routes_not_following(student_uri: str, intended: dict[str, str], teachers: dict[str, str], prompt_set,
                         tol: float = 0.05) -> dict[str, str]:
    """Route -> what went wrong, for each route on whose held-out prompts the student's greedy completions agree
    (whole text, scratchpad included) more often with another teacher than with the one meant for that route
    (``intended``: route -> teacher name; ``teachers``: name -> checkpoint). Accuracy cannot see this when the two
    teachers' answers are both right (e.g. with and without a scratchpad): the student must do what its route's
    teacher does. ``prompt_set``: the merge's (its held-out prompts and each route's cap)."""
    wrong: dict[str, str] = {}
    for route, (prompts, _) in prompt_set.eval_sets().items():
        if route not in intended:
            continue
        cap = prompt_set.cap(route)
        student = greedy_completions(student_uri, prompts, cap)
        agree = {name: sum(a == b for a, b in zip(student, greedy_completions(uri, prompts, cap))) / len(prompts)
                 for name, uri in teachers.items()}
        best = max(agree, key=agree.get)
        if agree[best] > agree[intended[route]] + tol:
            wrong[route] = (f"the student agrees with {best} on {agree[best]:.2f} of {route}'s held-out prompts, with "
                            f"its route's teacher {intended[route]} on {agree[intended[route]]:.2f}")
    return wrong


def test_the_student_follows_each_route_own_teacher(quick_run):
    cfg, result = quick_run
    registry = TeacherRegistry()
    teachers = {name: registry.get(name).model_uri for name in result["teachers"]}
    intended = {r["route"]: r["teacher"] for r in result["rows"]}
    assert intended == {route: f"spec-{route}" for route in cfg.world.routes}  # the route's own specialist
    assert routes_not_following(result["student_uri"], intended, teachers,
                                merge_prompt_set(cfg, result["base_uri"])) == {}


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
        # Every route's retention curve: step 0, every evaluation, the last step; its last point is the table's.
        history = client.get_metric_history(run.info.run_id, f"retention/{route}")
        assert [h.step for h in history] == list(range(0, cfg.opd.steps + 1, cfg.opd.eval_every)), route
        row = next(r for r in result["rows"] if r["route"] == route)
        assert history[-1].value == pytest.approx(row["retention"]), route
    for name in result["teachers"]:
        assert m[f"teacher_tokens/{name}"] > 0 and m[f"time/teacher_total/{name}"] > 0
    # The recovery diagnostic: only rev-high's completions have a trace before the answer ("5|edcba"); the low
    # routes' bare answers have none to derail. Its teacher, trained on gold traces only, is measured at step 0.
    for who in ("base", "teacher", "student"):
        assert {k for k in m if k.startswith(f"recovery/{who}/")} == {f"recovery/{who}/rev-high"}, who
        assert 0 <= m[f"recovery/{who}/rev-high"] <= 1
    assert [h.step for h in client.get_metric_history(run.info.run_id, "recovery/student/rev-high")] == [
        cfg.opd.steps]
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
    from tasks.tracking.runs import STUDENT_MODEL, teacher_model_name

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
    from tasks.tracking.runs import CHAMPION, STUDENT_MODEL

    _, first = quick_run
    client = MlflowClient(tracking_uri())
    champion = client.get_model_version_by_alias(STUDENT_MODEL, CHAMPION)
    best = max([first, second_merge], key=lambda r: r["mean_retention"])
    assert champion.run_id == best["run_id"]
    assert second_merge["champion"] == (best is second_merge)


def test_compare_merges_tabulates_retention_and_the_fields_that_differ(quick_run, second_merge):
    from flows.compare import CompareConfig, compare_merges
    from tasks.evaluation.compare import SUMMARY_HEADERS

    cfg, first = quick_run
    out = compare_merges(CompareConfig(run_ids=[first["run_id"], second_merge["run_id"]]))
    assert out["headers"] == ["run", "run id", *cfg.world.routes, "mean"]
    by_id = {row[1]: row for row in out["rows"]}
    for res in (first, second_merge):
        row = by_id[res["run_id"]]
        assert row[-1] == pytest.approx(res["mean_retention"])
        assert row[2:-1] == pytest.approx([r["retention"] for r in res["rows"]])
    # Each run in sum: worst route, mean gain recovered and exact score over its routes, minutes, student tokens.
    summary = {row[1]: dict(zip(SUMMARY_HEADERS, row)) for row in out["summary"]}
    for res in (first, second_merge):
        line, metrics = summary[res["run_id"]], MlflowClient(tracking_uri()).get_run(res["run_id"]).data.metrics
        assert line["mean retention"] == pytest.approx(res["mean_retention"])
        assert line["worst retention"] == pytest.approx(min(r["retention"] for r in res["rows"]))
        gains = [r["gain_recovered"] for r in res["rows"]]
        assert line["mean gain rec."] == pytest.approx(sum(gains) / len(gains))
        assert line["mean student exact"] == pytest.approx(sum(r["student_exact"] for r in res["rows"]) / len(gains))
        assert line["student tokens"] == metrics["rollout/student_tokens"] > 0
        assert 0 < line["minutes"] < 60
    assert summary[first["run_id"]]["student tokens"] > summary[second_merge["run_id"]]["student tokens"]
    assert "mean gain rec." in out["summary_table"]
    assert {"opd.loss", "opd.steps", "opd.eval_every"} <= set(out["differing"])
    assert out["differing"]["opd.loss"] == ["reverse_kl", "forward_kl"]
    assert "world.routes" not in out["differing"]
    client = MlflowClient(tracking_uri())
    files = {a.path for a in client.list_artifacts(out["run_id"])}
    assert {"retention_by_run.json", "summary_by_run.json", "retention_by_run.png", "differing_params.json"} <= files
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
    # The empty base_uri is the pipeline's base, the merge's student before training: the merge's base accuracies,
    # and each route's gain recovered from the three accuracies (None where the teacher gained nothing).
    assert out["base_path"] == quick_run[1]["base_uri"]
    assert [r["base_accuracy"] for r in out["rows"]] == pytest.approx([r["base_accuracy"] for r in best["rows"]])
    for row in out["rows"]:
        model, teacher, base = row["model_accuracy"], row["teacher_accuracy"], row["base_accuracy"]
        if teacher > base:
            assert row["gain_recovered"] == pytest.approx((model - base) / (teacher - base), abs=1e-9), row
        else:
            assert row["gain_recovered"] is None, row
    assert [r["gain_recovered"] for r in out["rows"]] == pytest.approx([r["gain_recovered"] for r in best["rows"]])


def test_register_teacher_flow_validates_then_writes_registry_and_mlflow(quick_run, tmp_path):
    from flows.register import RegisterConfig, register_teacher
    from tasks.tracking.runs import teacher_model_name
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


# ------------------------------------------------------------------ a wrong routing table makes a wrong merge


@pytest.fixture(scope="module")
def format_teachers(quick_run):
    """Two specialists trained on purpose to different answers on the same prompts (rev-low's and rev-high's): one
    answers only (``cba``), one writes the length first (``3|cba``). The rev verifier checks the text after the last
    ``|``, so both are right on both routes: only what the student writes tells which one it learned from."""
    from tasks.world.data import build_world, load_prompts
    from tasks.modeling.models import load_model, save_model
    from tasks.common.paths import models_dir
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.training.sft import train_sft
    from tasks.world.domains import Route, gold_completion

    cfg, result = quick_run
    world = build_world(cfg.world)
    tok = load_tokenizer(result["base_uri"])
    rows = load_prompts(world)["train"].filter(lambda x: x["route"] in ("rev-low", "rev-high"))
    uris = {}
    for name, style in (("fmt-answer", "rev-low"), ("fmt-scratchpad", "rev-high")):
        model = load_model(result["base_uri"])
        train_sft(model, tok, rows["prompt"], [gold_completion(Route.parse(style), p) for p in rows["problem"]],
                  cfg.specialist_train, desc=f"teacher {name}")
        uris[name] = str(save_model(model, tok, models_dir() / "wrong-routing" / name))
    return merge_prompt_set(cfg, result["base_uri"]), uris


def test_a_swapped_routing_table_makes_the_student_follow_the_wrong_teacher_and_the_check_says_so(quick_run,
                                                                                                   format_teachers):
    from flows.merge import merge

    cfg, result = quick_run
    prompt_set, uris = format_teachers
    sort_uri = TeacherRegistry().get("spec-sort-low").model_uri
    teachers = {**uris, "spec-sort-low": sort_uri}
    intended = {"rev-low": "fmt-answer", "rev-high": "fmt-scratchpad", "sort-low": "spec-sort-low"}
    # The teachers do differ on every rev prompt, whatever the budget tag says.
    for route in ("rev-low", "rev-high"):
        prompts = prompt_set.eval_sets()[route][0]
        answer, scratch = (greedy_completions(uris[n], prompts, 16) for n in ("fmt-answer", "fmt-scratchpad"))
        assert sum(a != b for a, b in zip(answer, scratch)) / len(prompts) >= 0.9, route
    registry = TeacherRegistry()
    tables = {"right": {"rev-low": "fmt-answer", "rev-high": "fmt-scratchpad"},
              "swapped": {"rev-low": "fmt-scratchpad", "rev-high": "fmt-answer"}}
    results, names = {}, []
    try:
        for label, table in tables.items():
            registered = []
            for route, source in table.items():
                name = f"{label}-{route}"
                registry.register_checkpoint(name, route, uris[source], result["base_uri"], replace=True)
                registered.append(name)
            names += registered
            mcfg = cfg.merge(result["base_uri"], [*registered, "spec-sort-low"],
                             opd={"steps": WRONG_ROUTING_STEPS, "eval_every": WRONG_ROUTING_STEPS},
                             label=f"routing-{label}").model_copy(update={"experiment": "opd-wrong-routing"})
            results[label] = merge(mcfg)
    finally:
        for name in names:
            registry.remove(name)
    right = routes_not_following(results["right"]["student_uri"], intended, teachers, prompt_set)
    swapped = routes_not_following(results["swapped"]["student_uri"], intended, teachers, prompt_set)
    print(f"\nright table: mean retention {results['right']['mean_retention']:.3f}, problems {right}"
          f"\nswapped table: mean retention {results['swapped']['mean_retention']:.3f}, problems {swapped}")
    assert right == {}
    assert sorted(swapped) == ["rev-high", "rev-low"], swapped
    assert "fmt-scratchpad" in swapped["rev-low"] and "fmt-answer" in swapped["rev-high"]


WRONG_ROUTING_STEPS = 200
