"""An aligned teacher of another tokenizer merged on-policy beside a same-tokenizer teacher, in seconds: a tiny random
Llama on the shipped SmolLM2 tokenizer as the student, and, on route ``greet``, a tiny Llama on
tests/data/other-tokenizer (SentencePiece-style, its own Gemma-like chat template and end-of-turn token) taught, in
its own template, to answer ``hello``; route ``echo`` has a plain teacher of the student's tokenizer. Through
registration (the plain registration of the other-tokenizer teacher refused with its hint), preflight, the merge
flow (the on-policy stage only: no cold start, so everything the student learns on ``greet`` comes from the aligned
teacher's scores of its own samples) and its evaluation: the teacher's accuracy measured in its own template, the
student's rising from the base's, the aligned fraction logged per route."""

import json
from pathlib import Path

import pytest
import yaml

from tasks.common.paths import PROJECT_ROOT
from tests.tiny import tiny_llama

DATA = PROJECT_ROOT / "tests" / "data"
pytestmark = pytest.mark.e2e
WORDS = ["apple", "river", "stone", "cloud", "green", "light", "table", "music"]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The student's base, the spec (two chat routes of the user's JSONL), and the other family's teacher trained on
    ``greet`` in its own template."""
    from transformers import AutoTokenizer

    from tasks.config import TrainConfig
    from tasks.specs.render import messages
    from tasks.specs.spec import read_spec
    from tasks.training.sft import train_sft

    root = tmp_path_factory.mktemp("aligned")
    student_tok = AutoTokenizer.from_pretrained(DATA / "smollm2-tokenizer")
    base = root / "student"
    tiny_llama(student_tok, 0).save_pretrained(base)
    student_tok.save_pretrained(base)

    greet = [{"question": f"Greet the {a} {b}.", "gold": "hello"} for a in WORDS for b in WORDS if a != b]
    echo = [{"question": f"Repeat the word {a}, not {b}.", "gold": a} for a in WORDS for b in WORDS if a != b]
    for name, rows in (("greet", greet), ("echo", echo)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    route = {"labels": {"domain": "words", "budget": "low"}, "render": {"kind": "chat", "system": "Be brief."},
             "generate": {"max_new_tokens": 4}, "verify": {"kind": "exact"}}
    spec = {"routes": [{"name": name, **route, "data": {"source": f"{name}.jsonl", "prompt_column": "question",
                                                        "answer_column": "gold", "completion_column": "gold",
                                                        "eval_size": 8}} for name in ("greet", "echo")]}
    spec_file = root / "routes.yaml"
    spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))

    other_tok = AutoTokenizer.from_pretrained(DATA / "other-tokenizer")
    teacher = tiny_llama(other_tok, 1)
    spec_route = read_spec(str(spec_file)).route("greet")
    prompts = [other_tok.apply_chat_template(messages(spec_route, {"prompt": r["question"]}), tokenize=False,
                                             add_generation_prompt=True) for r in greet]
    # Its own end of turn after the answer, as its template writes an assistant turn.
    train_sft(teacher, other_tok, prompts, ["hello<end_of_turn>"] * len(prompts),
              TrainConfig(steps=60, batch_size=16, lr=1e-2, warmup_steps=5), desc="other-family teacher")
    other = root / "other-teacher"
    teacher.save_pretrained(other)
    other_tok.save_pretrained(other)
    return {"root": root, "base": base, "spec": spec_file, "other": other}


@pytest.fixture(scope="module")
def merged(prefect_server, project):
    from flows.merge import merge
    from flows.register import RegisterConfig, register_teacher
    from tasks.config import pipeline_config
    from teachers.registry import IncompatibleTeacher, TeacherRegistry

    registry = TeacherRegistry()
    before = registry.names()
    common = dict(spec=str(project["spec"]), student_tokenizer=str(project["base"]), replace=True, mlflow=False)
    with pytest.raises(IncompatibleTeacher, match="--wrapper aligned") as plain_refusal:
        register_teacher(RegisterConfig(name="other-greet", route="greet", model_uri=str(project["other"]), **common))
    assert registry.names() == before  # nothing written
    register_teacher(RegisterConfig(name="other-greet", route="greet", model_uri=str(project["other"]),
                                    wrapper="aligned", **common))
    register_teacher(RegisterConfig(name="plain-echo", route="echo", model_uri=str(project["base"]), **common))
    cfg = pipeline_config("real", spec=str(project["spec"]), base_model=str(project["base"]),
                          experiment="aligned-merge", min_accuracy=0.0)
    mcfg = cfg.merge(str(project["base"]), ["other-greet", "plain-echo"], opd={
        "steps": 120, "batch_size": 16, "lr": 3e-2, "warmup_steps": 2, "eval_every": 1000, "checkpoint_every": 0,
        "cold_start_steps": 0, "gate_threshold": 0.0, "recovery_prompts": 0,
        # fp32: the real profile's bf16 autocast (since 2671c6f) leaves this 32-wide student at 0.0 on greet at lr
        # 3e-2 (measured 2026-12-06; open finding in issue 31's note), which is not what this test is about.
        "dtype": "fp32"})
    return str(plain_refusal.value), registry.get("other-greet"), merge(mcfg)


def test_the_other_family_teacher_registers_only_as_aligned(merged):
    refusal, record, _ = merged
    assert "tokenizer" in refusal
    assert record.wrapper == "aligned", record


def test_the_student_learns_the_aligned_teachers_route_on_policy(merged):
    _, _, out = merged
    rows = {r["route"]: r for r in out["rows"]}
    greet = rows["greet"]
    # The teacher's accuracy is its own greedy answers in its own template and tokens: it learned 'hello'.
    assert greet["teacher_accuracy"] == 1.0
    assert greet["base_accuracy"] == 0.0
    # No cold start: every update on greet came from the aligned teacher's scores of the student's own samples.
    assert greet["student_accuracy"] >= 0.75, greet
    assert greet["gain_recovered"] == pytest.approx(greet["student_accuracy"])


def test_the_aligned_fraction_and_the_teachers_own_tokens_are_logged_per_route(merged):
    from mlflow.tracking import MlflowClient

    from tasks.tracking.runs import tracking_uri

    _, _, out = merged
    client = MlflowClient(tracking_uri())
    metrics = client.get_run(out["run_id"]).data.metrics
    # reverse KL reads distributions: greet's positions get one where the student's context ends on a teacher
    # boundary; the plain teacher reads every response token of echo.
    assert 0.0 < metrics["teacher_signal/greet"] <= 1.0
    assert metrics["teacher_signal/echo"] == 1.0
    history = [m.value for m in client.get_metric_history(out["run_id"], "teacher_signal/greet")]
    assert len(history) == 120 and history[-1] >= 0.9  # 'hello' then the end of turn: both on boundaries
