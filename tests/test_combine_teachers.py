"""Several teachers for one route, combined (the route spec's ``teachers`` + ``combine``): the three combine modes on
tensors worked out by hand, the spec's validation, the router with two teachers on one route, and one short merge in
this process where a route has two (tiny, untrained) teachers, once per mode.

    python -m pytest tests/test_combine_teachers.py -q
"""

from __future__ import annotations

import copy
import dataclasses
import math
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from tasks.modeling.rollout import Rollout
from tasks.modeling.routing import registry_fingerprint
from tasks.modeling.teacher import TeacherScore
from tasks.objectives.combine import (CombinedHead, average_logprobs, mixture_logprobs, normalized_weights,
                                      select_teachers, sequence_nll)
from tasks.objectives.losses import Objective, chunked_objective
from tasks.specs.spec import RouteSpec, RouteSpecFile
from tasks.training.distill import combine_scores
from teachers.registry import Provenance, TeacherRecord, TeacherRegistry
from teachers.router import Router, RoutingError

LOG = math.log


# ------------------------------------------------------------------------------------------ the modes, by hand


def test_weights_are_normalised_and_default_uniform():
    assert normalized_weights([], 2).tolist() == [0.5, 0.5]
    assert normalized_weights([1, 3], 2).tolist() == [0.25, 0.75]
    with pytest.raises(ValueError, match="expected 2 positive"):
        normalized_weights([1, 0], 2)


def test_mixture_is_the_log_of_the_weighted_mean_probability():
    # p1 = [0.5, 0.5], p2 = [0.9, 0.1], weights 1:3 -> 0.25 p1 + 0.75 p2 = [0.125 + 0.675, 0.125 + 0.075] = [0.8, 0.2]
    logp_K_N_V = torch.tensor([[[LOG(0.5), LOG(0.5)]], [[LOG(0.9), LOG(0.1)]]])
    out_N_V = mixture_logprobs(logp_K_N_V, normalized_weights([1, 3], 2))
    assert out_N_V.exp()[0].tolist() == pytest.approx([0.8, 0.2], abs=1e-6)
    # Uniform: 0.5 p1 + 0.5 p2 = [0.7, 0.3]
    assert mixture_logprobs(logp_K_N_V, normalized_weights([], 2)).exp()[0].tolist() == pytest.approx([0.7, 0.3])


def test_average_logits_is_the_weighted_mean_of_log_probs_renormalised_as_a_geometric_mean():
    # 0.25 log p1 + 0.75 log p2 = [0.25 log .5 + 0.75 log .9, 0.25 log .5 + 0.75 log .1]
    #                         = [-0.173287 - 0.079021, -0.173287 - 1.726939] = [-0.252308, -1.900226];
    # softmax: the ratio of the two is (0.9 / 0.1) ** 0.75 = 9 ** 0.75 = 3 ** 1.5 = 5.19615, so
    # p = [5.19615 / 6.19615, 1 / 6.19615] = [0.838619, 0.161381].
    logp_K_N_V = torch.tensor([[[LOG(0.5), LOG(0.5)]], [[LOG(0.9), LOG(0.1)]]])
    out_N_V = average_logprobs(logp_K_N_V, normalized_weights([1, 3], 2))
    assert out_N_V[0].tolist() == pytest.approx([-0.252308, -1.900226], abs=1e-5)
    assert out_N_V.softmax(-1)[0].tolist() == pytest.approx([0.838619, 0.161381], abs=1e-5)


