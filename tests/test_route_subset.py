"""A merge of some of a spec's routes (``MergeConfig.routes``; the pipeline sets it with ``--below_min_accuracy skip``):
the prompt set seen through those routes only, and a route the spec lacks refused before any model work."""

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

def test_a_prompt_set_restricted_to_some_routes_shows_only_them_and_refuses_an_unknown_one(tmp_path):
    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set

    folder = build_prompt_set(DATA / "user_spec" / "routes.yaml", str(DATA / "smollm2-tokenizer"),
                              root=tmp_path)
    every = load_prompt_set(folder)
    assert every.routes == ["reverse", "reverse-think", "letters"]
    some = load_prompt_set(folder, ["letters", "reverse"])
    assert some.routes == ["reverse", "letters"]  # in spec order
    assert list(some.eval_sets()) == ["reverse", "letters"] and list(some.caps()) == ["reverse", "letters"]
    assert some.eval_sets()["letters"] == every.eval_sets()["letters"]
    with pytest.raises(KeyError, match=r"no route\(s\) \['sort'\]"):
        load_prompt_set(folder, ["reverse", "sort"])
