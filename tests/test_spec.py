"""The route spec (tasks/specs/spec.py) and its verifiers (tasks/specs/verifiers.py): a user's file is read, validated with errors
naming the file, route and field, and each route's rows split into train and held-out prompts that never overlap."""

import json
import sys
import textwrap

import pytest

from tasks.specs import verifiers
from tasks.preflight import InputError
from tasks.specs.spec import VerifySpec, load_route_rows, load_spec, parse_spec


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def spec_file(tmp_path, body: str):
    path = tmp_path / "routes.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def problems(exc_info) -> list[str]:
    return [f"{p.field}: {p.message}" for p in exc_info.value.problems]


def test_a_user_spec_reads_with_defaults_and_resolves_data_next_to_it(tmp_path):
    write_jsonl(tmp_path / "add.jsonl", [{"q": f"{i}+{i}=?", "a": str(2 * i)} for i in range(40)])
    path = spec_file(tmp_path, """
        version: 1
        routes:
          - name: add-think
            labels: {domain: math, budget: high}
            data: {source: add.jsonl, prompt_column: q, answer_column: a, eval_size: 8, seed: 3}
            render: {kind: chat, system: think}
            generate: {max_new_tokens: 64, stop: ["\\n\\n"]}
            verify: {kind: numeric}
          - name: add-fast
            labels: {domain: math, budget: low}
            data: {source: add.jsonl, prompt_column: q, answer_column: a}
    """)
    spec = load_spec(path)
    assert [r.name for r in spec.routes] == ["add-think", "add-fast"]
    fast = spec.route("add-fast")
    assert fast.labels == {"domain": "math", "budget": "low"} and fast.teacher == "newest"
    assert (fast.render.kind, fast.generate.max_new_tokens, fast.verify.kind) == ("chat", 256, "exact")
    think = load_route_rows(spec.route("add-think"), spec)
    assert (len(think["train"]), len(think["eval"])) == (32, 8)
    assert think["train"].column_names == ["prompt", "answer", "system", "context", "completion"]
    assert not set(think["train"]["prompt"]) & set(think["eval"]["prompt"])
    # Each row keeps its own answer and the route's system prompt column stays empty (the route's system is applied
    # when rendering, not copied into the rows).
    for part in ("train", "eval"):
        for prompt, answer in zip(think[part]["prompt"], think[part]["answer"]):
            assert answer == str(2 * int(prompt.split("+")[0])), (prompt, answer)
        assert set(think[part]["system"]) == set(think[part]["context"]) == set(think[part]["completion"]) == {""}
    # The draw is the seed's: the same rows every time, other rows for another seed.
    again = load_route_rows(spec.route("add-think"), spec)
    assert again["eval"]["prompt"] == think["eval"]["prompt"]
    fast_rows = load_route_rows(fast, spec)
    assert (len(fast_rows["train"]), len(fast_rows["eval"])) == (36, 4)  # 10% of 40
    assert fast_rows["eval"]["prompt"] != think["eval"]["prompt"][:4]


def test_every_problem_names_the_file_the_route_and_the_field(tmp_path):
    path = spec_file(tmp_path, """
        routes:
          - name: gsm
            data: {source: g.jsonl, eval_fraction: 1.5}
            render: {kind: format, template: "Q: {question}"}
            verify: {kind: regex}
          - name: gsm
            data: {source: g.jsonl}
            generate: {max_new_tokens: 0}
          - name: "bad/name"
            data: {}
    """)
    with pytest.raises(InputError) as info:
        load_spec(path)
    found = problems(info)
    assert all(p.file == str(path) for p in info.value.problems)
    assert any(f.startswith("routes[gsm].data.eval_fraction: ") and "less than 1" in f for f in found), found
    assert any(f.startswith("routes[gsm].render: ") and "{question}" in f for f in found), found
    assert any(f.startswith("routes[gsm].verify: ") and "needs a pattern" in f for f in found), found
    assert any(f.startswith("routes[gsm].generate.max_new_tokens: ") for f in found), found
    assert any(f.startswith("routes[bad/name].name: ") for f in found), found
    assert any(f.startswith("routes[bad/name].data.source: ") and "required" in f for f in found), found
    assert "https://errors.pydantic.dev" not in str(info.value)


