"""Restoration through the real flows on the quick model: a chain of two merges, the short pipeline's (its student
trained from the base) and a second one started from an untrained model, which has lost every route; the restore
flow gives each lost route the best earlier checkpoint as teacher in the third merge and records the chain."""

import pytest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def chained(short_pipeline, tmp_path_factory):
    from mlflow.tracking import MlflowClient

    from flows.merge import merge
    from flows.restore import RestoreConfig, restore
    from tasks.modeling.models import create_model, save_model
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.tracking.runs import tracking_uri

    cfg, res = short_pipeline
    tok = load_tokenizer(res["base_uri"])
    blank = save_model(create_model(tok, seed=7), tok, tmp_path_factory.mktemp("blank") / "student")
    opd = {"steps": 2, "eval_every": 1000, "gate_threshold": 0.0, "cold_start_steps": 0}
    lost = merge(cfg.merge(str(blank), res["teachers"], label="lost").model_copy(
        update={"opd": cfg.merge("", []).opd.model_validate({**cfg.merge("", []).opd.model_dump(), **opd})}))
    fields = cfg.merge("", [], label="restored").model_dump()
    fields["opd"].update(opd)
    out = restore(RestoreConfig.model_validate({**fields, "chain": [res["run_id"], lost["run_id"]],
                                                "restore_below": 0.9}))
    client = MlflowClient(tracking_uri())
    return res, lost, out, client


def test_each_lost_route_learns_from_the_best_earlier_checkpoint_and_the_chain_is_recorded(chained):
    from tasks.merging.restore import read_chain, restoration_plan
    from teachers.registry import TeacherRegistry

    first, lost, out, client = chained
    chain = read_chain([first["run_id"], lost["run_id"]], client)
    plan = restoration_plan(chain, 0.9)
    assert plan, "the untrained start lost no route to an earlier checkpoint"  # the base scores > 0 somewhere
    assert out["restored"] == {r: f"restore-{r}-{p.source[:8]}" for r, p in plan.items()}
    registry = TeacherRegistry()
    for route, p in plan.items():
        rec = registry.get(out["restored"][route])
        assert (rec.route, rec.model_uri) == (route, p.uri)
        assert p.uri in (chain[0].start_uri, chain[0].merged_uri)  # an earlier checkpoint, never the lost one
        assert p.accuracy > chain[1].accuracy[route]
    run = client.get_run(out["run_id"])
    tags = run.data.tags
    assert tags["chain.parent"] == lost["run_id"] and tags["chain.runs"] == f"{first['run_id']},{lost['run_id']}"
    assert set(k.removeprefix("restore.") for k in tags if k.startswith("restore.")) == set(plan)
    # Merge k+1 started from merge k's student; each restored route's teacher replaced, the others kept.
    assert tags["student_uri"] == chain[1].merged_uri
    teachers = tags["teachers"].split(",")
    routes = {registry.get(n).route: n for n in teachers}
    assert set(routes) == set(chain[1].accuracy)
    for route, name in routes.items():
        assert name == out["restored"][route] if route in plan else name in first["teachers"]
