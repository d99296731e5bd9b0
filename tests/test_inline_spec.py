"""A route spec given inline (the Prefect UI form's JSON object, ``--spec '{...}'``) instead of as a file: validated
by the same model with the same errors (named ``inline spec``), local data paths required to be absolute, written
once to ``<state>/specs/inline-<sha12>/routes.yaml`` and from then on read like a user's file (prompt set, MLflow
param). No training here: prompt sets, configs and schemas only."""

import copy
import json

import pytest
import yaml
from pydantic import ValidationError

from tasks.config import MergeConfig, pipeline_config
from tasks.common.paths import PROJECT_ROOT, models_dir, specs_dir
from tasks.preflight import InputError, spec_problems
from teachers.preflight import preflight_pipeline
from tasks.training.pretrain import spec_path
from tasks.common.problems import validation_problems
from tasks.specs.prompt_set import build_prompt_set, load_prompt_set, spec_digest
from tasks.specs.spec import INLINE, inline_name, load_spec

USER_SPEC = PROJECT_ROOT / "tests" / "data" / "user_spec"


def inline_user_spec() -> dict:
    """tests/data/user_spec/routes.yaml as a mapping, its data paths made absolute."""
    doc = yaml.safe_load((USER_SPEC / "routes.yaml").read_text())
    for route in doc["routes"]:
        route["data"]["source"] = str(USER_SPEC / route["data"]["source"])
    return doc


@pytest.fixture
def checks_importable(monkeypatch):
    """An inline spec has no folder: its ``module:function`` verifier (checks.py) is imported from the Python path."""
    monkeypatch.syspath_prepend(str(USER_SPEC))
    monkeypatch.delitem(__import__("sys").modules, "checks", raising=False)


def models_before() -> list:
    return sorted(models_dir().glob("*")) if models_dir().exists() else []


def test_an_inline_spec_builds_the_same_prompt_set_as_its_file(checks_importable):
    inline = inline_user_spec()
    cfg = pipeline_config("quick", spec=inline)
    assert cfg.spec == inline and cfg.merge("", []).spec == inline  # kept as given, through every sub-config
    # Written once, content-addressed, in the state folder; the same spec gives the same file.
    path = spec_path(cfg.spec, cfg.world)
    assert path == specs_dir() / inline_name(inline) / "routes.yaml" and path.is_file()
    assert yaml.safe_load(path.read_text()) == inline
    stat = path.stat()
    assert spec_path(copy.deepcopy(inline), cfg.world) == path and path.stat().st_mtime_ns == stat.st_mtime_ns
    # The preflight builds its prompt set from that file: the same routes and rows as the user's own file.
    ps, problems = spec_problems(cfg)
    assert problems == []
    file_ps = load_prompt_set(build_prompt_set(USER_SPEC / "routes.yaml"))
    assert ps.path != file_ps.path and ps.routes == file_ps.routes == ["reverse", "reverse-think", "letters"]
    for split in ("train", "eval"):
        assert ps.splits[split].to_dict() == file_ps.splits[split].to_dict(), split
    assert ps.caps() == file_ps.caps() and ps.labels("reverse-think") == file_ps.labels("reverse-think")
    assert ps.verifier("letters")("it has 5 letters", "5", {}) == 1.0
    # MLflow: the spec artifact and its hash are the written file's; the config param is its path, not the mapping.
    assert (ps.path / "spec.yaml").read_text() == path.read_text()
    assert ps.spec_sha256 == spec_digest(path.read_text())
    from tasks.tracking.runs import config_params

    assert config_params(cfg.merge("", []))["spec"] == str(path)
    from flows.names import pipeline_name

    assert pipeline_name(cfg).startswith(f"pipeline-quick-{inline_name(inline)}-")


def test_inline_json_text_on_the_command_line_is_the_same_inline_spec():
    from tasks.cli import parse_config

    inline = inline_user_spec()
    cfg = parse_config(["--profile", "quick", "--spec", json.dumps(inline)], pipeline_config, "", with_profile=True)
    assert cfg.spec == inline
    path = parse_config(["--spec", "tests/data/user_spec/routes.yaml"], pipeline_config, "", with_profile=True).spec
    assert path == "tests/data/user_spec/routes.yaml"  # a path stays a path


def test_relative_data_paths_in_an_inline_spec_are_refused_naming_route_and_field():
    inline = yaml.safe_load((USER_SPEC / "routes.yaml").read_text())  # words.jsonl, letters.jsonl: relative
    inline["tokenizer"] = "./my-tokenizer"
    with pytest.raises(ValidationError) as info:
        pipeline_config("quick", spec=inline)
    problems = [str(p) for p in validation_problems(info.value)]
    assert problems == [
        f"{INLINE}: routes[{r}].data.source: {f}: a relative path; an inline spec has no folder to resolve a relative "
        "path against: expected an absolute path (or a hub dataset id, with format: hub)"
        for r, f in (("reverse", "words.jsonl"), ("reverse-think", "words.jsonl"), ("letters", "letters.jsonl"))
    ] + [f"{INLINE}: tokenizer: ./my-tokenizer: a relative path; an inline spec has no folder to resolve a relative "
         "path against: expected an absolute path (or a hub id)"]
    # Hub ids are not paths: accepted as they are (read only when the prompt set is built).
    hub = inline_user_spec()
    hub["routes"][0]["data"]["source"] = "openai/gsm8k"
    hub["routes"][1]["data"].update(source="words", format="hub")
    assert pipeline_config("quick", spec=hub).spec == hub