def test_weak_to_strong_composes_the_large_base_with_a_small_models_scaled_rl_delta_exactly():
    # Teachers (large base L, small RL model S_rl, small base S): L = [0.5, 0.5], S_rl = [0.8, 0.2], S = [0.4, 0.6];
    # alpha = 2: log L + 2 (log S_rl - log S) = log .5 + 2 log(.8 / .4) | log .5 + 2 log(.2 / .6)
    # = log(.5 * 4) | log(.5 / 9) -> p = [2, 1/18] / (2 + 1/18) = [36/37, 1/37].
    logp_K_N_V = torch.tensor([[[LOG(0.5), LOG(0.5)]], [[LOG(0.8), LOG(0.2)]], [[LOG(0.4), LOG(0.6)]]])
    w_K = normalized_weights([1, 2, -2], 3, signed=True)
    assert w_K.tolist() == [1.0, 2.0, -2.0]  # already summing to 1
    out_N_V = average_logprobs(logp_K_N_V, w_K)
    assert out_N_V[0].tolist() == pytest.approx([math.log(2.0), math.log(0.5 / 9)], abs=1e-5)
    assert out_N_V.softmax(-1)[0].tolist() == pytest.approx([36 / 37, 1 / 37], abs=1e-6)
    # Through the head the merge applies (features concatenated; each head's log-softmax, then the composition).
    heads = [torch.nn.Identity()] * 3
    head = CombinedHead(heads, [2, 2, 2], average_logprobs, w_K)
    z = head(torch.cat([logp_K_N_V[k] for k in range(3)], dim=-1))
    assert z.log_softmax(-1)[0].exp().tolist() == pytest.approx([36 / 37, 1 / 37], abs=1e-6)
    with pytest.raises(ValueError, match="positive sum"):
        normalized_weights([1, -1], 2, signed=True)
    with pytest.raises(ValueError, match="positive finite"):
        normalized_weights([1, 2, -2], 3)  # unsigned (mixture, sampling): every weight positive


def test_select_picks_the_lowest_mean_nll_per_sequence_ties_to_the_primary():
    # Summed NLL per (teacher, sequence) and each sequence's response tokens [2, 4, 0, 1]. Means:
    #   teacher 0: 2/2 = 1.0, 4/4 = 1.0,  0, 0.7/1 = 0.7
    #   teacher 1: 3/2 = 1.5, 3/4 = 0.75, 0, 0.7/1 = 0.7
    # -> [0 (1.0 < 1.5), 1 (0.75 < 1.0), 0 (no tokens), 0 (a tie)]. (Every teacher of a row is scored on the same
    # tokens, so the mean orders them as the sum does; the mean is what the metric teacher_nll reports.)
    nll_K_B = torch.tensor([[2.0, 4.0, 0.0, 0.7], [3.0, 3.0, 0.0, 0.7]])
    assert select_teachers(nll_K_B, torch.tensor([2, 4, 0, 1])).tolist() == [0, 1, 0, 0]
    # Three teachers on one 3-token row: sums 3.0, 4.5, 1.5 -> means 1.0, 1.5, 0.5 -> the third (index 2).
    assert select_teachers(torch.tensor([[3.0], [4.5], [1.5]]), torch.tensor([3])).tolist() == [2]


def test_sequence_nll_sums_masked_target_nll():
    # Log-probs as features with an identity head: position 0 p = [0.5, 0.5], position 1 p = [0.9, 0.1].
    # Targets [1, 0]: -log 0.5 - log 0.9 = 0.693147 + 0.105361 = 0.798508; masking position 1 leaves 0.693147,
    # position 0 0.105361 (in one chunk of 2, or two chunks of 1, the first of them all masked).
    feats_B_T_F = torch.tensor([[[LOG(0.5), LOG(0.5)], [LOG(0.9), LOG(0.1)]]])
    targets_B_T = torch.tensor([[1, 0]])
    head = torch.nn.Identity()
    assert sequence_nll(head, feats_B_T_F, targets_B_T, torch.tensor([[1, 1]])).tolist() == pytest.approx([0.798508])
    assert sequence_nll(head, feats_B_T_F, targets_B_T, torch.tensor([[1, 0]])).tolist() == pytest.approx([0.693147])
    assert sequence_nll(head, feats_B_T_F, targets_B_T, torch.tensor([[0, 1]]), chunk_size=1).tolist() == \
        pytest.approx([0.105361], abs=1e-6)


