"""``python -m teachers``: register, list, show, remove. ``python -m pytest tests/test_teachers_cli.py -q``"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.common.paths import PROJECT_ROOT
from tasks.specs.tokenizer import save_tokenizer, tokenizer_fingerprint
from tasks.world.tokenizer import build_char_tokenizer
from tasks.tracking.runs import tracking_uri
from teachers.cli import main
from teachers.registry import TeacherRegistry
from tests.test_registry import make_checkpoint
from tests.test_router import rec


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "opd"))
    monkeypatch.delenv("OPD_REGISTRY", raising=False)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("cli") / "teacher", build_char_tokenizer())


def test_cli_round_trip(tmp_path, ckpt, capsys):
    reg = str(tmp_path / "registry.json")
    student = str(save_tokenizer(build_char_tokenizer(), tmp_path / "student-tok"))
    register = ["--registry", reg, "register", "--name", "add-high-v1", "--route", "add-high",
                "--model_uri", str(ckpt), "--student_tokenizer", student]

    assert main([*register, "--eval_score", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "registered add-high-v1 (route add-high" in out
    # Also a version of the route's model in the MLflow model registry, with @active on it.
    version = re.search(r"MLflow model teacher-add-high version (\d+) \(@active\)", out).group(1)
    mv = MlflowClient(tracking_uri()).get_model_version_by_alias("teacher-add-high", "active")
    assert str(mv.version) == version and mv.tags["teacher"] == "add-high-v1" and mv.tags["source"] == "cli"
    assert sorted(a.path for a in MlflowClient(tracking_uri()).list_artifacts(mv.run_id, "checkpoint"))

    assert main(["--registry", reg, "list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"name         route     eval_score  model_uri{' ' * (len(str(ckpt)) - len('model_uri'))}".rstrip(),
        f"-----------  --------  ----------  {'-' * len(str(ckpt))}",
        f"add-high-v1  add-high       0.500  {ckpt}",
    ]

    assert main(["--registry", reg, "show", "add-high-v1"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == TeacherRegistry(reg).get("add-high-v1").model_dump(mode="json")
    assert (shown["tokenizer_fingerprint"], shown["provenance"]["source"]) == (
        tokenizer_fingerprint(build_char_tokenizer()), "cli")

    assert main(register) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: teacher 'add-high-v1' is already in") and err.count("\n") == 1
    assert main([*register, "--replace", "--eval_score", "0.75", "--no_mlflow"]) == 0
    assert "MLflow" not in capsys.readouterr().out
    assert TeacherRegistry(reg).get("add-high-v1").eval_score == 0.75

    assert main(["--registry", reg, "remove", "add-high-v1"]) == 0
    assert TeacherRegistry(reg).list() == []
    capsys.readouterr()
    assert main(["--registry", reg, "show", "add-high-v1"]) == 2
    assert capsys.readouterr().err == f"error: no teacher 'add-high-v1' in {Path(reg).resolve()}; available: []\n"


def test_cli_register_errors_are_one_line(tmp_path, ckpt, capsys):
    reg = str(tmp_path / "registry.json")
    base = ["--registry", reg, "register", "--name", "t", "--model_uri", str(ckpt)]

    # No --student_tokenizer and no pipeline state yet.
    assert main([*base, "--route", "add-high"]) == 2
    err = capsys.readouterr().err
    assert "--student_tokenizer PATH_OR_ID" in err and "run the pipeline first" in err and err.count("\n") == 1

    # The pipeline's tokenizer location is the default.
    save_tokenizer(build_char_tokenizer(), tmp_path / "opd" / "world" / "tokenizer")
    # Any route name of a spec is a route (tasks.specs.spec.check_route_name): refused only when it is not a route name.
    assert main([*base, "--route", "bad/route"]) == 2
    err = capsys.readouterr().err
    assert "'bad/route' is not a route name" in err and err.count("\n") == 1
    assert main([*base, "--route", "add-high", "--eval_score", "3"]) == 2
    assert "eval_score: Input should be less than or equal to 1" in capsys.readouterr().err
    assert not Path(reg).exists()
    assert main([*base, "--route", "add-high"]) == 0
    assert TeacherRegistry(reg).names() == ["t"]

    assert main(["--registry", reg, "frobnicate"]) == 2  # argparse usage error, returned not raised


def test_cli_as_subprocess(tmp_path):
    reg = TeacherRegistry(tmp_path / "registry.json")
    reg.add(rec("rev-low-a", "rev-low", eval_score=1.0))
    env = {**os.environ, "OPD_HOME": str(tmp_path / "opd"), "PYTHONPATH": str(PROJECT_ROOT)}
    run = lambda *args: subprocess.run([sys.executable, "-m", "teachers", "--registry", str(reg.path), *args],
                                       cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=60)
    out = run("list")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[2] == "rev-low-a  rev-low       1.000  /ckpt/rev-low-a"

    missing = run("show", "nope")
    assert missing.returncode == 2
    assert missing.stderr == f"error: no teacher 'nope' in {reg.path}; available: ['rev-low-a']\n"


def test_cli_flags_are_spelled_as_the_flows(capsys):
    # One spelling on every command line: the pydantic field names of the register-teacher flow (also MLflow params
    # and prefect.yaml keys), so `python -m teachers register` and `python -m flows.register` take the same flags.
    from flows.register import RegisterConfig
    from teachers.cli import build_parser

    register = build_parser()._subparsers._group_actions[0].choices["register"]
    flags = {o for a in register._actions for o in a.option_strings if o.startswith("--")}
    for field in ("name", "route", "model_uri", "student_tokenizer", "eval_score", "replace", "trust_remote_code",
                  "endpoint"):
        assert field in RegisterConfig.model_fields and f"--{field}" in flags, field
    assert {"--parity_tol", "--no_mlflow", "--debug"} <= flags and not any("-" in f[2:] for f in flags), flags
    assert main(["register", "--name", "t", "--route", "add-high", "--model-uri", "/x"]) == 2
    assert "--model_uri" in capsys.readouterr().err  # argparse: the required flag, in its one spelling
