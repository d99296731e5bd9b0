"""A route's own specialist recipe (a spec route's ``specialist`` fields over the flow's ``specialist_train`` or
``specialist_rl``): checked by the preflights, and applied by the specialists flow to that
route only.

Run: python -m pytest tests/test_route_specialist.py -q
"""

import pytest
import yaml

from tasks.config import RLConfig, TrainConfig
from tasks.specs.spec import RouteSpec
from tasks.training.specialist import recipe_problems, route_recipe

DATA = {"source": "rows.jsonl"}


def test_the_specialist_fields_are_checked_by_the_preflights_not_by_the_spec_layer(tmp_path):
    from tasks.specs.spec import load_spec

    # the spec layer sits below the recipes (tests/test_layout.py): it keeps the mapping, the preflights judge it
    assert RouteSpec(name="r", data=DATA, specialist={"steps": 600, "lr": 0.002}).specialist == {"steps": 600,
                                                                                                "lr": 0.002}
    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    spec = tmp_path / "routes.yaml"
    spec.write_text(yaml.safe_dump({"version": 1, "routes": [
        {"name": "typo", "data": DATA, "specialist": {"stepz": 600}},
        {"name": "zero", "data": DATA, "specialist": {"steps": 0}},
        {"name": "fine", "data": DATA, "specialist": {"steps": 600}}]}))
    typo, zero = recipe_problems(load_spec(spec), TrainConfig())
    assert typo.field == "routes[typo].specialist" and "['stepz'] are not fields of the sft recipe" in typo.message
    assert zero.field == "routes[zero].specialist" and "greater than or equal to 1" in zero.message


def test_route_recipe_sets_only_the_named_fields_and_refuses_the_other_trainers():
    flow = TrainConfig(steps=150, lr=1e-3, lora_rank=16)
    own = route_recipe(flow, "arith-answer", {"steps": 600})
    assert own.steps == 600 and own.model_dump() == {**flow.model_dump(), "steps": 600}
    assert own.config_hash() != flow.config_hash()  # its own cache entry and provenance
    assert route_recipe(flow, "arith-answer", {}) is flow
    with pytest.raises(ValueError, match=r"routes\[arith-answer\].specialist: \['group_size'\] are not fields of the "
                                         r"sft recipe"):
        route_recipe(flow, "arith-answer", {"group_size": 4})
    assert route_recipe(RLConfig(), "a", {"group_size": 4}).group_size == 4


def test_the_preflight_names_the_route_whose_fields_belong_to_the_other_recipe(tmp_path):
    from tasks.specs.spec import load_spec

    (tmp_path / "rows.jsonl").write_text('{"prompt": "a", "answer": "b"}\n')
    spec = tmp_path / "routes.yaml"
    spec.write_text(yaml.safe_dump({"version": 1, "routes": [
        {"name": "one", "data": DATA, "specialist": {"steps": 9}},
        {"name": "two", "data": DATA, "specialist": {"group_size": 4}}]}))
    assert recipe_problems(load_spec(spec), RLConfig()) == []  # steps and group_size are both rl fields
    (problem,) = recipe_problems(load_spec(spec), TrainConfig())
    assert problem.file == str(spec) and problem.field == "routes[two].specialist" and "group_size" in problem.message


@pytest.mark.e2e
def test_the_specialists_flow_trains_each_route_with_its_own_recipe(short_pipeline):
    from mlflow.tracking import MlflowClient

    from flows.specialists import train_specialists
    from tasks.tracking.runs import tracking_uri
    from tasks.training.specialist import SPECIALISTS_EXPERIMENT
    from tasks.world.spec import write_world_spec
    from teachers.registry import TeacherRegistry

    cfg, result = short_pipeline
    world_spec = write_world_spec(cfg.world)
    doc = yaml.safe_load(world_spec.read_text())
    first = doc["routes"][0]["name"]
    doc["routes"][0]["specialist"] = {"steps": 5}
    spec = world_spec.with_name("routes-own-recipe.yaml")  # beside it: the data files resolve the same
    spec.write_text(yaml.safe_dump(doc, sort_keys=False))
    scfg = cfg.specialists(result["base_uri"]).model_copy(update={
        "spec": str(spec), "name_prefix": "own", "train": cfg.specialist_train.model_copy(update={"steps": 3})})
    names = train_specialists(scfg)
    assert sorted(names) == sorted(f"own-{r['name']}" for r in doc["routes"])
    registry = TeacherRegistry()
    hashes = {r["name"]: registry.get(f"own-{r['name']}").provenance.config_hash for r in doc["routes"]}
    assert hashes[first] == route_recipe(scfg.train, first, {"steps": 5}).config_hash()
    assert {h for r, h in hashes.items() if r != first} == {scfg.train.config_hash()}
    client = MlflowClient(tracking_uri())
    exp = client.get_experiment_by_name(SPECIALISTS_EXPERIMENT)
    for route in hashes:
        runs = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = 'specialist-{route}'")
        # this test's run is the newest of the route's (the fixture's pipeline trained one at the profile's steps)
        newest = max(runs, key=lambda r: r.info.start_time)
        assert newest.data.params["steps"] == ("5" if route == first else "3"), route
