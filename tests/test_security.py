"""Security promises, checked: loopback-only servers, no pickle loading, remote code only by a registry grant, names
that cannot become paths outside the state directories, and no credentials in MLflow or Prefect.

    OMP_NUM_THREADS=1 python -m pytest tests/test_security.py -q
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.config import MergeConfig, SpecialistsConfig
from tasks.common.log import redact, say
from tasks.modeling.models import load_model
from tasks.common.paths import PROJECT_ROOT
from tasks.world.tokenizer import build_char_tokenizer
from tasks.tracking.runs import config_params, end_run, register_version, start_run, tracking_uri
from tasks.world.domains import Route
from teachers.cli import main as teachers_cli
from teachers.registry import (
    IncompatibleTeacher,
    RegistryError,
    TeacherRecord,
    TeacherRegistry,
    check_endpoint,
    check_name,
)
from tests.test_bad_input import _remote_code_config
from tests.test_registry import make_checkpoint, make_record

SECRET = "hunter2"
SOURCE_DIRS = ("tasks", "flows", "teachers", "infra", "tests")


def project_files(*suffixes: str) -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in (PROJECT_ROOT / d).rglob("*") if p.suffix in suffixes and p.is_file()]
    return sorted(files + [p for p in PROJECT_ROOT.glob("*") if p.suffix in suffixes and p.is_file()])


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            yield node


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "opd"))
    monkeypatch.delenv("OPD_REGISTRY", raising=False)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tok) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("sec") / "ckpt", tok)


# ------------------------------------------------------------------------------------------------ servers


def test_stack_and_ui_servers_bind_loopback_unless_a_host_is_given():
    stack = (PROJECT_ROOT / "infra" / "stack.sh").read_text()
    assert 'HOST="${OPD_HOST:-127.0.0.1}"' in stack
    host_args = re.findall(r"--host\s+(\S+)", stack)
    assert host_args and set(host_args) == {'"$HOST"'}, host_args
    ui = (PROJECT_ROOT / "infra" / "ui.sh").read_text()
    assert re.findall(r"--host\s+(\S+)", ui) == ["127.0.0.1", "127.0.0.1"]

    # What the stack actually points at, by default and with an explicit host.
    env = {k: v for k, v in os.environ.items() if k != "OPD_HOST"}
    default = subprocess.run(["bash", "infra/stack.sh", "env"], cwd=PROJECT_ROOT, env=env, capture_output=True,
                             text=True, check=True).stdout
    assert 'PREFECT_API_URL="http://127.0.0.1:4200/api"' in default
    assert 'MLFLOW_TRACKING_URI="http://127.0.0.1:5000"' in default
    given = subprocess.run(["bash", "infra/stack.sh", "env"], cwd=PROJECT_ROOT, env={**env, "OPD_HOST": "10.1.2.3"},
                           capture_output=True, text=True, check=True).stdout
    assert 'PREFECT_API_URL="http://10.1.2.3:4200/api"' in given


def test_no_project_code_binds_all_interfaces():
    # 0.0.0.0 appears only inside containers whose ports are published on 127.0.0.1 (tests/test_infra_scale.py).
    offenders = [str(p.relative_to(PROJECT_ROOT)) for p in project_files(".py", ".sh", ".yaml", ".yml", ".toml")
                 if "0.0.0.0" in p.read_text() and p.name not in {"docker-compose.yaml", "test_security.py"}]
    assert offenders == []
    servers = []  # every Python call that could start a server: none in the project, or on 127.0.0.1
    for path in project_files(".py"):
        for call in calls(path):
            name = dotted(call.func)
            if name.split(".")[-1] in {"serve", "HTTPServer", "ThreadingHTTPServer", "TCPServer"} or \
                    name.startswith("uvicorn."):
                host = keyword(call, "host")
                servers.append((str(path.relative_to(PROJECT_ROOT)), name,
                                host.value if isinstance(host, ast.Constant) else None))
    assert all(host == "127.0.0.1" for *_, host in servers), servers


# ------------------------------------------------------------------------------------------------ weights and code


# The one pickle load allowed: the sharded job's own files, unpickled only after their HMAC verifies against the
# job's owner-only key (tasks/training/launch.py; test_a_job_file_not_signed_with_the_jobs_key_is_refused_unread).
SIGNED_PICKLE = ("tasks/training/launch.py", "unseal")


def test_every_torch_load_is_weights_only():
    unsafe = []
    for path in project_files(".py"):
        signed = set()
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(fn, ast.FunctionDef)
                    and (str(path.relative_to(PROJECT_ROOT)), fn.name) == SIGNED_PICKLE):
                signed |= set(range(fn.lineno, fn.end_lineno + 1))
        for call in calls(path):
            name = dotted(call.func)
            if name == "pickle.loads" and call.lineno in signed:
                continue
            if name in {"torch.load", "pickle.load", "pickle.loads", "dill.load", "joblib.load"}:
                flag = keyword(call, "weights_only")
                if not (name == "torch.load" and isinstance(flag, ast.Constant) and flag.value is True):
                    unsafe.append(f"{path.relative_to(PROJECT_ROOT)}:{call.lineno} {name}")
    assert unsafe == []


def test_models_load_safetensors_only_and_remote_code_is_never_hard_coded():
    loads, hard_coded = [], []
    for path in project_files(".py"):
        for call in calls(path):
            name = dotted(call.func)
            owner = name.rsplit(".", 1)[0]
            if name.endswith(".from_pretrained") and ("AutoModel" in owner or owner.endswith(("ForCausalLM", "LM"))):
                flag = keyword(call, "use_safetensors")
                # A GGUF file (tasks/modeling/convert.py: the real profile's base, from a wheel) is a data format the
                # gguf reader parses, never pickle: the one other load allowed.
                gguf = keyword(call, "gguf_file") is not None
                loads.append((str(path.relative_to(PROJECT_ROOT)),
                              gguf or (isinstance(flag, ast.Constant) and flag.value)))
            trust = keyword(call, "trust_remote_code")
            if isinstance(trust, ast.Constant) and trust.value:
                hard_coded.append(f"{path.relative_to(PROJECT_ROOT)}:{call.lineno}")
    assert loads and all(ok for _, ok in loads), loads
    assert hard_coded == []


def test_pickle_weights_are_not_loaded(ckpt, tmp_path):
    pickled = shutil.copytree(ckpt, tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        load_model(pickled)


def test_remote_code_runs_only_with_a_registry_grant(ckpt, tmp_path, tok):
    from tasks.merging.merge import load_teacher

    remote = shutil.copytree(ckpt, tmp_path / "remote")
    marker = _remote_code_config(remote)
    rec = make_record("remote-teacher", model_uri=str(remote))  # an entry without trust_remote_code
    assert rec.trust_remote_code is False
    for load in (lambda: load_model(remote), lambda: load_teacher(rec, tok)):
        with pytest.raises(Exception, match="trust_remote_code|opd-evil|model type"):
            load()
    with pytest.raises(IncompatibleTeacher):
        TeacherRegistry(tmp_path / "r.json").register_checkpoint("remote-teacher", "rev-low", remote, tok)
    assert not marker.exists()  # the checkpoint's own code never ran


# ------------------------------------------------------------------------------------------------ names and paths

CRAFTED_NAMES = ["../../x", "/etc/passwd", "a/b", "..", ".hidden", "x" * 65, "Evil", "a\\b", "a\x00b", "~root", ""]


@pytest.mark.parametrize("name", CRAFTED_NAMES)
def test_crafted_teacher_names_write_nothing(name, tmp_path, ckpt, tok):
    with pytest.raises(ValueError, match="not a slug"):
        check_name(name)
    with pytest.raises(ValueError):
        make_record(name)
    reg_dir = tmp_path / "state"
    reg_dir.mkdir()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(IncompatibleTeacher, match="not a slug"):
        TeacherRegistry(reg_dir / "registry.json").register_checkpoint(name, "rev-low", ckpt, tok)
    assert sorted(tmp_path.rglob("*")) == before  # not even the registry file or its lock


def test_crafted_names_in_the_file_are_refused_on_read(tmp_path):
    path = tmp_path / "registry.json"
    good = make_record("ok").model_dump(mode="json")
    path.write_text(json.dumps({"version": 1, "teachers": [{**good, "name": "../../x"}]}))
    with pytest.raises(RegistryError) as info:
        TeacherRegistry(path).list()
    assert (info.value.path, info.value.field) == (path, "teachers[0].name")
    assert "not a slug" in str(info.value)


def test_registry_path_must_be_a_json_file(tmp_path, capsys):
    for bad in (tmp_path / "evil.sh", tmp_path):
        with pytest.raises(RegistryError, match="expected a .json file"):
            TeacherRegistry(bad)
    assert teachers_cli(["--registry", str(tmp_path / "x.py"), "list"]) == 2
    assert "expected a .json file" in capsys.readouterr().err
    reg = TeacherRegistry(tmp_path / "sub" / ".." / "registry.json")  # resolved: writes land where it says
    assert reg.path == tmp_path / "registry.json" and reg.lock_path.parent == tmp_path


@pytest.mark.parametrize("route", ["../../x-low", "/abs-low", "rev/../x-low", "rev-low/..", "..", ".hidden"])
def test_crafted_routes_never_become_paths(route):
    # Routes name specialist folders (tasks/training/specialist.py specialist_dir) and are checked before any use: by the
    # world's parser, the spec's route-name rule and the registry record.
    from tasks.specs.spec import check_route_name

    with pytest.raises(ValueError, match="<domain>-<budget>"):
        Route.parse(route)
    with pytest.raises(ValueError, match="not a route name"):
        check_route_name(route)
    with pytest.raises(ValueError):
        make_record("ok", route=route)


def test_other_names_that_reach_paths_are_patterns():
    with pytest.raises(ValueError, match="pattern"):
        SpecialistsConfig(name_prefix="../x")
    with pytest.raises(ValueError, match="pattern"):
        MergeConfig(label="../../x")


def test_provenance_data_is_only_opened_as_a_prompt_set_folder_name(tmp_path, monkeypatch):
    from tasks.common.paths import prompt_sets_dir
    from tasks.preflight import leakage_problems

    # A finished-looking prompt set at the end of every crafted value, so that each one would reach it if it were
    # joined to the prompt sets folder: "../outside" from prompt_sets_dir(), the absolute path itself,
    # "x-000000000000/../../y" through a folder literally named "x-000000000000".
    sets = prompt_sets_dir()
    targets = {"../outside": sets.parent / "outside", str(tmp_path / "abs"): tmp_path / "abs",
               "x-000000000000/../../y": sets.parent / "y"}
    (sets / "x-000000000000").mkdir(parents=True)
    for data, folder in targets.items():
        (folder / "prompts").mkdir(parents=True)
        (folder / "DONE").write_text("ok\n")
        assert (sets / data / "DONE").exists(), data  # reachable: only the name check stands in the way
    opened = []
    monkeypatch.setattr("tasks.specs.prompt_set.load_prompt_set", lambda *a: opened.append(a) or pytest.fail(
        f"a crafted provenance.data was opened: {a}"))
    for data in targets:
        rec = make_record("t", provenance=make_record("t").provenance.model_copy(update={"data": data}))
        assert leakage_problems(rec, ["abc"], "routes-000000000000", "teacher 't'") == []
    assert opened == []


# ------------------------------------------------------------------------------------------------ secrets


def test_redact_hides_credentials_and_tokens_but_keeps_the_rest():
    assert redact(f"http://user:{SECRET}@mlflow:5000/x") == "http://***@mlflow:5000/x"
    assert redact(f"https://{SECRET}@hub.example/org/m?revision=main") == "https://***@hub.example/org/m?revision=main"
    assert redact(f"s3://b/x?token={SECRET}&a=1 and http://h/?api_key={SECRET}") == \
        "s3://b/x?token=***&a=1 and http://h/?api_key=***"
    for plain in ("sqlite:////tmp/mlflow.db", "/data/opd/models/base", "org/model", "me@example.com"):
        assert redact(plain) == plain


def test_credentials_never_reach_mlflow_params_or_tags(tmp_path):
    cfg = MergeConfig(student_uri=f"https://user:{SECRET}@hub.example/student")
    params = config_params(cfg)
    assert params["student_uri"] == "https://***@hub.example/student"
    run_id = start_run("security-test", "creds", {**params, "base_uri": f"http://u:{SECRET}@h/base"},
                       {"student_uri": cfg.student_uri, "note": f"see https://x/?token={SECRET}"})
    end_run(run_id, {"endpoint": f"http://u:{SECRET}@127.0.0.1:8000"})
    version = register_version("security-test-model", run_id, "checkpoint",
                               {"model_uri": f"https://u:{SECRET}@hub.example/m"})
    client = MlflowClient(tracking_uri())
    run = client.get_run(run_id)
    stored = json.dumps([run.data.params, run.data.tags,
                         client.get_model_version("security-test-model", version).tags])
    assert SECRET not in stored
    assert run.data.params["base_uri"] == "http://***@h/base" and run.data.tags["endpoint"].startswith("http://***@")


def test_credentials_never_reach_prefect_logs_or_refusals(capsys, monkeypatch, tmp_path):
    say(f"MLflow run abc at http://user:{SECRET}@mlflow:5000")
    assert capsys.readouterr().out.strip() == "MLflow run abc at http://***@mlflow:5000"
    # A refused config is shown (and stored by Prefect as the failure message) without the secret.
    from tasks.preflight import InputError, credential_problems

    err = InputError(credential_problems({"student_uri": f"https://u:{SECRET}@hub.example/m"}))
    assert "student_uri" in str(err) and SECRET not in str(err)
    # The registry is no secret store: an endpoint with credentials is refused outright.
    with pytest.raises(ValueError, match="must not carry credentials"):
        check_endpoint(f"http://u:{SECRET}@127.0.0.1:8000")
    with pytest.raises(ValueError, match="credentials"):
        TeacherRecord.model_validate({**make_record("t").model_dump(), "endpoint": f"http://u:{SECRET}@h:1"})


def test_a_job_file_not_signed_with_the_jobs_key_is_refused_unread(tmp_path):
    """A sharded merge's job folder (possibly on a filesystem several machines share) holds pickles: each is signed
    with the job's owner-only key, and one that is not, or was changed, is refused before anything is unpickled."""
    import pickle

    from tasks.training.launch import UnsignedJobFile, job_key, seal, unseal

    key = job_key(tmp_path)
    assert (tmp_path / ".key").stat().st_mode & 0o777 == 0o600 and job_key(tmp_path) == key and len(key) == 32
    assert unseal(key, seal(key, {"fn": len, "args": ([1, 2],)}), "job") == {"fn": len, "args": ([1, 2],)}
    ran = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (ran.touch, ())

    forged = [b"\0" * 32 + pickle.dumps(Evil()), seal(b"another key" * 3, Evil()), seal(key, 1)[:-1] + b"\x02"]
    for blob in forged:
        with pytest.raises(UnsignedJobFile, match="refused without unpickling it"):
            unseal(key, blob, "job.pkl")
    assert not ran.exists()
