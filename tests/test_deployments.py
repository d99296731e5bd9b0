"""Validation tier for the deployments: infra/prefect.yaml is current, every entrypoint loads, every deployment's
parameters validate against its flow, the UI form schema carries descriptions and dropdowns, and the stack script
binds to loopback by default."""

import importlib.util
import os
import subprocess

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema

from tasks.paths import PROJECT_ROOT

YAML = PROJECT_ROOT / "infra" / "prefect.yaml"


def _generator():
    spec = importlib.util.spec_from_file_location("deployments", PROJECT_ROOT / "infra" / "deployments.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def doc():
    return yaml.safe_load(YAML.read_text())


def test_prefect_yaml_is_generated_from_the_current_configs():
    assert _generator().main(["--check"]) == 0, "run: python infra/deployments.py"


def test_the_deployments_the_users_asked_for_exist(doc):
    flows = {(d["entrypoint"].split(":")[1], d["name"]) for d in doc["deployments"]}
    for flow in ("train_specialists", "register_teacher", "merge", "evaluate", "pipeline", "compare_merges"):
        assert any(f == flow for f, _ in flows), flow
    assert ("pipeline", "quick") in flows


@pytest.fixture(scope="module")
def loaded(doc):
    cwd = os.getcwd()
    os.chdir(PROJECT_ROOT)  # entrypoints are relative to the project root, as the worker's pull step sets it
    try:
        return {(d["entrypoint"], d["name"]): load_flow_from_entrypoint(d["entrypoint"]) for d in doc["deployments"]}
    finally:
        os.chdir(cwd)


def test_every_deployment_parameter_set_validates_against_its_flow(doc, loaded):
    validated_sets = 0
    for d in doc["deployments"]:
        flow = loaded[(d["entrypoint"], d["name"])]
        if d["parameters"]:  # a deployment without parameters runs its flow's defaults
            validated = flow.validate_parameters(d["parameters"])
            assert type(validated["cfg"]).__name__.endswith("Config")
            validated_sets += 1
        assert d["work_pool"]["name"] == "{{ $OPD_WORK_POOL }}"
        assert d["description"]
    assert validated_sets > 0, "no deployment has parameters: nothing was validated"


def test_run_form_schema_has_descriptions_defaults_and_dropdowns(loaded):
    merge = next(f for (e, _), f in loaded.items() if e.endswith(":merge"))
    schema = parameter_schema(merge).model_dump()
    opd = schema["definitions"]["OPDConfig"]["properties"]
    assert opd["loss"]["enum"] == ["reverse_kl", "forward_kl", "jsd", "skew_kl", "skew_reverse_kl", "sampled_token", "sft"]
    assert opd["steps"]["default"] == 800 and opd["steps"]["minimum"] == 1 and opd["steps"]["description"]
    assert all(p.get("description") for p in opd.values()), [k for k, p in opd.items() if not p.get("description")]
    reg = next(f for (e, _), f in loaded.items() if e.endswith(":register_teacher"))
    assert set(parameter_schema(reg).model_dump()["definitions"]["RegisterConfig"]["required"]) == {
        "name", "route", "model_uri"}


def test_nightly_comparison_has_a_paused_cron_schedule(doc):
    (nightly,) = [d for d in doc["deployments"] if d["entrypoint"].endswith(":compare_merges")]
    assert nightly["schedules"] == [{"cron": "0 6 * * *", "timezone": "UTC", "active": False}]


def test_stack_script_binds_to_loopback_unless_told_otherwise(tmp_path):
    env = {**os.environ, "OPD_HOME": str(tmp_path)}
    env.pop("OPD_HOST", None)
    out = subprocess.run(["bash", "infra/stack.sh", "env"], cwd=PROJECT_ROOT, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert 'PREFECT_API_URL="http://127.0.0.1:4200/api"' in out
    assert 'MLFLOW_TRACKING_URI="http://127.0.0.1:5000"' in out
    assert f'OPD_HOME="{tmp_path}"' in out and f'PREFECT_HOME="{tmp_path}/prefect"' in out
    bad = subprocess.run(["bash", "infra/stack.sh", "nonsense"], cwd=PROJECT_ROOT, env=env, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
