"""The built-in world: routes, prompts, verifiers, tokenizer and prompt datasets."""

import json

import pytest

from tasks.config import WorldConfig
from tasks.world.data import build_world, load_prompt_file, load_prompts, route_splits
from tasks.specs.tokenizer import load_tokenizer, save_tokenizer, tokenizer_fingerprint
from tasks.world.tokenizer import build_char_tokenizer
from tasks.world.domains import (
    DOMAINS,
    STEP_SEP,
    Route,
    all_routes,
    check_route,
    domain_of,
    extract_answer,
    format_ok,
    format_prompt,
    gold_completion,
    sample_problems,
    scratchpad,
    verify,
)


def test_routes_cover_four_domains_at_three_budgets():
    routes = all_routes()
    assert len(routes) == 12
    assert {r.domain for r in routes} == {"shift", "rev", "sort", "count"}
    assert {r.budget for r in routes} == {"low", "high", "long"}
    # The default world keeps its six routes; all twelve by name or as 'all'.
    assert WorldConfig().routes == ["shift-low", "shift-high", "rev-low", "rev-high", "sort-low", "sort-high"]
    assert WorldConfig(routes=["all"]).routes == [r.name for r in routes]
    assert Route.parse("shift-high") == Route("shift", "high")
    with pytest.raises(ValueError, match="domain>-<budget"):
        Route.parse("addhigh")
    with pytest.raises(ValueError, match="unknown budget 'medium'"):
        check_route(Route("shift", "medium"))


@pytest.mark.parametrize(
    "route,problem,right,wrong",
    [
        ("shift-low", "2:abzy", "cdba", "cdbb"),
        ("shift-high", "2:abza", "a>c|cdbc", "a>c|abza"),
        ("rev-low", "abcde", "edcba", "abcde"),
        ("rev-high", "abcde", "5|edcba", "5|edcbb"),
        ("sort-low", "5203", "0235", "0253"),
        ("sort-high", "5203", "0x1,2x1,3x1,5x1|0235", "0x1,2x1,3x1,5x1|5320"),
        ("count-low", "b:abcbbad", "3", "4"),
        ("count-high", "b:abcbbad", "b:bbb|3", "b:bbb|2"),
        ("count-high", "d:abc", "d:|0", "d:|"),
        ("count-long", "b:abcb", "b:abcb>0,b:bcb>0,b:cb>1,b:b>1,b:>2|2", "b:abcb>0,b:bcb>0,b:cb>1,b:b>1,b:>2|1"),
        ("shift-long", "2:abz", "abz>,bz>c,z>cd,>cdb|cdb", "abz>,bz>c,z>cd,>cdb|cdc"),
        ("rev-long", "abc", "abc>,bc>a,c>ba,>cba|cba", "abc>,bc>a,c>ba,>cba|abc"),
        ("sort-long", "5203", "0x1>1,1x0>1,2x1>2,3x1>3,4x0>3,5x1>4,6x0>4,7x0>4,8x0>4,9x0>4|0235",
         "0x1>1,1x0>1,2x1>2,3x1>3,4x0>3,5x1>4,6x0>4,7x0>4,8x0>4,9x0>4|0253"),
    ],
)
def test_verifier_right_and_wrong(route, problem, right, wrong):
    r = Route.parse(route)
    assert gold_completion(r, problem) == right
    assert verify(r, problem, right)
    assert not verify(r, problem, wrong)


def test_verifier_ignores_the_scratchpad():
    r = Route.parse("shift-high")
    assert verify(r, "2:abza", "a>x,nonsense|cdbc")  # wrong working, right answer: correct
    assert not verify(r, "2:abza", "a>c|")  # right working, no answer: wrong
    assert not verify(r, "2:abza", "cdbc|")  # the answer must come after the last separator
    assert extract_answer("a|b|c ") == "c"


def test_prompt_format_carries_the_route_tags():
    assert format_prompt(Route("sort", "high"), "31") == "<bos><sort><high>31="
    assert format_prompt(Route("count", "long"), "b:abcb") == "<bos><count><long>b:abcb="


def _corrupt(step: str) -> str:
    """The step with its last letter or digit changed (the part a later step or the answer reads)."""
    i = max(j for j, c in enumerate(step) if c.isalnum())
    c = step[i]
    new = str((int(c) + 1) % 10) if c.isdigit() else chr((ord(c) - 97 + 1) % 26 + 97)
    return step[:i] + new + step[i + 1:]


@pytest.mark.parametrize("domain", sorted(DOMAINS))
def test_long_trace_is_a_chain_of_40_plus_characters_whose_answer_depends_on_every_step(domain):
    route = Route(domain, "long")
    dom = domain_of(route)
    lo, hi = WorldConfig().lengths(route.name)
    for problem in sample_problems(route, 50, 0, lo, hi):
        steps = dom.steps(problem)
        assert len(scratchpad(route, problem)) >= 40, (problem, steps)
        assert all(dom.step_re.match(s) for s in steps)
        # Each step is computed from the one before (and the problem) alone ...
        assert all(dom.advance(problem, a) == b for a, b in zip(steps, steps[1:]))
        assert dom.advance(problem, steps[-1]) is None
        assert dom.replay(steps) == dom.answer(problem)
        # ... so a wrong step carries into every later one and changes the answer, whichever step it is.
        for k in range(len(steps)):
            wrong = steps[:k] + [_corrupt(steps[k])]
            while len(wrong) < len(steps) and (nxt := dom.advance(problem, wrong[-1])) is not None:
                wrong.append(nxt)
            try:
                assert dom.replay(wrong) != dom.answer(problem), (problem, k, wrong)
            except ValueError:
                pass  # a trace that no longer reads as an answer is just as wrong


