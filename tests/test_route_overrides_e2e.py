"""Per-route settings change what the merge does, not only what it logs: one short merge through the real flow with
a per-route rollout cap, loss, loss weight and prompt template, watched at the calls that act on them (the batch each
update learns from, the sequences each teacher scores, the objective and weights each update applies)."""

import json
from inspect import signature

import pytest
from mlflow.tracking import MlflowClient

import tasks.merging.merge
from tasks.tracking.runs import tracking_uri

pytestmark = pytest.mark.e2e

CAP = 3  # rev-high's rollout cap: below its shortest gold completion ("2|ba" + EOS = 5 tokens)
HIGH_TEMPLATE = "{bos}{domain}{problem}x="  # rev-high's prompts without the budget tag, ending "x="


@pytest.fixture(scope="module")
def overridden(short_pipeline):
    """The merge, and what its updates and teacher calls saw: [(routes, response lengths, route_weights,
    objectives, stats)] and [(teacher, decoded sequences)]."""
    from flows.merge import merge
    from tasks.specs.tokenizer import load_tokenizer

    cfg, res = short_pipeline
    routes = cfg.world.routes
    assert routes == ["rev-low", "rev-high", "sort-low"]
    world = cfg.world.model_copy(update={"budget_templates": {"high": HIGH_TEMPLATE}})
    mcfg = cfg.merge(res["base_uri"], res["teachers"], label="overrides").model_copy(update={"world": world})
    mcfg = mcfg.model_copy(update={"opd": mcfg.opd.model_validate({
        **mcfg.opd.model_dump(), "steps": 6, "eval_every": 6, "batch_size": 24, "gate_threshold": 0.0,
        "route_max_new_tokens": {"rev-high": CAP},
        "route_loss": {"sort-low": "forward_kl"},
        "route_weights": {"rev-low": 3.0, "sort-low": 0.0},
        "route_normalization": "label:budget",  # rev-low and sort-low share a group, rev-high has its own
    })})
    tok = load_tokenizer(res["base_uri"])
    updates, scored = [], []
    real_update, real_score = tasks.merging.merge.update_step, tasks.merging.merge.score_with_teachers

    def update_spy(student, batch, teacher_hidden, objectives, *args, **kwargs):
        stats = real_update(student, batch, teacher_hidden, objectives, *args, **kwargs)
        weights = signature(real_update).bind(student, batch, teacher_hidden, objectives, *args,
                                              **kwargs).arguments.get("route_weights")
        updates.append((list(batch.routes), batch.rollout.response_lengths_B.tolist(), dict(weights or {}),
                        dict(objectives), stats))
        return stats

    def score_spy(teachers, groups, rollout, *args, **kwargs):
        for name, rows in groups.items():
            for row in rows:
                ids = rollout.sequences_B_T[row][rollout.attention_mask_B_T[row].bool()]
                scored.append((name, tok.decode(ids[: len(ids) - int(rollout.response_lengths_B[row])])))
        return real_score(teachers, groups, rollout, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks.merging.merge, "update_step", update_spy)
        mp.setattr(tasks.merging.merge, "score_with_teachers", score_spy)
        out = merge(mcfg)
    return mcfg, out, updates, scored


def test_a_route_cap_bounds_that_route_rollouts_only(overridden):
    mcfg, out, updates, _ = overridden
    lengths: dict[str, list[int]] = {}
    for routes, lens, *_ in updates:
        for r, n in zip(routes, lens):
            lengths.setdefault(r, []).append(n)
    assert len(updates) == mcfg.opd.steps and set(lengths) == set(mcfg.world.routes)
    assert max(lengths["rev-high"]) <= CAP, lengths["rev-high"]
    assert max(lengths["sort-low"]) > CAP  # the cap is that route's, not the merge's
    # What MLflow shows agrees, and greedy evaluation decodes under the same cap.
    m = MlflowClient(tracking_uri()).get_run(out["run_id"]).data.metrics
    assert m["rollout_length/rev-high"] <= CAP < m["rollout_length/sort-low"]
    assert m["response_length/rev-high"] <= CAP < m["response_length/sort-low"]


def test_each_teacher_scored_prompts_rendered_with_its_route_template(overridden):
    _, out, _, scored = overridden
    teacher_of = {r["route"]: r["teacher"] for r in out["rows"]}
    by_teacher: dict[str, list[str]] = {}
    for name, prompt in scored:
        by_teacher.setdefault(name, []).append(prompt)
    assert set(by_teacher) == set(teacher_of.values())
    high = by_teacher[teacher_of["rev-high"]]
    assert all(p.startswith("<bos><rev>") and p.endswith("x=") and "<high>" not in p for p in high), high[:5]
    for route in ("rev-low", "sort-low"):  # the default template, budget tag included
        prompts = by_teacher[teacher_of[route]]
        domain, budget = route.split("-")
        assert all(p.startswith(f"<bos><{domain}><{budget}>") and not p.endswith("x=") for p in prompts), prompts[:5]


def test_route_loss_and_weight_are_what_each_update_applies(overridden):
    mcfg, _, updates, _ = overridden
    for routes, _, weights, objectives, stats in updates:
        assert weights == {"rev-low": 3.0, "sort-low": 0.0}
        assert objectives["sort-low"].loss == "forward_kl" and objectives["rev-low"].loss == "reverse_kl"
        assert objectives["rev-high"].loss == "reverse_kl"
        # The step's loss is the weighted sum of the routes' summed objectives over the batch's response tokens,
        # each scaled by its budget group's signal normalisation: rev-low counts three times, sort-low not at all,
        # although sort-low's own objective is not zero.
        scale = stats.signal_scale
        assert scale["rev-low"] == scale["sort-low"] and set(scale) == set(routes)
        expected = (3.0 * scale["rev-low"] * stats.loss_sum.get("rev-low", 0.0)
                    + scale["rev-high"] * stats.loss_sum.get("rev-high", 0.0)) / stats.tokens
        assert stats.loss == pytest.approx(expected, rel=1e-4, abs=1e-7)
        assert "sort-low" in routes and stats.loss_sum["sort-low"] > 0
        assert all(0.25 <= v <= 4.0 for v in scale.values())
    assert any(u[4].signal_scale["rev-high"] != 1.0 for u in updates)
    client = MlflowClient(tracking_uri())
    params = client.get_run(overridden[1]["run_id"]).data.params
    assert json.loads(params["opd.route_weights"]) == {"rev-low": 3.0, "sort-low": 0.0}
    assert params["opd.route_normalization"] == "label:budget"
    logged = client.get_metric_history(overridden[1]["run_id"], "signal_scale/rev-high")
    assert [m.value for m in logged] == pytest.approx([u[4].signal_scale["rev-high"] for u in updates])
