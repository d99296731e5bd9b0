"""The built-in world: routes, prompts, verifiers, tokenizer and prompt datasets."""

import json

import pytest

from tasks.config import WorldConfig
from tasks.data import build_world, load_prompt_file, load_prompts, route_splits
from tasks.tokenizer import build_char_tokenizer, load_tokenizer, save_tokenizer, tokenizer_fingerprint
from tasks.world import Route, all_routes, check_route, extract_answer, format_prompt, gold_completion, verify


def test_routes_cover_three_domains_at_two_budgets():
    routes = all_routes()
    assert len(routes) == 6
    assert {r.domain for r in routes} == {"shift", "rev", "sort"}
    assert {r.budget for r in routes} == {"low", "high"}
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
