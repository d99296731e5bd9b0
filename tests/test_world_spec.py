"""The built-in world written as a route spec (tasks/world/spec.py) reads back, through the general spec path, as the
same prompts, splits, gold completions and verdicts as the world itself."""

import random

import pytest

from tasks.config import pipeline_config
from tasks.world.data import build_world, eval_sets, load_prompts, max_new_tokens_for, rows_by_route
from tasks.specs.spec import load_route_rows, load_spec
from tasks.world.tokenizer import build_char_tokenizer
from tasks.world.domains import Route, format_ok, format_pattern, gold_completion, verify
from tasks.world.spec import write_world_spec


@pytest.fixture(scope="module")
def world_and_spec(tmp_path_factory):
    cfg = pipeline_config("quick", world={"train_size": 300, "eval_size": 60, "routes": [
        "rev-low", "rev-high", "sort-low", "shift-high", "count-long"]}).world
    world = build_world(cfg, root=tmp_path_factory.mktemp("worlds"))
    path = write_world_spec(cfg, world)
    return cfg, world, path, load_spec(path)


def test_the_spec_lists_the_world_routes_with_labels_caps_and_its_verifier(world_and_spec):
    cfg, world, path, spec = world_and_spec
    assert [r.name for r in spec.routes] == cfg.routes
    tok = build_char_tokenizer()
    train = rows_by_route(load_prompts(world)["train"])
    for r in spec.routes:
        route = Route.parse(r.name)
        assert r.labels == {"domain": route.domain, "budget": route.budget}
        assert (r.render.kind, r.render.template, r.verify.kind, r.verify.answer_after) == ("format", "{prompt}",
                                                                                             "exact", "|")
        assert r.verify.format == format_pattern(route)
        # One cap for every route, the world's longest training completion + EOS + a margin: the cap the merge has
        # always rolled out and evaluated with, so retention stays comparable (count-long's traces set it).
        assert r.generate.max_new_tokens == max_new_tokens_for(tok, load_prompts(world)["train"]["completion"])
        assert r.generate.max_new_tokens > max_new_tokens_for(tok, list(train[r.name]["completion"])) or \
            r.name == "count-long"
    assert write_world_spec(cfg, world) == path  # written once per world


def test_rows_read_through_the_spec_are_the_world_splits(world_and_spec):
    cfg, world, _, spec = world_and_spec
    held_out = eval_sets(world)
    train = rows_by_route(load_prompts(world)["train"])
    for r in spec.routes:
        rows = load_route_rows(r, spec)
        assert rows["eval"]["prompt"] == list(held_out[r.name][0]), r.name
        assert rows["train"]["prompt"] == list(train[r.name]["prompt"]), r.name
        assert rows["train"]["completion"] == list(train[r.name]["completion"]), r.name
        assert rows["train"]["answer"] == list(train[r.name]["answer"]), r.name


def test_the_spec_verifier_gives_the_world_verdicts(world_and_spec):
    cfg, world, _, spec = world_and_spec
    rng = random.Random(0)
    ev = rows_by_route(load_prompts(world)["eval"])
    checked = right = 0
    for r in spec.routes:
        check = r.verify.build()
        route = Route.parse(r.name)
        d = ev[r.name]
        for problem, answer, gold in zip(d["problem"], d["answer"], d["completion"]):
            variants = [gold, answer, gold + "x", "|" + answer, gold[:-1], answer[::-1], f"junk|{answer}", ""]
            cut = rng.randrange(len(gold) + 1)
            variants.append(gold[:cut] + rng.choice("abc0|") + gold[cut:])
            for text in variants:
                world_says = verify(route, problem, text)
                assert check(text, answer, {}) == float(world_says), (r.name, problem, text)
                checked += 1
                right += world_says
    assert checked > 1000 and 0.2 < right / checked < 0.8  # both verdicts are exercised


def test_the_spec_format_is_the_world_shape_check(world_and_spec):
    """The gate's format rate reads ``verify.format``: on the world it must agree with the world's own shape rule on
    gold completions (all well-formed) and on broken ones."""
    _, world, _, spec = world_and_spec
    ev = rows_by_route(load_prompts(world)["eval"])
    for r in spec.routes:
        route = Route.parse(r.name)
        for problem in ev[r.name]["problem"][:30]:
            gold = gold_completion(route, problem)
            assert r.verify.well_formed(gold), (r.name, gold)
            for text in (gold + "|", "|" + gold, gold.replace("|", ""), "", gold + "A"):
                assert r.verify.well_formed(text) == format_ok(route, text), (r.name, text)
