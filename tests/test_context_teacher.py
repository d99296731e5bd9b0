"""A teacher with privileged context (registry ``wrapper: context``, tasks/modeling/aligned.py ``ContextTeacher``):
it reads each row with the row's context column written into its user turn; the student never sees it. Unit tests
of what each side reads (the rendering, the teacher's exact scores against a brute-force forward of its own input),
the record and spec rules, and the preflight refusals; the end-to-end merge is test_context_merge_e2e.py."""

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from tests.tiny import tiny_llama

DATA = Path(__file__).parent / "data"
MESSAGES = [{"role": "system", "content": "Answer with the final answer only."},
            {"role": "user", "content": "What is 17 + 25?"}]
CONTEXT = "17 + 25 = 42"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DATA / "smollm2-tokenizer")


def test_the_context_goes_into_the_teachers_user_turn_and_never_into_the_students(tok):
    from tasks.specs.render import RowText
    from tasks.specs.spec import CONTEXT_TEMPLATE

    student_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    row = RowText.of("arith", student_prompt, MESSAGES, CONTEXT)
    assert CONTEXT not in row.render(tok) and row.render(tok) == student_prompt  # the student's input
    teacher = row.with_context()
    chat = teacher.chat
    assert chat[0] == MESSAGES[0]  # the system prompt untouched
    assert chat[1]["content"] == CONTEXT_TEMPLATE.format(context=CONTEXT, prompt="What is 17 + 25?")
    assert CONTEXT in teacher.render(tok) and teacher.prompt == student_prompt
    mine = row.with_context("Hint: {context}\n{prompt}")
    assert mine.chat[1]["content"] == "Hint: 17 + 25 = 42\nWhat is 17 + 25?"
    plain = RowText("fmt", "Q: 17 + 25?\nA:", None, CONTEXT).with_context("{context}\n{prompt}")
    assert plain.render(tok) == "17 + 25 = 42\nQ: 17 + 25?\nA:"  # a format route: around the prompt text
    with pytest.raises(ValueError, match="no context"):
        RowText.of("arith", student_prompt, MESSAGES, "  ").with_context()
    with pytest.raises(ValueError, match=r"expected exactly \{context\} and \{prompt\}"):
        row.with_context("{prompt} only")


@pytest.fixture(scope="module")
def scored(tok):
    from tasks.modeling.aligned import AlignedTeacher, ContextTeacher
    from tasks.modeling.rollout import rollout_from_responses
    from tasks.modeling.teacher import TeacherBatch
    from tasks.specs.render import RowText

    model = tiny_llama(tok, 1, 512).eval()
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    texts = [RowText.of("arith", prompt, MESSAGES, CONTEXT)] * 2
    responses = [tok(" 42", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                 tok("The answer is 40", add_special_tokens=False)["input_ids"]]  # the second cut at its cap
    rollout = rollout_from_responses(tok, [prompt] * 2, responses)
    batch = TeacherBatch(rollout, [0, 1], -1, tok, texts)
    with_context = ContextTeacher("ctx", {"ctx": model}, tok, tok).score(batch)
    without = AlignedTeacher("ctx", {"ctx": model}, tok, tok).score(batch)
    return model, rollout, responses, with_context, without


def teacher_logps(score, rollout, k: int, n: int):
    P = rollout.prompt_width
    with torch.no_grad():
        return F.log_softmax(score.head(score.features_b_T_F[k]).float(), -1)[P - 1:P - 1 + n]


def test_the_teacher_scores_the_students_exact_tokens_after_its_own_context_prompt(tok, scored):
    """Brute force: the teacher's forward over (its prompt with the context, the student's response ids, its end of
    turn), the full distribution at every response position; the student's EOS maps onto <|im_end|>."""
    from tasks.specs.render import RowText

    model, rollout, responses, score, _ = scored
    own = RowText.of("arith", "", MESSAGES, CONTEXT).with_context().render(tok)
    assert CONTEXT in own
    prompt_ids = tok(own, add_special_tokens=False)["input_ids"]
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    for k, resp in enumerate(responses):
        ended = resp[-1] == tok.eos_token_id
        ids = prompt_ids + (resp[:-1] + [stop] if ended else resp)
        with torch.no_grad():
            ref = F.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)[len(prompt_ids) - 1:len(ids) - 1]
        got = teacher_logps(score, rollout, k, len(resp))
        body = len(resp) - int(ended)
        assert torch.allclose(got[:body], ref[:body], atol=1e-4)  # every token read with its full distribution
        if ended:  # the student's EOS: the teacher's own end of turn
            assert float(got[body, tok.eos_token_id]) == pytest.approx(float(ref[body, stop]), abs=1e-4)
        P = rollout.prompt_width
        assert score.signal_b_T[k, P - 1:P - 1 + len(resp)].tolist() == [1] * len(resp)
        assert score.signal_b_T[k, :P - 1].sum() == 0
        assert score.tokens == sum(len(prompt_ids) + len(r) for r in responses)


def test_the_context_changes_what_the_teacher_says(tok, scored):
    _, rollout, responses, with_context, without = scored
    a = teacher_logps(with_context, rollout, 0, len(responses[0]))
    b = teacher_logps(without, rollout, 0, len(responses[0]))
    assert (a - b).abs().max() > 1e-3  # the same model, the same response: only its prompt differs


