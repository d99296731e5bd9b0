"""A user's route spec (tests/data/user_spec: JSON Lines prompts with answers, chat-templated prompts, a verifier of
their own) read through the general path, and every kind of bad spec refused before any training, naming the file,
route and field."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.config import pipeline_config
from tasks.common.paths import PROJECT_ROOT, models_dir
from tasks.preflight import InputError
from teachers.preflight import preflight_pipeline
from tasks.specs.prompt_set import build_prompt_set, load_prompt_set, spec_digest

USER_SPEC = PROJECT_ROOT / "tests" / "data" / "user_spec"


@pytest.fixture
def spec_dir(tmp_path) -> Path:
    """A copy of the user spec's folder to break."""
    out = tmp_path / "spec"
    shutil.copytree(USER_SPEC, out, ignore=shutil.ignore_patterns("__pycache__"))
    return out


def edit(folder: Path, change) -> Path:
    """Apply ``change(doc)`` to the copy's routes.yaml; returns its path."""
    path = folder / "routes.yaml"
    doc = yaml.safe_load(path.read_text())
    change(doc)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def refused(spec: Path, **overrides) -> list[str]:
    """The problems the pipeline's preflight lists for ``spec`` (it must refuse it), as ``file: field: message``."""
    before = sorted(models_dir().glob("*")) if models_dir().exists() else []
    with pytest.raises(InputError) as info:
        preflight_pipeline(pipeline_config("quick", spec=str(spec), **overrides), say_warnings=False)
    after = sorted(models_dir().glob("*")) if models_dir().exists() else []
    assert after == before  # refused before any model was created
    return [str(p) for p in info.value.problems]


