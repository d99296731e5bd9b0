"""Nothing outside the state folder: a run from a fresh clone writes only under `$OPD_HOME` (or `.opd/`), never into
`$HOME` (Prefect results in ~/.prefect/storage, ~/.cache/matplotlib, ~/.config/mlflow/telemetry.json, Hugging Face
caches) nor the cwd, whatever order an entry point imports prefect in; and a cached task never hands one state folder
another's world, base or specialists, even when both share Prefect's records.

Run: python -m pytest tests/test_state_folder.py -q      (the flow run is marked e2e: about a minute)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.common.paths import PROJECT_ROOT, state_dir, state_env


def clean_env(home: Path, opd_home: Path, **extra: str) -> dict[str, str]:
    """A fresh user's environment: nothing from this pytest session (its OPD_HOME, PREFECT_*, MLFLOW_TRACKING_URI, nor
    PYTEST_CURRENT_TEST or CI, which turn MLflow's telemetry off by themselves), no XDG_* or MPLCONFIGDIR."""
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(PROJECT_ROOT), "OMP_NUM_THREADS": "1",
            "HOME": str(home), "OPD_HOME": str(opd_home), "LANG": "C.UTF-8",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **extra}


def written(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run_py(args: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fresh(tmp_path) -> tuple[Path, Path, Path]:
    home, opd, cwd = tmp_path / "home", tmp_path / "opd", tmp_path / "cwd"
    for d in (home, opd, cwd):
        d.mkdir()
    return home, opd, cwd


# What a process that has imported the package prints: Prefect's settings as Prefect itself read them, and where
# matplotlib, datasets and the hub keep their caches, after drawing a figure the way a merge logs one.
PROBE = """
import io, json, os, sys
import {package}
from prefect.settings import get_current_settings
from tasks.tracking.runs import retention_figure
import datasets.config, huggingface_hub.constants, matplotlib
from mlflow.telemetry.utils import is_telemetry_disabled
retention_figure([dict(route="r", base_accuracy=0.1, teacher_accuracy=0.9, student_accuracy=0.8, retention=0.89)],
                 "t").savefig(io.BytesIO(), format="png")
s = get_current_settings()
print(json.dumps(dict(home=str(s.home), results=str(s.results.local_storage_path), mpl=matplotlib.get_configdir(),
                      datasets=str(datasets.config.HF_DATASETS_CACHE), hub=str(huggingface_hub.constants.HF_HUB_CACHE),
                      telemetry_off=is_telemetry_disabled())))
"""


@pytest.mark.slow
def test_a_flow_module_keeps_prefect_plots_and_caches_under_the_state_folder(fresh):
    """``import flows.base`` imports prefect before anything from tasks/: flows/__init__.py has to come first."""
    home, opd, cwd = fresh
    out = run_py(["-c", PROBE.format(package="flows.base")], clean_env(home, opd), cwd, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got.pop("telemetry_off") is True, "MLflow telemetry is on"
    for what, path in got.items():
        assert Path(path).resolve().is_relative_to(opd.resolve()), f"{what}: {path} is outside {opd}"
    assert list((opd / "matplotlib").glob("fontlist*.json")), written(opd)  # the figure's font cache went there
    assert written(home) == [] and written(cwd) == [], (written(home), written(cwd))


def test_the_teachers_cli_sets_the_state_folder_before_it_imports_mlflow(fresh):
    home, opd, cwd = fresh
    keys = ["PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", "MPLCONFIGDIR", "HF_HOME"]
    out = run_py(["-c", f"import json, os, sys, teachers.cli; print(json.dumps([os.environ.get(k) for k in {keys}] + "
                  "[os.environ.get('MLFLOW_DISABLE_TELEMETRY'), 'mlflow' in sys.modules]))"],
                 clean_env(home, opd), cwd, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    *paths, telemetry_off, mlflow_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert [Path(p).is_relative_to(opd) for p in paths] == [True] * len(keys), dict(zip(keys, paths))
    assert telemetry_off == "true" and not mlflow_imported


def test_a_value_the_user_set_stands():
    env = {"PREFECT_LOCAL_STORAGE_PATH": "/elsewhere/results", "HF_HOME": "/elsewhere/hf",
           "MLFLOW_DISABLE_TELEMETRY": "false", "MPLCONFIGDIR": "/elsewhere/mpl"}
    got = state_env(env)
    # Either Prefect name for the result folder counts (the first one set wins in Prefect: ours would override it).
    assert not {"PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_LOCAL_STORAGE_PATH", "HF_HOME", "HF_TOKEN_PATH",
                "MLFLOW_DISABLE_TELEMETRY", "MPLCONFIGDIR"} & set(got)
    assert set(state_env({})) >= {"PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", "MPLCONFIGDIR", "HF_HOME",
                                  "MLFLOW_DISABLE_TELEMETRY"}
    # A PREFECT_HOME in the user's shell (say ~/.prefect) keeps Prefect's database there, not this folder's results.
    got = state_env({"PREFECT_HOME": "/home/someone/.prefect"})
    assert "PREFECT_HOME" not in got
    assert Path(got["PREFECT_RESULTS_LOCAL_STORAGE_PATH"]) == state_dir() / "prefect" / "storage"


def test_a_cached_world_is_never_another_state_folders(prefect_server, tmp_path, monkeypatch):
    """Two checkouts whose Prefect records meet (one PREFECT_HOME in the user's shell, or a process that imported
    prefect before tasks): each still builds its own world (its route spec, a cached task) and prompt set instead of
    being handed the other's folder."""
    from prefect import flow

    from tasks.config import WorldConfig
    from tasks.training.pretrain import prompt_set_task, spec_file

    @flow(name="state-folder-world")
    def world_of(cfg: WorldConfig) -> tuple[str, str]:
        return spec_file("", cfg), prompt_set_task("", cfg)

    cfg = WorldConfig(routes=["rev-low"], train_size=8, eval_size=4)
    worlds = {}
    for name in ("checkout-a", "checkout-b"):
        monkeypatch.setenv("OPD_HOME", str(tmp_path / name))
        worlds[name] = tuple(Path(p) for p in world_of(cfg))
    for name, (spec, prompt_set) in worlds.items():
        assert spec.is_relative_to(tmp_path / name) and prompt_set.is_relative_to(tmp_path / name), worlds
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "checkout-a"))
    assert tuple(Path(p) for p in world_of(cfg)) == worlds["checkout-a"]  # still cached within one state folder


@pytest.mark.e2e
def test_prepare_base_from_a_fresh_clone_writes_only_under_opd_home(fresh):
    home, opd, cwd = fresh
    out = run_py(["-m", "flows.base", "--profile", "quick", "--train.steps", "5", "--world.train_size", "20",
                  "--world.eval_size", "5"], clean_env(home, opd), cwd, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert written(home) == [], f"written under HOME: {written(home)}"
    assert written(cwd) == [], f"written in the cwd: {written(cwd)}"
    results = [p for p in (opd / "prefect" / "storage").rglob("*") if p.is_file()]
    assert len(results) >= 2, written(opd)  # the world's and the base's results (cache records included)
    assert (opd / "prefect" / "prefect.db").is_file() and (opd / "mlflow.db").is_file()
    assert [p.name for p in (opd / "world").iterdir()] and list((opd / "models").glob("base-*/model.safetensors"))


def test_openmp_threads_spin_briefly_unless_the_user_says_otherwise(fresh):
    """Importing the project caps OpenMP's spin before idle threads sleep (GOMP_SPINCOUNT 10000, set before torch
    starts OpenMP: a 2-thread merge beside another busy process was 3-10x slower at libgomp's default), and leaves a
    user's own choice alone."""
    home, opd, cwd = fresh
    code = "import flows, os; print(os.environ.get('GOMP_SPINCOUNT', 'unset'))"
    for given, want in (({}, "10000"), ({"GOMP_SPINCOUNT": "300000"}, "300000"),
                        ({"OMP_WAIT_POLICY": "PASSIVE"}, "unset")):
        env = clean_env(home, opd, **given)
        out = run_py(["-c", code], env, cwd, 120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.strip() == want