def test_combined_head_over_concatenated_features_and_the_objective_sees_the_combination():
    # Teacher 1 logits [0, 0] (p = [0.5, 0.5]), teacher 2 logits [log 9, 0] (p = [0.9, 0.1]), side by side.
    feats_N_F = torch.tensor([[0.0, 0.0, LOG(9.0), 0.0]])
    heads = [torch.nn.Identity(), torch.nn.Identity()]
    mix = CombinedHead(heads, [2, 2], mixture_logprobs, normalized_weights([1, 3], 2))
    assert mix(feats_N_F).exp()[0].tolist() == pytest.approx([0.8, 0.2], abs=1e-6)  # as in the mixture test above
    avg = CombinedHead(heads, [2, 2], average_logprobs, normalized_weights([1, 3], 2))
    assert avg(feats_N_F).softmax(-1)[0].tolist() == pytest.approx([0.838619, 0.161381], abs=1e-5)
    # A student whose distribution is exactly the mixture [0.8, 0.2] has zero reverse KL to the combined teacher,
    # chunk by chunk over T = 3 positions; the primary alone ([0.5, 0.5]) would give KL > 0.
    student_B_T_H = torch.tensor([[LOG(0.8), LOG(0.2)]]).expand(3, 2)[None]
    teacher_B_T_F = feats_N_F.expand(3, 4)[None]
    res = chunked_objective(student_B_T_H, teacher_B_T_F, torch.nn.Identity(), mix, torch.ones(1, 3), Objective(),
                            chunk_size=2)
    assert float(res.loss) == pytest.approx(0.0, abs=1e-6)
    alone = chunked_objective(student_B_T_H, teacher_B_T_F[..., :2], torch.nn.Identity(), torch.nn.Identity(),
                              torch.ones(1, 3), Objective())
    assert float(alone.loss) > 0.1


def tiny_rollout() -> tuple[Rollout, list[str]]:
    """Three rows of 3 tokens (1 prompt token, 2 response tokens) over V = 2: rows 0 and 1 of route x, row 2 of y.
    Targets (tokens 1..2): row 0 [1, 0], row 1 [0, 0]."""
    seqs_B_T = torch.tensor([[0, 1, 0], [0, 0, 0], [0, 1, 1]])
    resp_B_T = torch.tensor([[0, 1, 1]] * 3)
    return Rollout(seqs_B_T, torch.ones(3, 3, dtype=torch.long), resp_B_T, torch.zeros(3, dtype=torch.bool), 1), \
        ["x", "x", "y"]


def constant_score(rows: list[int], p: list[float]) -> TeacherScore:
    """A teacher whose next-token distribution is ``p`` everywhere: log-probs as features, an identity head."""
    return TeacherScore(rows, torch.tensor([LOG(v) for v in p]).expand(len(rows), 3, 2).clone(), torch.nn.Identity())


def test_combine_scores_select_splits_the_rows_and_reports_shares_and_nll():
    rollout, routes = tiny_rollout()
    scores = {"a": constant_score([0, 1], [0.5, 0.5]), "b": constant_score([0, 1], [0.9, 0.1]),
              "c": constant_score([2], [0.5, 0.5])}
    out, m = combine_scores(scores, {"x": (["a", "b"], "select", [])}, routes, rollout)
    # a: every token costs log 2 = 0.693147 (mean 0.693 on both rows).
    # b: row 0 targets [1, 0]: -log .1 - log .9 = 2.302585 + 0.105361 = 2.407946 (mean 1.204 > 0.693: a wins);
    #    row 1 targets [0, 0]: 2 * 0.105361 = 0.210721 (mean 0.105 < 0.693: b wins).
    assert out["a"].rows == [0] and out["b"].rows == [1] and out["c"] is scores["c"]
    assert torch.equal(out["b"].features_b_T_F, scores["b"].features_b_T_F[[1]])
    assert m["teacher_share/x/a"] == 0.5 and m["teacher_share/x/b"] == 0.5
    assert m["teacher_nll/x/a"] == pytest.approx(0.693147, abs=1e-5)  # 4 tokens at log 2
    assert m["teacher_nll/x/b"] == pytest.approx((2.407946 + 0.210721) / 4, abs=1e-5)  # 0.654667


