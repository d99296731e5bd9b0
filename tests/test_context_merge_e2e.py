"""A teacher with privileged context merged on-policy beside a plain teacher, in seconds: a tiny random Llama on the
shipped SmolLM2 tokenizer as the student; on route ``lookup`` ("Which word goes with apple?", answered ``stone``)
a tiny Llama of the same tokenizer taught to answer with the row's context column ("The word is stone.") in its
prompt, registered with ``wrapper: context``; route ``echo`` has a plain teacher. (A model this small does not learn
to read the word out of its context in a test's budget, so the context here is the plumbing's witness;
test_context_teacher.py checks exactly what each side reads.) Scored on the first word the student says (a
``regex`` verifier): that word is what the context teacher taught; when to stop is a separate skill that 120 steps
of a random student learn on some machines and not on others (on 2026-12-07 it answered "stonestonestone..." to its
cap: exact accuracy 0.0, as the base). Through registration, preflight (a context teacher on a route without
context is refused), the merge flow (on-policy only: no cold start, so whatever the student learns on ``lookup``
comes from the context teacher's scores of its own context-free samples) and its evaluation (the teacher's accuracy
is with its context), the signal logged per route."""

import json

import pytest
import yaml

from tasks.common.paths import PROJECT_ROOT
from tests.tiny import tiny_llama

DATA = PROJECT_ROOT / "tests" / "data"
pytestmark = pytest.mark.e2e
WORDS = ["apple", "river", "stone", "cloud", "green", "light", "table", "music"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The student's base, the spec (lookup with a context column, echo without), and the context teacher trained
    on lookup's rows as it reads them: the context in its user turn."""
    from transformers import AutoTokenizer

    from tasks.config import TrainConfig
    from tasks.specs.render import RowText, messages
    from tasks.specs.spec import read_spec
    from tasks.training.sft import train_sft

    root = tmp_path_factory.mktemp("context")
    tok = AutoTokenizer.from_pretrained(DATA / "smollm2-tokenizer")
    base = root / "student"
    tiny_llama(tok, 0).save_pretrained(base)
    tok.save_pretrained(base)

    lookup = [{"question": f"Which word goes with {a}? Not {b}.", "gold": "stone", "hint": "The word is stone."}
              for a in WORDS for b in WORDS if a != b]
    echo = [{"question": f"Repeat the word {a}, not {b}.", "gold": a} for a in WORDS for b in WORDS if a != b]
    for name, rows in (("lookup", lookup), ("echo", echo)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    route = {"labels": {"domain": "words", "budget": "low"}, "render": {"kind": "chat", "system": "Be brief."},
             "generate": {"max_new_tokens": 4}, "verify": {"kind": "regex", "pattern": rf"^\s*({'|'.join(WORDS)})"}}
    data = {"prompt_column": "question", "answer_column": "gold", "completion_column": "gold", "eval_size": 8}
    spec = {"routes": [{"name": "lookup", **route, "data": {"source": "lookup.jsonl", **data, "context_column": "hint"}},
                       {"name": "echo", **route, "data": {"source": "echo.jsonl", **data}}]}
    spec_file = root / "routes.yaml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
    no_context = root / "no-context.yaml"
    spec["routes"][0]["data"].pop("context_column")
    no_context.write_text(yaml.safe_dump(spec, sort_keys=False))

    teacher = tiny_llama(tok, 1)
    spec_route = read_spec(str(spec_file)).route("lookup")
    prompts = [RowText.of("lookup", "", messages(spec_route, {"prompt": r["question"]}), r["hint"]).with_context()
               .render(tok) for r in lookup]
    train_sft(teacher, tok, prompts, [r["gold"] for r in lookup],
              TrainConfig(steps=60, batch_size=16, lr=1e-2, warmup_steps=5), desc="context teacher")
    folder = root / "context-teacher"
    teacher.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {"root": root, "base": base, "spec": spec_file, "no_context": no_context, "teacher": folder}


@pytest.fixture(scope="module")
def merged(prefect_server, project):
    from flows.merge import merge
    from flows.register import RegisterConfig, register_teacher
    from tasks.config import pipeline_config
    from tasks.preflight import InputError
    from teachers.preflight import preflight_merge
    from teachers.registry import TeacherRegistry

    registry = TeacherRegistry()
    common = dict(spec=str(project["spec"]), student_tokenizer=str(project["base"]), replace=True, mlflow=False)
    register_teacher(RegisterConfig(name="ctx-lookup", route="lookup", model_uri=str(project["teacher"]),
                                    wrapper="context", **common))
    register_teacher(RegisterConfig(name="plain-echo", route="echo", model_uri=str(project["base"]), **common))
    opd = {"steps": 120, "batch_size": 16, "lr": 3e-2, "warmup_steps": 2, "eval_every": 1000, "checkpoint_every": 0,
           "cold_start_steps": 0, "gate_threshold": 0.0, "recovery_prompts": 0, "dtype": "fp32"}

    def config(spec):
        cfg = pipeline_config("real", spec=str(spec), base_model=str(project["base"]), experiment="context-merge",
                              min_accuracy=0.0)
        return cfg.merge(str(project["base"]), ["ctx-lookup", "plain-echo"], opd=opd)

    with pytest.raises(InputError) as refused:  # the same teacher on a spec whose lookup rows carry no context
        preflight_merge(config(project["no_context"]), say_warnings=False)
    return str(refused.value), registry.get("ctx-lookup"), merge(config(project["spec"]))


def test_a_context_teacher_on_a_route_without_context_is_refused_before_any_compute(merged):
    refusal, _, _ = merged
    assert "teacher 'ctx-lookup'.wrapper" in refusal and "data.context_column or data.context_function" in refusal


def test_the_student_learns_from_a_teacher_that_reads_what_it_never_sees(merged):
    _, record, out = merged
    assert record.wrapper == "context"
    rows = {r["route"]: r for r in out["rows"]}
    lookup = rows["lookup"]
    assert lookup["teacher_accuracy"] == 1.0  # with its context: the answer is in it
    assert lookup["base_accuracy"] == 0.0
    # No cold start, no context in its prompts: every update came from the context teacher's scores.
    assert lookup["student_accuracy"] >= 0.5, lookup


def test_the_context_teacher_reads_every_response_token(merged):
    from mlflow.tracking import MlflowClient

    from tasks.tracking.runs import tracking_uri

    _, _, out = merged
    metrics = MlflowClient(tracking_uri()).get_run(out["run_id"]).data.metrics
    # The student's own tokenizer: each token is read as sampled, with its full distribution.
    assert metrics["teacher_signal/lookup"] == 1.0
    assert metrics["teacher_signal/echo"] == 1.0