def test_duplicate_names_unknown_fields_and_unreadable_files(tmp_path):
    with pytest.raises(InputError) as info:
        parse_spec({"routes": [{"name": "a", "data": {"source": "x"}}, {"name": "a", "data": {"source": "y"}}]})
    assert "appear more than once" in str(info.value)
    with pytest.raises(InputError) as info:
        parse_spec({"routes": [{"name": "a", "data": {"source": "x"}, "temperature": 1}]})
    assert problems(info) == ["routes[a].temperature: Extra inputs are not permitted (got 1)"]
    with pytest.raises(InputError, match="no such file"):
        load_spec(tmp_path / "missing.yaml")
    (tmp_path / "broken.yaml").write_text("routes: [name: a\n")
    with pytest.raises(InputError, match="does not parse"):
        load_spec(tmp_path / "broken.yaml")
    with pytest.raises(InputError, match="expected a mapping"):
        parse_spec(["a"])


def test_data_problems_are_refused_before_any_training(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p1", "answer": "1"}, {"prompt": "", "answer": "2"}])
    spec = parse_spec({"routes": [
        {"name": "cols", "data": {"source": "d.jsonl", "answer_column": "solution", "system_column": "sys"}},
        {"name": "empty", "data": {"source": "d.jsonl"}},
        {"name": "gone", "data": {"source": "nothere.jsonl"}},
        {"name": "one", "data": {"source": "one.jsonl"}},
    ]}, str(tmp_path / "s.yaml"))
    with pytest.raises(InputError) as info:
        load_route_rows(spec.route("cols"), spec)
    assert problems(info) == [
        "routes[cols].data.answer_column: column 'solution' is not in d.jsonl (columns: ['answer', 'prompt'])",
        "routes[cols].data.system_column: column 'sys' is not in d.jsonl (columns: ['answer', 'prompt'])"]
    with pytest.raises(InputError) as info:
        load_route_rows(spec.route("empty"), spec)
    assert problems(info) == ["routes[empty].data.prompt_column: row 2: empty prompt"]
    with pytest.raises(InputError, match="nothere.jsonl: no such file or folder"):
        load_route_rows(spec.route("gone"), spec)
    write_jsonl(tmp_path / "one.jsonl", [{"prompt": "same", "answer": "1"}, {"prompt": "same", "answer": "1"}])
    with pytest.raises(InputError, match="expected at least one of each"):
        load_route_rows(spec.route("one"), spec)


def test_a_split_column_is_obeyed_and_overlapping_splits_are_refused(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i), "split": "test" if i % 4 == 0 else "train"} for i in range(12)]
    write_jsonl(tmp_path / "s.jsonl", rows)
    spec = parse_spec({"routes": [{"name": "s", "data": {"source": "s.jsonl", "split_column": "split"}}]},
                      str(tmp_path / "spec.json"))
    out = load_route_rows(spec.routes[0], spec)
    assert out["eval"]["prompt"] == ["p0", "p4", "p8"] and len(out["train"]) == 9
    write_jsonl(tmp_path / "s.jsonl", rows + [{"prompt": "p4", "answer": "4", "split": "train"},
                                             {"prompt": "p5", "answer": "5", "split": "dev?"}])
    with pytest.raises(InputError) as info:
        load_route_rows(spec.routes[0], spec)
    assert problems(info) == ["routes[s].data.split_column: row 14: 'dev?'; expected one of ['train', 'training'] "
                              "or ['eval', 'held-out', 'held_out', 'heldout', 'test', 'validation']"]
    write_jsonl(tmp_path / "s.jsonl", rows + [{"prompt": "p4", "answer": "4", "split": "train"}])
    # (p4, no system) appears twice, once held out and once for training: the data contradicts itself and the
    # prompt would leak, so it is refused (a repeat with the same split is only dropped) ...
    with pytest.raises(InputError) as info:
        load_route_rows(spec.routes[0], spec)
    assert "1 prompt(s) are in both the train and the held-out rows (e.g. ['p4'])" in problems(info)[0]
    write_jsonl(tmp_path / "s.jsonl", rows + [{"prompt": "p4", "answer": "4", "split": "eval"}])
    assert load_route_rows(spec.routes[0], spec)["eval"]["prompt"] == ["p0", "p4", "p8"]
    write_jsonl(tmp_path / "s.jsonl", [{**r, "sys": "a"} for r in rows] + [{"prompt": "p4", "answer": "4",
                                                                             "split": "train", "sys": "b"}])
    spec2 = parse_spec({"routes": [{"name": "s", "data": {"source": "s.jsonl", "split_column": "split",
                                                           "system_column": "sys"}}]}, str(tmp_path / "spec.json"))
    # ... but the same prompt under another system prompt in the other split is.
    with pytest.raises(InputError, match=r"1 prompt\(s\) are in both the train and the held-out rows"):
        load_route_rows(spec2.routes[0], spec2)