def test_combine_scores_mixture_is_one_entry_over_the_routes_rows():
    rollout, routes = tiny_rollout()
    scores = {"a": constant_score([0, 1], [0.5, 0.5]), "b": constant_score([0, 1], [0.9, 0.1]),
              "c": constant_score([2], [0.5, 0.5])}
    out, m = combine_scores(scores, {"x": (["a", "b"], "mixture", [])}, routes, rollout)
    assert set(out) == {"a+b", "c"} and out["a+b"].rows == [0, 1]
    assert out["a+b"].features_b_T_F.shape == (2, 3, 4)
    # Uniform: 0.5 [0.5, 0.5] + 0.5 [0.9, 0.1] = [0.7, 0.3] at every position.
    assert out["a+b"].head(out["a+b"].features_b_T_F).exp()[0, 0].tolist() == pytest.approx([0.7, 0.3])
    assert set(m) == {"teacher_nll/x/a", "teacher_nll/x/b"}
    # A batch without the route's rows passes through untouched.
    only_y = {"c": scores["c"]}
    assert combine_scores(only_y, {"x": (["a", "b"], "mixture", [])}, routes, rollout) == (only_y, {})


# ------------------------------------------------------------------------------------------ the spec


ROUTE = {"name": "r", "data": {"source": "x.jsonl"}}


def test_spec_route_lists_teachers_with_a_combine_mode_and_weights():
    route = RouteSpec(**ROUTE, teachers=["a", "b"], combine="mixture", teacher_weights=[1, 3])
    assert route.teacher_names == ["a", "b"] and route.combine == "mixture" and route.teacher_weights == [1.0, 3.0]
    assert RouteSpec(**ROUTE).teacher_names == [] and RouteSpec(**ROUTE, teacher="t").teacher_names == ["t"]
    assert RouteSpec(**ROUTE).combine == "select"


@pytest.mark.parametrize("fields, message", [
    ({"teachers": ["a", "b"], "teacher": "c"}, "give teacher .* or teachers .*, not both"),
    ({"combine": "mixture"}, "apply to a route that lists teachers"),
    ({"teacher_weights": [1.0]}, "apply to a route that lists teachers"),
    ({"teachers": ["a", "b"], "teacher_weights": [1, 2]}, "not select"),
    ({"teachers": ["a", "b"], "combine": "mixture", "teacher_weights": [1]}, "1 teacher_weights for 2 teachers"),
    ({"teachers": ["a", "b"], "combine": "mixture", "teacher_weights": [1, 0]}, "positive finite"),
    ({"teachers": ["a", "b"], "combine": "average_logits", "teacher_weights": [1, -2]}, "with a positive sum"),
    ({"teachers": ["a", "b"], "combine": "mixture", "teacher_weights": [1.5, -0.5]}, "negative terms only with"),
    ({"teachers": ["a"]}, "write teacher: a"),
    ({"teachers": ["a", "a"]}, "appear more than once"),
    ({"teachers": ["a", "b"], "combine": "max"}, "'select', 'mixture' or 'average_logits'"),
])
def test_spec_refuses_what_cannot_combine(fields, message):
    with pytest.raises(ValidationError, match=message):
        RouteSpec(**ROUTE, **fields)


# ------------------------------------------------------------------------------------------ the router


def rec(name: str, route: str, year: int = 2024) -> TeacherRecord:
    return TeacherRecord(name=name, route=route, model_uri=f"/ckpt/{name}", tokenizer_fingerprint="sha256:abc",
                         provenance=Provenance(source="test", created_at=datetime(year, 1, 1, tzinfo=UTC)))


@pytest.fixture
def registry(tmp_path, monkeypatch) -> TeacherRegistry:
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "opd"))
    reg = TeacherRegistry(tmp_path / "registry.json")
    for r in [rec("add-high-v2", "add-high", 2025), rec("add-high-v1", "add-high"), rec("rev-low-a", "rev-low")]:
        reg.add(r)
    return reg


def spec_of(**add_high) -> RouteSpecFile:
    return RouteSpecFile(routes=[RouteSpec(name="add-high", data={"source": "a.jsonl"}, **add_high),
                                 RouteSpec(name="rev-low", data={"source": "r.jsonl"})])


