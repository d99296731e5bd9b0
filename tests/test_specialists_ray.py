"""The train-specialists fan-out on a local Ray instance through prefect-ray, for real: two tiny specialists trained
in Ray worker processes, registered as teachers and tracked in MLflow like the thread runner's."""

import os
import socket

import pytest
from mlflow.tracking import MlflowClient

from tasks.config import SpecialistsConfig, pipeline_config
from tasks.world.data import build_world
from tasks.modeling.models import create_model, save_model
from tasks.common.paths import models_dir
from tasks.specs.tokenizer import load_tokenizer
from tasks.tracking.runs import tracking_uri
from teachers.registry import TeacherRegistry

pytestmark = pytest.mark.e2e


def test_quick_specialists_flow_runs_on_local_ray(prefect_server):
    from flows.specialists import train_specialists

    world = pipeline_config("quick").world.model_copy(update={"routes": ["rev-low", "sort-low"], "train_size": 300,
                                                              "eval_size": 20})
    tok = load_tokenizer(build_world(world) / "tokenizer")
    base = save_model(create_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, seed=5),
                      tok, models_dir() / "ray-test-base")
    cfg = SpecialistsConfig(world=world, base_uri=str(base), min_accuracy=0.0, workers=2, runner="ray",
                            name_prefix="ray", train={"steps": 20, "batch_size": 16, "warmup_steps": 2})
    names = train_specialists(cfg)
    assert sorted(names) == ["ray-rev-low", "ray-sort-low"]
    registry = TeacherRegistry()
    for name in names:
        rec = registry.get(name)
        assert rec.provenance.source == "train-specialists" and os.path.isdir(rec.model_uri)
    client = MlflowClient(tracking_uri())
    exp = client.get_experiment_by_name("opd-specialists")
    runs = client.search_runs([exp.experiment_id], "params.base_uri = '%s'" % base)
    assert sorted(r.info.run_name for r in runs) == ["specialist-rev-low", "specialist-sort-low"]
    # Trained in Ray worker processes, not in this one (the thread runner would show this process here).
    processes = {r.data.tags["process"] for r in runs}
    here = f"{socket.gethostname()}:{os.getpid()}"
    assert here not in processes, processes
    # Each tag names a real process of this host (not a placeholder that would pass the check above by itself).
    for tag in processes:
        host, _, pid = tag.rpartition(":")
        assert host == socket.gethostname() and pid.isdigit() and int(pid) != os.getpid(), tag