def test_a_context_teachers_answers_and_samples_read_the_context(tok):
    from tasks.modeling.aligned import ContextTeacher
    from tasks.modeling.rollout import generate
    from tasks.specs.render import RowText

    model = tiny_llama(tok, 2, 512).eval()
    teacher = ContextTeacher("ctx", {"ctx": model}, tok, tok)
    student_prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    rows = [RowText.of("arith", student_prompt, MESSAGES, CONTEXT)]
    own = teacher.own_prompt(rows[0])
    assert CONTEXT in own and CONTEXT not in student_prompt
    texts, _, _ = teacher.answer(rows, 6)
    direct = generate(model, tok, [own], 6, greedy=True)
    expected = tok.decode(direct.sequences_B_T[0, direct.prompt_width:], skip_special_tokens=True)
    assert texts[0] == expected  # its held-out answers are from the prompt with the context
    rollout = teacher.sample(tok, rows, [6], 1.0, torch.Generator().manual_seed(0))
    P = rollout.prompt_width
    assert tok.decode(rollout.sequences_B_T[0, :P][rollout.attention_mask_B_T[0, :P].bool()]) == student_prompt


def test_a_context_template_must_name_context_and_prompt_and_belongs_to_a_context_teacher():
    from pydantic import ValidationError

    from teachers.registry import TeacherRecord

    common = dict(name="ctx", route="arith-answer", model_uri="/m", tokenizer_fingerprint="sha256:x")
    assert TeacherRecord(**common, wrapper="context").context_template == ""
    assert TeacherRecord(**common, wrapper="context", context_template="{context} {prompt}").wrapper == "context"
    with pytest.raises(ValidationError, match=r"expected exactly \{context\} and \{prompt\}"):
        TeacherRecord(**common, wrapper="context", context_template="{prompt}")
    with pytest.raises(ValidationError, match="context_template is for a context teacher"):
        TeacherRecord(**common, wrapper="plain", context_template="{context} {prompt}")
    with pytest.raises(ValidationError, match="reads its own text through its checkpoint"):
        TeacherRecord(**common, wrapper="context", transport="engine")


def test_a_context_teacher_registers_with_the_students_tokenizer(tmp_path, tok):
    from teachers.registry import TeacherRegistry

    folder = tmp_path / "teacher"
    tiny_llama(tok, 3, 512).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    reg = TeacherRegistry(tmp_path / "registry.json")
    rec = reg.register_checkpoint("ctx", "arith-answer", folder, tok, wrapper="context", messages=MESSAGES,
                                  context_template="Hint: {context}\n{prompt}")
    again = TeacherRegistry(tmp_path / "registry.json").get("ctx")
    assert (again.wrapper, again.context_template) == ("context", "Hint: {context}\n{prompt}") and again == rec


def spec_with_context(root: Path, context: dict, template: str = "") -> Path:
    rows = [{"question": f"What is {a} + {b}?", "gold": str(a + b), "steps": f"{a} + {b} = {a + b}"}
            for a in range(6) for b in range(6)]
    (root / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "sums.py").write_text("def steps(row):\n    return 'worked: ' + row['steps']\n")
    render = {"kind": "format", "template": template} if template else {"kind": "chat"}
    spec = {"routes": [{"name": "sums-low", "render": render, "generate": {"max_new_tokens": 4},
                        "data": {"source": "sums.jsonl", "prompt_column": "question", "answer_column": "gold",
                                 "eval_size": 6, **context}}]}
    (root / "routes.yaml").write_text(yaml.safe_dump(spec))
    return root / "routes.yaml"


def test_a_spec_gives_context_by_column_or_by_function_not_both(tmp_path):
    from tasks.specs.spec import load_route_rows, read_spec

    spec = read_spec(str(spec_with_context(tmp_path, {"context_function": "sums:steps"})))
    rows = load_route_rows(spec.route("sums-low"), spec)
    assert rows["train"][0]["context"].startswith("worked: ") and all(rows["eval"]["context"])
    spec = read_spec(str(spec_with_context(tmp_path, {"context_column": "steps"})))
    assert load_route_rows(spec.route("sums-low"), spec)["eval"][0]["context"].count("=") == 1
    with pytest.raises(Exception, match="context_column or context_function, not both"):
        read_spec(str(spec_with_context(tmp_path, {"context_column": "steps", "context_function": "sums:steps"})))


@pytest.mark.parametrize("context, template, expected", [
    ({}, "", r"30 training / 6 held-out row\(s\) have none"),
    ({"context_column": "steps"}, "{context} {prompt} =", r"render.template.*writes \{context\} into the student"),
    ({"context_column": "steps"}, "", None),
])
def test_preflight_refuses_a_context_teacher_on_a_route_without_context_or_one_that_shows_it(
        tmp_path, tok, context, template, expected):
    from tasks.preflight import context_problems
    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set
    from teachers.registry import TeacherRecord

    tok.save_pretrained(tmp_path / "tok")
    ps = load_prompt_set(build_prompt_set(spec_with_context(tmp_path, context, template), str(tmp_path / "tok")))
    rec = TeacherRecord(name="ctx", route="sums-low", model_uri="/m", tokenizer_fingerprint="x", wrapper="context")
    problems = context_problems(ps, rec, "registry.json")
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and re.search(expected, f"{problems[0].field}: {problems[0].message}")
    plain = rec.model_copy(update={"wrapper": "plain"})
    assert context_problems(ps, plain, "registry.json") == []  # only a context teacher reads it