def test_router_maps_a_route_to_two_teachers_from_the_spec(registry):
    spec = spec_of(teachers=["add-high-v1", "add-high-v2"], combine="mixture", teacher_weights=[1, 3])
    router = Router.for_merge(registry, ["add-high", "rev-low"], [], spec)
    assert router.teacher_for("add-high").name == "add-high-v1"  # the primary: the spec's first
    assert [r.name for r in router.teachers_for("add-high")] == ["add-high-v1", "add-high-v2"]
    assert router.combine_for("add-high") == ("mixture", [1.0, 3.0])
    assert router.combine_for("rev-low") == ("select", []) and len(router.teachers_for("rev-low")) == 1
    assert router.group(["add-high", "rev-low", "add-high"]) == {"add-high-v1": [0, 2], "add-high-v2": [0, 2],
                                                                  "rev-low-a": [1]}
    assert [t.name for t in router.teachers()] == ["add-high-v1", "add-high-v2", "rev-low-a"]
    assert registry_fingerprint(router.teachers()) != registry_fingerprint([router.teacher_for("add-high"),
                                                                           router.teacher_for("rev-low")])
    assert router.coverage({"add-high": 5})[0]["teacher"] == "add-high-v1+add-high-v2"
    # --teachers may name both when the spec lists them: the spec's order and weights hold.
    named = Router.for_merge(registry, ["add-high", "rev-low"], ["add-high-v2", "add-high-v1", "rev-low-a"], spec)
    assert [r.name for r in named.teachers_for("add-high")] == ["add-high-v1", "add-high-v2"]
    assert named.combine_for("add-high") == ("mixture", [1.0, 3.0])
    # Naming one of them: that one alone, nothing to combine.
    one = Router.for_merge(registry, ["add-high", "rev-low"], ["add-high-v2", "rev-low-a"], spec)
    assert [r.name for r in one.teachers_for("add-high")] == ["add-high-v2"]
    assert one.combine_for("add-high") == ("select", [])


def test_a_combined_route_needs_the_hf_teacher_backend(registry):
    """The one check preflight and the merge share (tasks.modeling.routing.combining_refusal)."""
    from tasks.modeling.routing import combining_refusal

    spec = spec_of(teachers=["add-high-v1", "add-high-v2"], combine="mixture")
    router = Router.for_merge(registry, ["add-high", "rev-low"], [], spec)
    assert combining_refusal(router, ["add-high", "rev-low"], "hf") == ""
    assert combining_refusal(router, ["rev-low"], "vllm") == ""  # no combined route among those asked
    assert combining_refusal(router, ["add-high", "rev-low"], "vllm") == (
        "'vllm', but route(s) ['add-high'] combine several teachers, which needs 'hf' (their checkpoints' full "
        "distributions); expected opd.teacher_backend hf, or one teacher per route")


def test_router_refuses_two_teachers_of_a_route_the_spec_does_not_combine_and_says_how(registry):
    with pytest.raises(RoutingError, match=r"list them in the route spec: routes\[add-high\].teachers: "
                                           r"\[add-high-v2, add-high-v1\] with combine"):
        Router.for_merge(registry, ["add-high", "rev-low"], ["add-high-v2", "add-high-v1", "rev-low-a"],
                         spec_of())
    with pytest.raises(RoutingError, match="'rev-low-a' is registered for route 'rev-low', not 'add-high'"):
        Router.for_merge(registry, ["add-high", "rev-low"], [], spec_of(teachers=["add-high-v1", "rev-low-a"]))


# ------------------------------------------------------------------------------------------ a merge, end to end

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
ROUTES = ["rev-low", "sort-low"]
RECOVERY = {"rev-a": 0.75, "rev-b": 0.25, "sort-a": 0.5}  # the teachers' recovery diagnostic in the merge


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """An untrained student, two untrained teachers of rev-low and one of sort-low in their own registry, and the
    built-in world's spec for the two routes."""
    import yaml

    from tasks.config import WorldConfig
    from tasks.modeling.models import create_model, save_model
    from tasks.world.data import build_world
    from tasks.world.spec import write_world_spec
    from tasks.world.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("combine")
    tok = build_char_tokenizer()
    save_model(create_model(tok, seed=0, **TINY), tok, root / "student")
    registry = TeacherRegistry(root / "registry.json")
    for i, (name, route) in enumerate([("rev-a", "rev-low"), ("rev-b", "rev-low"), ("sort-a", "sort-low")]):
        path = save_model(create_model(tok, seed=1 + i, **TINY), tok, root / name)
        registry.register_checkpoint(name, route, path, tok, provenance=Provenance(source="test", data="untrained"))
    world = WorldConfig(routes=ROUTES, train_size=40, eval_size=4, seed=0)
    spec = write_world_spec(world, build_world(world, root=root / "world"))
    return {"root": root, "registry": registry, "world": world, "spec": spec, "raw": yaml.safe_load(spec.read_text())}


