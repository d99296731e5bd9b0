"""Validation tier for the deployments: infra/prefect.yaml is current, every entrypoint loads, every deployment's
parameters validate against its flow, the UI form schema carries descriptions and dropdowns, and the stack script
binds to loopback by default."""

import importlib.util
import os
import subprocess
import sys

import pytest
import yaml
from prefect.flows import load_flow_from_entrypoint
from prefect.utilities.callables import parameter_schema

from tasks.common.paths import PROJECT_ROOT

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


# One fresh interpreter that imports the heavy third-party packages once, then loads each entrypoint in a forked child
# (none of the project's modules imported yet, one child per entrypoint as one flow-run process per run): seconds, not
# the ~100 s of a new interpreter per entrypoint. A failure prints "FAILED <entrypoint>: <error>"; exit 1.
LOAD_FOR_REAL = """
import os, sys
import datasets, mlflow.tracking, torch, transformers.modeling_utils
from prefect.flows import load_flow_from_entrypoint

failed = 0
for entrypoint in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
        except BaseException as exc:
            print(f"FAILED {entrypoint}: {exc!r}", file=sys.stderr, flush=True)
            os._exit(1)
        os._exit(0)
    failed += os.waitpid(pid, 0)[1] != 0
sys.exit(1 if failed else 0)
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="loads each entrypoint in a forked child")
def test_every_entrypoint_imports_in_a_fresh_process_as_the_worker_loads_it(doc):
    """The worker's flow-run process imports the entrypoint for real (no placeholder) from the project root. The
    fixture above cannot show that: `prefect deploy` and `load_flow_from_entrypoint` fall back to an AST placeholder
    when the import fails, and this process has `teachers` imported already, which hides a module shadowing it (a
    file entrypoint's folder goes first on sys.path: flows/bench/teachers.py would be `teachers` there)."""
    entrypoints = sorted({d["entrypoint"] for d in doc["deployments"]})
    proc = subprocess.run([sys.executable, "-c", LOAD_FOR_REAL, *entrypoints], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    failed = [line for line in proc.stderr.splitlines() if line.startswith("FAILED ")]
    assert proc.returncode == 0 and not failed, "\n".join(failed) or proc.stderr[-3000:]


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
    form = parameter_schema(reg).model_dump()["definitions"]["RegisterConfig"]
    assert set(form["required"]) == {"name", "route", "model_uri"}
    # The teacher kinds a user registers from the UI: a dropdown, and the context teacher's template with its help.
    assert form["properties"]["wrapper"]["enum"] == ["plain", "aligned", "context", "guided"]
    assert "withdrawn" in form["properties"]["guide_steps"]["description"]
    assert form["properties"]["guide_fraction"]["maximum"] == 1
    assert "{context}" in form["properties"]["context_template"]["description"]


def test_nightly_comparison_has_a_paused_cron_schedule(doc):
    (nightly,) = [d for d in doc["deployments"] if d["entrypoint"].endswith(":compare_merges")]
    assert nightly["schedules"] == [{"cron": "0 6 * * *", "timezone": "UTC", "active": False}]


def test_shared_defaults_are_anchors_and_expand_to_every_full_deployment(doc):
    """infra/prefect.yaml states each shared default once (`definitions`, YAML anchors) and in each deployment only
    what differs (`<<: *name`); read back, that is every deployment in full as the generator builds it."""
    text = YAML.read_text()
    assert doc["deployments"] == _generator().deployments()
    assert {"work_pools", "schedules", "parameters"} <= set(doc["definitions"])
    assert "cfg: *pipeline" in text and "<<: *pipeline" in text and "<<: *deployment" in text
    written_out = yaml.safe_dump({k: v for k, v in doc.items() if k != "definitions"}, sort_keys=False, width=120)
    assert len(text.splitlines()) < len(written_out.splitlines()) / 2, "the defaults are repeated, not shared"


def test_prefect_deploy_reads_each_deployment_with_the_parameters_of_its_validated_config(loaded):
    """What `prefect --no-prompt deploy --all` reads from the file before it contacts the server (Prefect's own
    loader and picker): every deployment, no warnings, and as parameters exactly the configs the generator starts
    from, which its flow validates back to the same values."""
    from io import StringIO

    from prefect.cli.deploy._config import _load_deploy_configs_and_actions, _pick_deploy_configs
    from rich.console import Console

    out = StringIO()
    console = Console(file=out, width=200)
    configs, actions = _load_deploy_configs_and_actions(YAML, console=console)
    picked = _pick_deploy_configs(configs, [], True, console=console, is_interactive=lambda: False)
    assert not out.getvalue().strip(), out.getvalue()  # Prefect prints a validation problem and skips the file
    assert actions["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $OPD_REPO_ROOT }}"}}]
    entries = _generator().entries()
    assert [(d["name"], d["entrypoint"]) for d in picked] == [(e[1], e[2]) for e in entries]
    for d, (flow_name, name, entrypoint, params, _) in zip(picked, entries):
        assert d["parameters"] == {k: cfg.model_dump(mode="json") for k, cfg in params.items()}, entrypoint
        assert d["work_pool"] == {"name": "{{ $OPD_WORK_POOL }}", "work_queue_name": None, "job_variables": {}}
        assert d["tags"] == ["opd", flow_name] and "schedules" in d
        validated = loaded[(entrypoint, name)].validate_parameters(d["parameters"]) if params else {}
        assert {k: (type(v).__name__, v.model_dump(mode="json")) for k, v in validated.items()} == {
            k: (type(cfg).__name__, cfg.model_dump(mode="json")) for k, cfg in params.items()}, entrypoint


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
