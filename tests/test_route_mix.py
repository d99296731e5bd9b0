"""Retention-driven route sampling (tasks/merging/route_mix.py and the prompt sampler's shares), with hand-computed
values. The merge that uses it end to end: tests/test_resume.py (resumed with identical weights) and
tests/test_pipeline_e2e.py (the shares follow the slice's retention)."""

import pytest

from tasks.merging.route_mix import hold_out, route_need, route_shares, smooth_need
from tasks.training.distill import PromptSampler


def test_need_is_one_minus_retention_clipped():
    # a: 0.45 / 0.9 = 0.5 -> 0.5; b: past its teacher -> 0; c: nothing right -> 1; d: teacher 0 -> no signal.
    need = route_need({"a": 0.45, "b": 0.95, "c": 0.0, "d": 0.3}, {"a": 0.9, "b": 0.9, "c": 0.8, "d": 0.0})
    assert need == pytest.approx({"a": 0.5, "b": 0.0, "c": 1.0, "d": 0.0})


def test_smoothing_weighs_the_previous_need():
    assert smooth_need({"a": 0.4, "b": 0.0}, {"a": 0.2, "b": 0.6}, 0.75) == pytest.approx({"a": 0.35, "b": 0.15})
    assert smooth_need({}, {"a": 0.2}, 0.75) == {"a": 0.2}  # the first measurement stands alone
    assert smooth_need({"a": 0.4}, {"a": 0.2}, 0.0) == {"a": 0.2}


def test_shares_keep_a_floor_and_follow_need():
    # floor 0.5 over 3 routes: 1/6 each, then 0.5 split 3:1:0.
    shares = route_shares({"a": 0.3, "b": 0.1, "c": 0.0}, 0.5)
    assert shares == pytest.approx({"a": 1 / 6 + 0.375, "b": 1 / 6 + 0.125, "c": 1 / 6})
    assert sum(shares.values()) == pytest.approx(1.0)
    assert route_shares({"a": 0.0, "b": 0.0}, 0.2) == {"a": 0.5, "b": 0.5}  # nothing lacking: uniform
    assert route_shares({"a": 0.9, "b": 0.1}, 1.0) == pytest.approx({"a": 0.5, "b": 0.5})  # floor 1: uniform
    assert route_shares({"a": 0.9, "b": 0.1}, 0.0) == pytest.approx({"a": 0.9, "b": 0.1})
    with pytest.raises(ValueError):
        route_shares({"a": 0.1}, 1.5)


def test_the_slice_is_held_out_of_training():
    train = {"a": ([f"p{i}" for i in range(12)], [f"x{i}" for i in range(12)]), "b": (["q0", "q1", "q2", "q3"],
                                                                                      ["y0", "y1", "y2", "y3"])}
    kept, held = hold_out(train, 3)
    assert held["a"] == (["p9", "p10", "p11"], ["x9", "x10", "x11"]) and kept["a"][0] == [f"p{i}" for i in range(9)]
    assert held["b"] == (["q3"], ["y3"]) and kept["b"] == (["q0", "q1", "q2"], ["y0", "y1", "y2"])  # a quarter at most
    with pytest.raises(ValueError, match="needs at least 4"):
        hold_out({"c": (["r0", "r1", "r2"], ["z0", "z1", "z2"])}, 3)


def test_the_sampler_draws_routes_by_their_shares():
    train = {r: ([f"{r}{i}" for i in range(5)], [str(i) for i in range(5)]) for r in ("a", "b", "c")}
    sampler = PromptSampler(train, seed=3)
    _, uniform, _ = sampler.draw(3000)
    assert all(abs(uniform.count(r) / 3000 - 1 / 3) < 0.04 for r in "abc")
    sampler.shares = {"a": 0.7, "b": 0.2, "c": 0.1}
    prompts, routes, answers = sampler.draw(3000)
    assert [routes.count(r) / 3000 for r in "abc"] == pytest.approx([0.7, 0.2, 0.1], abs=0.04)
    assert all(p[0] == r for p, r in zip(prompts, routes)) and all(p[1:] == a for p, a in zip(prompts, answers))
    sampler.shares = {"a": 0.0, "b": 1.0, "c": 0.0}
    assert set(sampler.draw(50)[1]) == {"b"}