def combined_spec(setup, combine: str, weights: list[float]) -> Path:
    """The world's spec with rev-low's two teachers (rev-a the primary, rev-b) combined by ``combine``."""
    import yaml

    raw = copy.deepcopy(setup["raw"])
    raw["routes"][0].update(teachers=["rev-a", "rev-b"], combine=combine,
                            **({"teacher_weights": weights} if weights else {}))
    raw["routes"][0].pop("teacher", None)
    spec = setup["spec"].with_name(f"routes-{combine}.yaml")  # beside the world's data (relative paths)
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    return spec


def run_combined_merge(setup, combine: str, weights: list[float]):
    import tasks.merging.merge
    from tasks.config import MergeConfig, OPDConfig
    from tasks.merging.merge import merge_rank, start_merge_run
    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set

    spec = combined_spec(setup, combine, weights)
    prompt_set = str(build_prompt_set(spec, root=setup["root"] / "prompt_sets"))
    router = Router.for_merge(setup["registry"], load_prompt_set(prompt_set).routes, [],
                              load_prompt_set(prompt_set).spec)
    opd = OPDConfig(steps=2, batch_size=8, max_new_tokens=4, warmup_steps=0, eval_every=2, cold_start_steps=0,
                    gate_threshold=0.0, pass_k=0, recovery_prompts=2, lmbda=1.0, max_resident_teachers=2)
    cfg = MergeConfig(world=setup["world"], student_uri=str(setup["root"] / "student"), opd=opd,
                      experiment="test-combine", label=combine)
    scored = []
    real_update = tasks.merging.merge.update_step

    def update_spy(student, batch, teacher_hidden, *args, **kwargs):
        scored.append((list(batch.routes), {name: list(s.rows) for name, s in teacher_hidden.items()}))
        return real_update(student, batch, teacher_hidden, *args, **kwargs)

    # Untrained teachers score 0 everywhere: their held-out accuracies are set, in the order the merge measures them
    # (rev-low's rev-a, rev-b, then sort-low's sort-a), so that the best of a route's two is not also the first.
    accuracies = iter([0.25, 0.75, 0.5])
    real_evaluate = tasks.merging.merge.evaluate_teacher

    def evaluate_spy(*args, **kwargs):
        return dataclasses.replace(real_evaluate(*args, **kwargs), accuracy=next(accuracies))

    def recovery_stub(model, *args, **kwargs):  # the recovery diagnostic, set per checkpoint (the student's 0)
        return RECOVERY.get(Path(model.name_or_path).name, 0.0)

    offpolicy, real_offpolicy = [], tasks.merging.merge.OffPolicyData

    def offpolicy_spy(*args, **kwargs):
        offpolicy.append(real_offpolicy(*args, **kwargs))
        return offpolicy[-1]

    run_id = start_merge_run(cfg, router, f"combine-{combine}", prompt_set)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks.merging.merge, "OffPolicyData", offpolicy_spy)
        mp.setattr(tasks.merging.merge, "update_step", update_spy)
        mp.setattr(tasks.merging.merge, "evaluate_teacher", evaluate_spy)
        mp.setattr(tasks.merging.merge, "recovery_rate", recovery_stub)
        out = merge_rank(cfg, prompt_set, router, run_id)
    return out, scored, offpolicy[0]


@pytest.mark.e2e
@pytest.mark.parametrize("combine, weights", [("select", []), ("mixture", [1.0, 3.0]), ("average_logits", []),
                                             ("average_logits", [1.5, -0.5])])
