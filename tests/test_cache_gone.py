"""Cached flow steps whose folders are gone. The world, base and specialist tasks are cached on their inputs and code
(a rerun returns the finished folder without training again); when that folder has since been deleted (to free
disk), the step runs again instead of handing the next step a path to nothing.

Run: python -m pytest tests/test_cache_gone.py -q
"""

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tasks.tracking.runs import tracking_uri

pytestmark = pytest.mark.e2e


def specialist_runs(route: str) -> int:
    from tasks.training.specialist import SPECIALISTS_EXPERIMENT

    client = MlflowClient(tracking_uri())
    exp = client.get_experiment_by_name(SPECIALISTS_EXPERIMENT)
    return len(client.search_runs([exp.experiment_id], f"tags.mlflow.runName = 'specialist-{route}'"))


def test_a_cached_base_or_specialist_whose_folder_is_gone_is_trained_again(prefect_server, latest_base_kept):
    from flows.base import prepare_base
    from flows.specialists import train_specialists
    from tasks.config import pipeline_config
    from teachers.registry import TeacherRegistry

    cfg = pipeline_config("quick", base_train={"steps": 6}, specialist_train={"steps": 3}, min_accuracy=0.0)
    base = prepare_base(cfg.pretrain())
    again = prepare_base(cfg.pretrain())  # a cache hit: the same folder, untouched
    assert again == base
    shutil.rmtree(base["uri"])
    rebuilt = prepare_base(cfg.pretrain())
    assert rebuilt["uri"] == base["uri"] and Path(base["uri"], "model.safetensors").is_file()
    assert rebuilt["accuracy"] == base["accuracy"]  # the same training, again

    scfg = cfg.specialists(base["uri"]).model_copy(update={"name_prefix": "gone"})
    routes = scfg.world.routes
    try:
        names = train_specialists(scfg)
        registry = TeacherRegistry()
        uris = {r: registry.get(f"gone-{r}").model_uri for r in routes}
        runs = {r: specialist_runs(r) for r in routes}
        shutil.rmtree(uris[routes[0]])
        assert train_specialists(scfg) == names
        registry = TeacherRegistry()
        assert {r: registry.get(f"gone-{r}").model_uri for r in routes} == uris
        assert all(Path(u, "model.safetensors").is_file() for u in uris.values())
        # Only the specialist whose folder was deleted trained again (a new MLflow run); the others were cache hits.
        assert {r: specialist_runs(r) - runs[r] for r in routes} == {r: int(r == routes[0]) for r in routes}
    finally:  # other tests route by the registry: leave no extra teacher per route behind
        registry = TeacherRegistry()
        for name in [n for n in registry.names() if n.startswith("gone-")]:
            registry.remove(name)
