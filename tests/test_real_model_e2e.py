"""The real-model code path in minutes, without the 135M model: the shipped SmolLM2 tokenizer (tests/data/
smollm2-tokenizer: BPE, 49,152 tokens, ChatML template with a default system prompt, pad = eos) on a tiny randomly
initialised Llama of that vocabulary, given as ``base_model`` like a user's local HF folder, with reasoning-gym routes
(the real profile's own spec, cut small) through the whole pipeline: chat-templated prompts, generated and
deduplicated rows, LoRA specialists (adapter saved beside the merged teacher checkpoint), the merge and its table
with retention and gain recovered. The full real profile (`make real`) is the slow run this one stands for."""

import json
from pathlib import Path

import pytest
import torch
import yaml

from tasks.common.paths import PROJECT_ROOT
from tasks.gym import ROUTES

TOKENIZER = PROJECT_ROOT / "tests" / "data" / "smollm2-tokenizer"
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """A user's local HF folder: a 2-layer Llama with the SmolLM2 tokenizer, tied embeddings and 8,192 positions."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    out = tmp_path_factory.mktemp("tiny-smollm2")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def small_routes(tmp_path_factory) -> Path:
    """The real profile's routes.yaml with fewer rows (generation and the solutions writer unchanged)."""
    spec = yaml.safe_load(ROUTES.read_text())
    for route in spec["routes"]:
        route["data"].update(size=60, eval_size=8)
    folder = tmp_path_factory.mktemp("routes")
    # ... and a route of the user's own JSONL beside them (relative to the spec file, as a user writes it).
    words = ["apple", "river", "stone", "cloud", "green", "light", "table", "music"]
    rows = [{"question": f"Repeat the word {a} {b}.", "gold": f"{a} {b}"} for a in words for b in words if a != b]
    (folder / "echo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec["routes"].append({"name": "echo", "labels": {"domain": "words", "budget": "low"},
                           "data": {"source": "echo.jsonl", "prompt_column": "question", "answer_column": "gold",
                                    "completion_column": "gold", "eval_size": 8},
                           "render": {"kind": "chat"}, "generate": {"max_new_tokens": 6}, "verify": {"kind": "exact"}})
    out = folder / "routes.yaml"
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


@pytest.fixture(scope="module")
def real_path(prefect_server, tiny_base, small_routes):
    from flows.pipeline import pipeline
    from tasks.config import pipeline_config

    cfg = pipeline_config("real", spec=str(small_routes), base_model=str(tiny_base), experiment="real-path",
                          min_accuracy=0.0,
                          specialist_train={"steps": 3, "batch_size": 4},
                          opd={"steps": 2, "batch_size": 6, "eval_every": 1000, "checkpoint_every": 0,
                               "cold_start_steps": 1, "gate_threshold": 0.0})
    return cfg, pipeline(cfg)