def file_problems(tmp_path, doc) -> list[str]:
    """The problems of the same spec written as a file, as ``field: message`` (the file case to match)."""
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(InputError) as info:
        load_spec(path)
    assert all(p.file == str(path) for p in info.value.problems)
    return [f"{p.field}: {p.message}" for p in info.value.problems]


def test_a_bad_inline_spec_is_refused_like_the_file_before_any_training(tmp_path, capsys):
    from flows.pipeline import main
    from tasks.cli import run_main

    bad = inline_user_spec()
    del bad["routes"][2]["data"]["source"]  # a missing field
    bad["routes"][1]["verify"]["kind"] = "fuzzy"  # an unknown verifier kind
    expected = ["routes[letters].data.source: Field required",
                "routes[reverse-think].verify.kind: Input should be 'exact', 'numeric', 'regex', 'math', 'last_number', 'contains' "
                    "or 'function' "
                "(got 'fuzzy')"]
    assert sorted(file_problems(tmp_path, bad)) == expected
    # At construction (the Prefect form's parameters, the command line): the same problems, named "inline spec".
    with pytest.raises(ValidationError) as info:
        MergeConfig(spec=bad)
    assert sorted(str(p) for p in validation_problems(info.value)) == [f"{INLINE}: {e}" for e in expected]
    # The command line: one error line per problem, exit 2, no traceback, nothing trained.
    before = models_before()
    assert run_main(main, ["--profile", "quick", "--spec", json.dumps(bad)]) == 2
    err = capsys.readouterr().err
    assert sorted(line for line in err.splitlines() if line.startswith("error:")) == [
        f"error: {INLINE}: {e}" for e in expected], err
    assert "Traceback" not in err and models_before() == before


def test_an_inline_spec_whose_verifier_is_unknown_is_refused_by_the_preflight(checks_importable):
    bad = inline_user_spec()
    bad["routes"][2]["verify"]["function"] = "checks:no_such_check"
    cfg = pipeline_config("quick", spec=bad)  # a well-formed spec: only building it finds the function missing
    before = models_before()
    with pytest.raises(InputError) as info:
        preflight_pipeline(cfg, say_warnings=False)
    [problem] = info.value.problems
    assert (problem.file, problem.field) == (INLINE, "routes[letters].verify")
    assert "function 'checks:no_such_check': checks has no callable 'no_such_check'" in problem.message
    assert models_before() == before


def test_register_teacher_checks_the_route_against_an_inline_spec():
    from flows.register import RegisterConfig

    inline = inline_user_spec()
    assert RegisterConfig(name="t", route="letters", model_uri="m", spec=inline).spec == inline
    with pytest.raises(ValidationError, match=r"route 'nope' is not a route of inline spec [0-9a-f]{12}"):
        RegisterConfig(name="t", route="nope", model_uri="m", spec=inline)


def test_the_deployment_form_takes_spec_as_a_path_or_an_object():
    """What `prefect deploy` records as each flow's parameter schema (the UI form, and what the server checks a run's
    parameters against) offers `spec` as a string or an object; the flow validates either into its config."""
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools import validate

    inline = inline_user_spec()
    flows = {name: load_flow_from_entrypoint(str(PROJECT_ROOT / "flows" / f"{name}.py") + f":{fn}")
             for name, fn in (("merge", "merge"), ("pipeline", "pipeline"), ("specialists", "train_specialists"),
                              ("base", "prepare_base"), ("evaluate", "evaluate"), ("register", "register_teacher"))}
    for name, flow in flows.items():
        schema = parameter_schema(flow).model_dump(exclude_unset=True)  # as the runner deploys it
        config = schema["properties"]["cfg"]["$ref"].rsplit("/", 1)[-1]
        spec = schema["definitions"][config]["properties"]["spec"]
        assert {s["type"]: s.get("title") for s in spec["anyOf"]} == {"string": "path", "object": "inline spec"}, name
        assert spec["description"], name
        for value in ("routes.yaml", inline):
            assert validate({"cfg": {"spec": value}}, schema, ignore_required=True) == [], (name, value)
    merge = flows["merge"]
    params = {"cfg": {**pipeline_config("quick").merge("", []).model_dump(mode="json"), "spec": inline}}
    assert merge.validate_parameters(params)["cfg"].spec == inline
    bad = copy.deepcopy(inline)
    bad["routes"][0]["verify"]["kind"] = "fuzzy"
    with pytest.raises(Exception, match=r"inline spec: routes\[reverse\]\.verify\.kind"):
        merge.validate_parameters({"cfg": {**params["cfg"], "spec": bad}})