def test_a_merge_with_two_teachers_on_one_route(setup, combine, weights, capsys):
    from mlflow.tracking import MlflowClient

    from tasks.tracking.runs import tracking_uri

    out, scored, offpolicy = run_combined_merge(setup, combine, weights)
    rows = {row["route"]: row for row in out["rows"]}
    assert rows["rev-low"]["teacher"] == "rev-a+rev-b" and rows["sort-low"]["teacher"] == "sort-a"
    run = MlflowClient(tracking_uri()).get_run(out["run_id"])
    m = run.data.metrics
    # The retention denominator of the two-teacher route: the better of its teachers' held-out accuracies.
    assert (m["teacher_accuracy/rev-low/rev-a"], m["teacher_accuracy/rev-low/rev-b"]) == (0.25, 0.75)
    assert rows["rev-low"]["teacher_accuracy"] == m["teacher_accuracy/rev-low"] == 0.75
    assert rows["rev-low"]["retention"] == pytest.approx(rows["rev-low"]["student_accuracy"] / 0.75)
    assert rows["sort-low"]["teacher_accuracy"] == 0.5 and "teacher_accuracy/sort-low/sort-a" not in m
    assert run.data.tags["combine.rev-low"] == f"{combine} {weights}"
    # The recovery diagnostic too measures each teacher of rev-low, and keeps the better (here the primary).
    assert (m["recovery/teacher/rev-low/rev-a"], m["recovery/teacher/rev-low/rev-b"]) == (0.75, 0.25)
    assert m["recovery/teacher/rev-low"] == 0.75 and m["recovery/teacher/sort-low"] == 0.5
    assert "recovery/teacher/sort-low/sort-a" not in m
    assert "rev-low 0.00 / 0.75 / 0.00, sort-low 0.00 / 0.50 / 0.00" in capsys.readouterr().out  # the summary's
    assert {"teacher_nll/rev-low/rev-a", "teacher_nll/rev-low/rev-b"} <= set(m)
    assert len(scored) == 2
    # Off-policy completions (the cold start, GKD's 1 - lambda) of rev-low come from both of its teachers, by weight.
    # A composed teacher (a negative weight) has no sampling distribution of its own: its primary samples.
    assert offpolicy.sample_from == ({} if -0.5 in weights else {"rev-low": (["rev-a", "rev-b"], weights)})
    assert -0.5 not in weights or offpolicy.teacher("a prompt", "rev-low") == "rev-a"
    assert offpolicy.teacher("a prompt", "sort-low") == "sort-a"
    for routes, step in scored:  # every rev-low row scored once, by a teacher of rev-low or their combination
        assert step["sort-a"] == [i for i, r in enumerate(routes) if r == "sort-low"]
        rev = {name: rows for name, rows in step.items() if name != "sort-a"}
        assert sorted(i for rows in rev.values() for i in rows) == [i for i, r in enumerate(routes) if r == "rev-low"]
        if combine == "select":
            assert set(rev) <= {"rev-a", "rev-b"}
        else:
            assert set(rev) == {"rev-a+rev-b"}
    if combine == "select":
        shares = [m["teacher_share/rev-low/rev-a"], m["teacher_share/rev-low/rev-b"]]
        assert sum(shares) == pytest.approx(1.0)
    else:
        assert not any(k.startswith("teacher_share/") for k in m)


# ------------------------------------------------------------------------------------------ flows.evaluate

# Held-out accuracy per (checkpoint folder, route), set (untrained models score 0): rev-low's better teacher is its
# second, rev-b; on sort-low the base beats the teacher (no gain to recover) and the model (left below its base).
ACCURACY = {("student", "rev-low"): 0.5, ("base", "rev-low"): 0.125, ("rev-a", "rev-low"): 0.25,
            ("rev-b", "rev-low"): 0.75, ("student", "sort-low"): 0.5, ("base", "sort-low"): 0.625,
            ("sort-a", "sort-low"): 0.5}