def test_prompts_are_rendered_with_the_models_chat_template_and_completions_end_at_its_eos(real_path, tiny_base):
    from tasks.specs.prompt_set import load_prompt_set
    from tasks.common.paths import prompt_sets_dir

    _, out = real_path
    (folder,) = [p for p in prompt_sets_dir().iterdir() if (p / "DONE").exists()
                 and load_prompt_set(p).routes == ["arith-answer", "arith-steps", "words-reverse", "echo"]]
    ps = load_prompt_set(folder)
    prompt = ps.rows("eval")["arith-steps"]["prompt"][0]
    assert prompt.startswith("<|im_start|>system\nWork it out step by step") and prompt.endswith(
        "<|im_end|>\n<|im_start|>assistant\n")
    assert "SmolLM" not in prompt  # the route's system prompt replaces the template's default one
    train = ps.rows("train")["arith-steps"]
    assert train["completion"][0].endswith(f"Answer: {train['answer'][0]}")
    assert ps.tokenizer().eos_token == "<|im_end|>"
    # A route without a system prompt gets the chat template's own default one (SmolLM2's), as the model was tuned.
    echo = ps.rows("eval")["echo"]["prompt"][0]
    assert echo.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_lora_specialists_are_registered_as_merged_checkpoints_with_their_adapters(real_path, tiny_base):
    from peft import PeftModel

    from tasks.modeling.models import load_model
    from teachers.registry import TeacherRegistry

    _, out = real_path
    assert sorted(out["teachers"]) == ["spec-arith-answer", "spec-arith-steps", "spec-echo", "spec-words-reverse"]
    rec = TeacherRegistry().get("spec-arith-steps")
    adapter = Path(rec.model_uri) / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["lora_alpha"] == 32 and Path(config["base_model_name_or_path"]) == tiny_base
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # The registered checkpoint is the base with its adapter merged in: the same function as base + adapter.
    ids_B_T = torch.tensor([[1, 504, 3299, 28, 2, 30, 17]])
    teacher = load_model(rec.model_uri).eval()
    with_adapter = PeftModel.from_pretrained(load_model(tiny_base), adapter).eval()
    with torch.no_grad():
        torch.testing.assert_close(teacher(ids_B_T).logits, with_adapter(ids_B_T).logits, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(teacher(ids_B_T).logits, load_model(tiny_base)(ids_B_T).logits)


def test_the_merge_table_has_base_teacher_and_student_accuracy_retention_and_gain_recovered(real_path, capsys):
    from mlflow.tracking import MlflowClient

    from tasks.evaluation.evaluate import gain_recovered, retention
    from tasks.tracking.runs import format_retention_table, tracking_uri

    cfg, out = real_path
    assert [r["route"] for r in out["rows"]] == ["arith-answer", "arith-steps", "words-reverse", "echo"]
    for row in out["rows"]:
        assert row["retention"] == retention(row["student_accuracy"], row["teacher_accuracy"])
        assert row["gain_recovered"] == gain_recovered(row["student_accuracy"], row["teacher_accuracy"],
                                                       row["base_accuracy"])
    table = format_retention_table(out["rows"])
    assert "gain rec." in table.splitlines()[0]
    metrics = MlflowClient(tracking_uri()).get_run(out["run_id"]).data.metrics
    for row in out["rows"]:
        assert metrics[f"retention/{row['route']}"] == pytest.approx(row["retention"])
        if row["gain_recovered"] is not None:
            assert metrics[f"gain_recovered/{row['route']}"] == pytest.approx(row["gain_recovered"])
    assert Path(out["student_uri"], "model.safetensors").is_file()


def test_peft_adapter_merges_of_the_same_specialists_are_reported_beside_the_opd_student(real_path, small_routes):
    from flows.bench.adapter_merges import AdapterMergesConfig, compare

    _, out = real_path
    rows = compare(AdapterMergesConfig(merged=out["student_uri"], spec=str(small_routes),
                                       methods=["task_arithmetic", "ties"]))
    routes = [r["route"] for r in out["rows"]]
    assert [(r["method"], r["route"]) for r in rows] == [(m, r) for m in ("opd", "task_arithmetic", "ties")
                                                         for r in routes]
    opd = {r["route"]: r for r in out["rows"]}
    for row in rows:  # the same base and teacher accuracies the merge measured, on the same prompts
        assert row["teacher_accuracy"] == opd[row["route"]]["teacher_accuracy"]
        assert 0.0 <= row["accuracy"] <= 1.0 and row["retention"] is not None
    assert [r["accuracy"] for r in rows[:len(routes)]] == [opd[r]["student_accuracy"] for r in routes]
    merged = Path(out["student_uri"]).parent.parent / "adapter_merges"
    assert json.loads(next(merged.glob("ties-*")).joinpath("weight_merge.json").read_text())["peft_combination"] == "ties"


def test_a_lora_student_merges_and_is_saved_merged_with_its_adapter(real_path):
    from flows.merge import merge

    cfg, first = real_path
    out = merge(cfg.merge(first["base_uri"], first["teachers"], opd={"steps": 2, "lora_rank": 4, "cold_start_steps": 0},
                          label="lora-student"))
    folder = Path(out["student_uri"])
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert json.loads((folder / "adapter" / "adapter_config.json").read_text())["r"] == 4
    assert [r["route"] for r in out["rows"]] == [r["route"] for r in first["rows"]]


def test_lora_specialists_sharing_their_base_teach_as_their_merged_checkpoints(real_path):
    """opd.teacher_sharing adapters: the four LoRA specialists score and are evaluated on one copy of the base with
    their adapters switched; no merged teacher is loaded, and each teacher's held-out accuracy is the merged one's."""
    from mlflow.tracking import MlflowClient

    from flows.merge import merge
    from tasks.tracking.runs import tracking_uri

    cfg, first = real_path
    out = merge(cfg.merge(first["base_uri"], first["teachers"], opd={"steps": 2, "teacher_sharing": "adapters"},
                          label="shared-base"))
    client = MlflowClient(tracking_uri())
    metrics = client.get_run(out["run_id"]).data.metrics
    assert metrics["teachers/shared"] == 4 and metrics["teachers/loads"] == 0
    # The same config, seed and student as the pipeline's merge: the same rollouts, so the same teacher scores and
    # losses at every step, up to the unmerged adapters' float rounding.
    losses = [[m.value for m in sorted(client.get_metric_history(run, "train/loss"), key=lambda m: m.step)]
              for run in (first["run_id"], out["run_id"])]
    assert len(losses[0]) == 3 and losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert [(r["route"], r["teacher_accuracy"]) for r in out["rows"]] == [
        (r["route"], r["teacher_accuracy"]) for r in first["rows"]]