def test_the_user_spec_builds_a_chat_rendered_prompt_set_with_its_own_verifier(tmp_path):
    ps = load_prompt_set(build_prompt_set(USER_SPEC / "routes.yaml", root=tmp_path))
    assert ps.routes == ["reverse", "reverse-think", "letters"]
    assert ps.labels("reverse-think") == {"domain": "words", "budget": "high"}
    assert ps.spec_sha256 == spec_digest((USER_SPEC / "routes.yaml").read_text())
    tok = ps.tokenizer()
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    rows = ps.rows("train")
    # Rendered through the tokenizer's chat template, with each route's own system prompt (its reasoning budget).
    first = rows["reverse-think"][0]
    assert first["prompt"] == tok.apply_chat_template(
        [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": first["answer"][::-1]}],
        tokenize=False, add_generation_prompt=True)
    assert rows["reverse"][0]["prompt"].startswith("<|im_start|>system\nAnswer.<|im_end|>")
    # The completion column where the spec names one, else the answer.
    assert first["completion"] == ",".join(first["answer"]) + "|" + first["answer"]
    assert rows["reverse"][0]["completion"] == rows["reverse"][0]["answer"]
    # 100 held out per route, never a training prompt; the two routes of one file hold out the same words.
    held = ps.eval_sets()
    for r in ps.routes:
        assert len(held[r][0]) == 100 and not set(held[r][0]) & set(rows[r]["prompt"])
    words = lambda r: {p.split("user\n")[1].split("<|im_end|>")[0] for p in held[r][0]}  # noqa: E731
    assert words("reverse") == words("reverse-think")
    # The user's module:function verifier, imported from the spec's folder.
    count = ps.verifier("letters")
    assert (count("5", "5", {}), count("it has 5 letters", "5", {}), count("4", "5", {}), count("none", "5", {})) \
        == (1.0, 1.0, 0.0, 0.0)
    assert ps.verifier("reverse-think")("c,b,a|cba", "cba", {}) == 1.0
    assert ps.well_formed("reverse-think", "c,b,a|cba") and not ps.well_formed("reverse-think", "cba")
    assert ps.cap("reverse-think") == 22


def test_a_prompt_set_is_built_once_per_spec_text_data_and_tokenizer(tmp_path, spec_dir):
    first = build_prompt_set(spec_dir / "routes.yaml", root=tmp_path)
    assert build_prompt_set(spec_dir / "routes.yaml", root=tmp_path) == first
    with open(spec_dir / "letters.jsonl", "a") as f:  # the data changed, the spec did not
        f.write(json.dumps({"question": "Letters in zzzzzzz?", "answer": "7"}) + "\n")
    assert build_prompt_set(spec_dir / "routes.yaml", root=tmp_path) != first


def test_missing_column(spec_dir):
    spec = edit(spec_dir, lambda d: d["routes"][2]["data"].update(answer_column="count"))
    [problem] = refused(spec)
    assert "routes[letters].data.answer_column" in problem and "column 'count' is not in letters.jsonl" in problem
    assert "'answer', 'question'" in problem  # the columns it does have


def test_overlapping_splits(spec_dir):
    rows = [json.loads(x) for x in (spec_dir / "letters.jsonl").read_text().splitlines()]
    rows = [{**r, "split": "eval" if i < 20 else "train"} for i, r in enumerate(rows)] + [{**rows[0], "split": "train"}]
    (spec_dir / "letters.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = edit(spec_dir, lambda d: d["routes"][2]["data"].update(split_column="split"))
    [problem] = refused(spec)
    assert "routes[letters].data.split_column" in problem and "1 prompt(s) are in both" in problem


def test_unknown_verifier(spec_dir):
    spec = edit(spec_dir, lambda d: d["routes"][2]["verify"].update(function="checks:no_such_check"))
    [problem] = refused(spec)
    assert "routes[letters].verify" in problem and "has no callable 'no_such_check'" in problem
    spec = edit(spec_dir, lambda d: d["routes"][2]["verify"].update(kind="fuzzy"))
    [problem] = refused(spec)
    assert "routes[letters].verify.kind" in problem


def test_a_verifier_that_raises(spec_dir):
    (spec_dir / "checks.py").write_text("def number_in_reply(completion, reference, row):\n    return int(completion)"
                                        " == int(reference) / 0\n")
    [problem] = refused(edit(spec_dir, lambda d: None))
    assert "routes[letters].verify" in problem and "raised on training row 1 (ZeroDivisionError" in problem


def test_a_chat_route_with_a_tokenizer_that_has_no_chat_template(spec_dir):
    from tasks.specs.tokenizer import save_tokenizer
    from tasks.world.tokenizer import build_char_tokenizer

    save_tokenizer(build_char_tokenizer(), spec_dir / "plain-tokenizer")
    problems = refused(edit(spec_dir, lambda d: d.update(tokenizer="plain-tokenizer")))
    assert len(problems) == 3 and all("has none; use render.kind format" in p for p in problems)
    assert [p.split(": ")[1] for p in problems] == [f"routes[{r}].render" for r in ("reverse", "reverse-think",
                                                                                    "letters")]


def test_a_prompt_longer_than_the_context(spec_dir):
    problems = refused(USER_SPEC / "routes.yaml", model={"max_positions": 60})
    assert any("routes[reverse-think].data" in p and "plus max_new_tokens 22 exceeds the model's 60-token context"
               in p for p in problems)
    assert not any("routes[letters]" in p or "routes[reverse]" in p for p in problems)  # <= 54 + 4, <= 42 + 10 fit


@pytest.mark.slow
def test_every_problem_of_a_spec_at_once_and_the_command_line_says_them_without_a_traceback(spec_dir):
    def break_two(d):
        d["routes"][0]["data"]["prompt_column"] = "text"
        d["routes"][2]["verify"]["function"] = "nowhere_module:f"
    spec = edit(spec_dir, break_two)
    out = subprocess.run([sys.executable, "-m", "flows.pipeline", "--profile", "quick", "--spec", str(spec)],
                         capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert any("routes[reverse].data.prompt_column" in e for e in errors)
    assert any("routes[letters].verify" in e and "nowhere_module" in e for e in errors)
    assert "Traceback" not in out.stderr