def test_long_budget_format_needs_well_formed_steps():
    r = Route.parse("count-long")
    assert format_ok(r, "b:abcb>0,b:bcb>0,b:cb>1,b:b>1,b:>2|2")
    assert format_ok(r, "b:abcb>0,b:bcb>0,b:cb>1,b:b>1,b:>2|7")  # wrong but well-formed
    assert not format_ok(r, "b:abcb>0,b:bcb>0,b:cb>x,b:b>1,b:>2|2")  # a step that is not target:tape>count
    assert not format_ok(r, "2")  # no trace
    assert not format_ok(Route.parse("rev-long"), STEP_SEP.join(["abc", "bc", "c"]) + "|cba")


def test_per_route_lengths_override_the_domain_and_are_validated():
    cfg = WorldConfig(routes=["rev-low", "rev-long"])
    assert cfg.lengths("rev-low") == (2, 6) and cfg.lengths("rev-long") == (5, 6)
    train, ev = route_splits(cfg, Route.parse("rev-long"))
    assert {len(p) for p in train + ev} == {5, 6}
    with pytest.raises(ValueError, match="neither a domain"):
        WorldConfig(min_len={**WorldConfig().min_len, "rev-medium": 3})
    with pytest.raises(ValueError, match="'rev-long': need 1 <= min_len"):
        WorldConfig(routes=["rev-long"], max_len={**WorldConfig().max_len, "rev-long": 3})


def test_tokenizer_round_trip(tmp_path):
    tok = build_char_tokenizer()
    text = "<bos><shift><high>2:abza=a>c|cdbc<eos>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 4 + len("2:abza=a>c|cdbc")  # 3 tags + bos + one token per character
    assert tok.decode(ids) == text
    save_tokenizer(tok, tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)
    assert {"<count>", "<long>"} <= set(tok.all_special_tokens)
    long_text = "<bos><count><long>b:abcb=b:abcb>0,b:bcb>0,b:cb>1,b:b>1,b:>2|2<eos>"
    long_ids = tok(long_text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in long_ids and tok.decode(long_ids) == long_text


def test_world_is_deterministic_cached_and_eval_disjoint(tmp_path):
    cfg = WorldConfig(routes=["shift-low", "rev-high"], train_size=300, eval_size=50)
    path = build_world(cfg, root=tmp_path)
    ds = load_prompts(path)
    assert len(ds["train"]) == 600 and len(ds["eval"]) == 100
    for route in cfg.routes:
        tr = set(ds["train"].filter(lambda x: x["route"] == route)["problem"])
        ev = set(ds["eval"].filter(lambda x: x["route"] == route)["problem"])
        assert len(ev) == 50 and not tr & ev
    assert build_world(cfg, root=tmp_path) == path  # cached
    again = build_world(cfg, root=tmp_path / "other")
    assert load_prompts(again)["train"]["problem"] == ds["train"]["problem"]
    row = ds["train"][0]
    assert row["prompt"] == format_prompt(Route.parse(row["route"]), row["problem"])


def test_user_prompt_file_replaces_generated_prompts(tmp_path):
    f = tmp_path / "mine.jsonl"
    mine = ["1:ab", "2:xyz", "3:hello", "1:zz", "2:q"]
    f.write_text("".join(json.dumps({"problem": p}) + "\n" for p in mine))
    cfg = WorldConfig(routes=["shift-low"], prompt_files={"shift-low": str(f)}, eval_size=1)
    train, ev = route_splits(cfg, Route.parse("shift-low"))
    assert sorted(train + ev) == sorted(mine)
    assert len(ev) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1:ab"}\n{"problem": "hello"}\n')
    with pytest.raises(ValueError, match=r"row 2: problem 'hello' is not a valid 'shift' problem"):
        load_prompt_file(bad, Route.parse("shift-low"))
    with pytest.raises(ValueError, match="not in routes"):
        WorldConfig(routes=["shift-low"], prompt_files={"rev-low": str(f)})


def test_budget_templates_reword_prompts_and_are_validated(tmp_path):
    cfg = WorldConfig(routes=["rev-low", "rev-high"], train_size=20, eval_size=5,
                      budget_templates={"high": "{bos}{domain}{problem}x=", "low": "{bos}{domain}{budget}{problem}="})
    ds = load_prompts(build_world(cfg, root=tmp_path))
    for row in ds["train"]:
        if row["route"] == "rev-high":
            assert row["prompt"] == f"<bos><rev>{row['problem']}x="
        else:
            assert row["prompt"] == f"<bos><rev><low>{row['problem']}="
    ids = build_char_tokenizer()(ds["train"][0]["prompt"], add_special_tokens=False)["input_ids"]
    assert 3 not in ids  # no <unk>: every literal character is in the tokenizer
    for bad, message in [
        ({"mid": "{problem}="}, "unknown budget|names budget"),
        ({"high": "{bos}{domain}="}, "must contain {problem}"),
        ({"high": "{bos}{problem}"}, "must end with"),
        ({"high": "Q: {problem}="}, "not in the tokenizer's charset"),
        ({"high": "{bos}{route}{problem}="}, "unknown field {route}"),
    ]:
        with pytest.raises(ValueError, match=message):
            WorldConfig(routes=["rev-high"], budget_templates=bad)