def test_csv_parquet_and_save_to_disk_sources(tmp_path):
    from datasets import Dataset, DatasetDict

    table = {"prompt": [f"p{i}" for i in range(20)], "answer": [str(i) for i in range(20)]}
    Dataset.from_dict(table).to_csv(str(tmp_path / "d.csv"))
    Dataset.from_dict(table).to_parquet(str(tmp_path / "d.parquet"))
    DatasetDict(train=Dataset.from_dict({k: v[:15] for k, v in table.items()}),
                test=Dataset.from_dict({k: v[15:] for k, v in table.items()})).save_to_disk(str(tmp_path / "dd"))
    spec = parse_spec({"routes": [
        {"name": "csv", "data": {"source": "d.csv"}},
        {"name": "pq", "data": {"source": "d.parquet", "eval_size": 5}},
        {"name": "disk", "data": {"source": "dd", "split_column": "__split__"}},
    ]}, str(tmp_path / "s.yaml"))
    assert len(load_route_rows(spec.route("csv"), spec)["eval"]) == 2
    assert len(load_route_rows(spec.route("pq"), spec)["eval"]) == 5
    disk = load_route_rows(spec.route("disk"), spec)
    assert disk["eval"]["prompt"] == ["p15", "p16", "p17", "p18", "p19"] and len(disk["train"]) == 15


# ------------------------------------------------------------------------------------------------------ verifiers


def test_exact_numeric_and_regex_verifiers():
    row = {}
    v = VerifySpec(kind="exact", answer_after="|").build()
    assert v("3|cba", "cba", row) == 1.0 and v("cba", "cba", row) == 1.0 and v("3|cb", "cba", row) == 0.0
    assert VerifySpec(kind="exact", case_sensitive=False).build()(" ABC ", "abc", row) == 1.0
    assert VerifySpec(kind="exact").build()("ABC", "abc", row) == 0.0
    n = VerifySpec(kind="numeric", answer_after="####", tolerance=0.01).build()
    assert n("so 12 apples #### 1,234.004", "1234", row) == 1.0
    assert n("#### 1234.02", "1234", row) == 0.0 and n("#### twelve", "12", row) == 0.0
    assert n("#### nan", "12", row) == 0.0 and n("#### 12", "n/a", row) == 0.0
    rel = VerifySpec(kind="numeric", tolerance=0.0, rel_tolerance=0.01).build()
    assert rel("1005", "1000", row) == 1.0 and rel("1011", "1000", row) == 0.0
    r = VerifySpec(kind="regex", pattern=r"answer is (\w+)").build()
    assert r("the answer is 4, no, the answer is 5", "5", row) == 1.0  # the last match counts
    assert r("the answer is 4", "5", row) == 0.0 and r("no idea", "5", row) == 0.0
    named = VerifySpec(kind="regex", pattern=r"=(?P<ans>-?\d+)", group="ans").build()
    assert named("2+2=4", "4", row) == 1.0
    for bad, message in (({"pattern": "("}, "does not compile"), ({"pattern": "(a)", "group": 2}, "has 1 group"),
                         ({"pattern": "(a)", "group": "x"}, "no group named")):
        with pytest.raises(verifiers.VerifierError, match=message):
            VerifySpec(kind="regex", **bad).build()


def test_math_verifier_compares_expressions_not_strings():
    m = VerifySpec(kind="math").build()
    assert m("The answer is $\\frac{1}{2}$", "$0.5$", {}) == 1.0
    assert m("The answer is $\\frac{1}{3}$", "$0.5$", {}) == 0.0


def test_a_users_function_verifier_is_imported_called_and_checked(tmp_path, monkeypatch):
    (tmp_path / "my_checks.py").write_text(textwrap.dedent("""
        def is_right(completion, reference, row):
            return completion.strip().endswith(reference) and row.get("ok", True)

        def partial(completion, reference, row):
            return 0.5

        def broken(completion, reference, row):
            return "yes"

        not_callable = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_checks", raising=False)
    v = VerifySpec(kind="function", function="my_checks:is_right").build()
    assert v("so it is 42", "42", {}) == 1.0 and v("42", "42", {"ok": False}) == 0.0
    assert VerifySpec(kind="function", function="my_checks:partial").build()("x", "y", {}) == 0.5
    with pytest.raises(verifiers.VerifierError, match="returned 'yes'; expected a bool or a number"):
        VerifySpec(kind="function", function="my_checks:broken").build()("x", "y", {})
    for target, message in (("my_checks:not_callable", "no callable"), ("no_such_module_x:f", "does not import"),
                            ("os.system('x')", "expected 'module:function'"), ("my_checks", "expected")):
        with pytest.raises(verifiers.VerifierError, match=message):
            verifiers.function(target)
    with pytest.raises(InputError, match="needs function"):
        parse_spec({"routes": [{"name": "a", "data": {"source": "x"}, "verify": {"kind": "function"}}]})