@pytest.mark.e2e
def test_evaluate_measures_every_teacher_of_a_route_and_the_base(setup, prefect_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    import flows.evaluate
    from flows.evaluate import NO_BASE, EvaluateConfig, evaluate
    from tasks.modeling.models import create_model, save_model
    from tasks.tracking.runs import tracking_uri
    from tasks.world.tokenizer import build_char_tokenizer

    root, tok = setup["root"], build_char_tokenizer()
    base = root / "base"
    if not base.exists():
        save_model(create_model(tok, seed=9, **TINY), tok, base)
    spec, student = combined_spec(setup, "select", []), str(root / "student")
    loaded, said = [], []
    real_load, real_evaluate = flows.evaluate.load_model, flows.evaluate.evaluate_prompt_set

    def load_spy(uri, *args, **kwargs):
        loaded.append(Path(uri).name)
        return real_load(uri, *args, **kwargs)

    def evaluate_spy(model, tok, ps, eval_sets):
        scores = real_evaluate(model, tok, ps, eval_sets)
        return {r: dataclasses.replace(s, accuracy=ACCURACY[Path(model.name_or_path).name, r])
                for r, s in scores.items()}

    monkeypatch.setenv("OPD_REGISTRY", str(setup["registry"].path))
    monkeypatch.setattr(flows.evaluate, "load_model", load_spy)
    monkeypatch.setattr(flows.evaluate, "evaluate_prompt_set", evaluate_spy)
    monkeypatch.setattr(flows.evaluate, "say", said.append)
    cfg = EvaluateConfig(spec=str(spec), model_uri=student, base_uri=str(base), experiment="test-combine-eval")
    out = evaluate(cfg)
    assert sorted(loaded) == ["base", "rev-a", "rev-b", "sort-a", "student"]  # each checkpoint loaded once
    rows = {row["route"]: row for row in out["rows"]}
    rev, srt = rows["rev-low"], rows["sort-low"]
    # rev-low: measured against the better of its two teachers; gain recovered (0.5 - 0.125) / (0.75 - 0.125) = 0.6.
    assert rev["teacher"] == "rev-b" and rev["teacher_accuracies"] == {"rev-a": 0.25, "rev-b": 0.75}
    assert (rev["teacher_accuracy"], rev["base_accuracy"], rev["model_accuracy"], rev["student_accuracy"]) == \
        (0.75, 0.125, 0.5, 0.5)
    assert rev["retention"] == pytest.approx(0.5 / 0.75, abs=1e-9)
    assert rev["gain_recovered"] == pytest.approx((0.5 - 0.125) / (0.75 - 0.125), abs=1e-9)
    assert rev["gain_recovered"] == pytest.approx(0.6, abs=1e-9)
    # sort-low: one teacher, which gained nothing over the base (0.5 < 0.625): no gain to recover.
    assert srt["teacher"] == "sort-a" and srt["teacher_accuracies"] == {"sort-a": 0.5}
    assert (srt["base_accuracy"], srt["gain_recovered"], srt["retention"]) == (0.625, None, 1.0)
    m = MlflowClient(tracking_uri()).get_run(out["run_id"]).data.metrics
    assert (m["teacher_accuracy/rev-low/rev-a"], m["teacher_accuracy/rev-low/rev-b"]) == (0.25, 0.75)
    assert m["teacher_accuracy/rev-low"] == 0.75 and m["teacher_accuracy/sort-low"] == 0.5
    assert "teacher_accuracy/sort-low/sort-a" not in m
    assert (m["base_accuracy/rev-low"], m["base_accuracy/sort-low"]) == (0.125, 0.625)
    assert m["gain_recovered/rev-low"] == pytest.approx(0.6, abs=1e-9) and "gain_recovered/sort-low" not in m
    assert (m["model_accuracy/rev-low"], m["model_accuracy/sort-low"]) == (0.5, 0.5)
    assert m["retention/mean"] == pytest.approx((0.5 / 0.75 + 1.0) / 2, abs=1e-9)
    # The merge's table and its warning for a route left below its base.
    assert any("gain rec." in line and "rev-b" in line for line in said), said
    assert "warning: the student ended below its base on 1 route(s): sort-low (student 0.500 < base 0.625)" in said

    loaded.clear(), said.clear()
    out = evaluate(cfg.model_copy(update={"base_uri": NO_BASE}))
    assert "base" not in loaded
    assert [(row["base_accuracy"], row["gain_recovered"]) for row in out["rows"]] == [(None, None)] * 2
    assert [line for line in said if line.startswith("no base measured")] == [
        "no base measured (base_uri 'none'): base_accuracy and gain_recovered are left empty"]
    m = MlflowClient(tracking_uri()).get_run(out["run_id"]).data.metrics
    assert not any(k.startswith(("base_accuracy/", "gain_recovered/")) for k in m)
    assert not any(line.startswith("warning:") for line in said)
