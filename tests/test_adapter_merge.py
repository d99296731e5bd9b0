"""LoRA specialists merged by peft's own adapter merging (tasks/merging/weight_merge.merge_adapters), which
merge_checkpoints picks when every expert keeps its adapter: peft's ``cat`` equals our hand-written task arithmetic on
the merged checkpoints, TIES and DARE run through peft, and an adapter of another base is refused."""

import json
from pathlib import Path

import pytest
import torch



def test_peft_cat_of_the_adapters_is_task_arithmetic_of_the_merged_specialists(lora_experts, tmp_path):
    from tasks.merging.weight_merge import merge_checkpoints, task_arithmetic
    from tasks.modeling.models import load_model

    base_dir, experts = lora_experts
    out = merge_checkpoints(base_dir, experts, "task_arithmetic", tmp_path / "ta")
    assert json.loads(Path(out, "weight_merge.json").read_text())["peft_combination"] == "cat"
    base_sd = load_model(base_dir).state_dict()
    by_hand = task_arithmetic(base_sd, [load_model(e).state_dict() for e in experts])
    merged = load_model(out).state_dict()
    assert set(merged) == set(by_hand)
    moved = 0
    for name, t in by_hand.items():
        torch.testing.assert_close(merged[name], t, atol=1e-6, rtol=1e-5)
        moved += not torch.equal(t, base_sd[name])
    assert moved >= 14  # the 7 projections of 2 layers changed: the comparison is not of two copies of the base


@pytest.mark.parametrize("method,combination", [("ties", "ties"), ("dare", "dare_linear")])
def test_ties_and_dare_of_lora_specialists_run_through_peft(lora_experts, tmp_path, method, combination):
    from tasks.merging.weight_merge import merge_checkpoints
    from tasks.modeling.models import load_model

    base_dir, experts = lora_experts
    out = merge_checkpoints(base_dir, experts, method, tmp_path / method, density=0.5)
    record = json.loads(Path(out, "weight_merge.json").read_text())
    assert record["peft_combination"] == combination and record["density"] == 0.5
    base_sd, merged = load_model(base_dir).state_dict(), load_model(out).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], base_sd[q]) and torch.isfinite(merged[q]).all()


def test_an_adapter_of_another_base_is_refused(lora_experts, tmp_path):
    from tasks.merging.weight_merge import merge_adapters

    base_dir, experts = lora_experts
    other = tmp_path / "other-base"
    other.mkdir()
    with pytest.raises(ValueError, match="was trained on"):
        merge_adapters(other, [Path(e) / "adapter" for e in experts], "ties", tmp_path / "x")


def test_an_adapter_folder_registers_passes_the_preflight_and_teaches_as_its_merged_checkpoint(lora_experts, tmp_path):
    """A teacher given as a LoRA adapter (peft's folder, naming its base) rather than a merged checkpoint: registered
    against the base's tokenizer, checked by the merge preflight like any checkpoint, and loaded as base + adapter,
    the same function as the merged specialist saved beside it."""
    import shutil

    from tasks.merging.merge import load_teacher
    from tasks.modeling.models import load_model
    from tasks.preflight import check_checkpoint
    from tasks.specs.tokenizer import load_tokenizer, tokenizer_fingerprint
    from teachers.registry import TeacherRegistry

    base_dir, experts = lora_experts
    adapter = shutil.copytree(Path(experts[0]) / "adapter", tmp_path / "adapter-only")
    for f in adapter.glob("tokenizer*"):  # a user's adapter often ships without the tokenizer: the base's is used
        f.unlink()
    assert not (adapter / "config.json").exists() and (adapter / "adapter_model.safetensors").is_file()
    registry = TeacherRegistry(tmp_path / "registry.json")
    rec = registry.register_checkpoint("adapter-teacher", "arith-answer", adapter, base_dir)
    assert rec.tokenizer_fingerprint == tokenizer_fingerprint(load_tokenizer(base_dir))
    ck = check_checkpoint(str(adapter), "teacher 'adapter-teacher'.model_uri")
    assert ck.problems == [] and ck.config.model_type == "llama"
    teacher = load_teacher(rec, load_tokenizer(base_dir))
    # Merged into its base on loading (one plain forward per score), not carried as LoRA layers beside it.
    assert not [n for n, _ in teacher.named_modules() if "lora" in n]
    ids_B_T = torch.tensor([[1, 504, 3299, 28, 2, 30]])
    with torch.no_grad():
        torch.testing.assert_close(teacher(ids_B_T).logits, load_model(experts[0])(ids_B_T).logits, atol=1e-5,
                                   rtol=1e-4)
        assert not torch.allclose(teacher(ids_B_T).logits, load_model(base_dir)(ids_B_T).logits)
    # An adapter whose config names no base is refused by the preflight, naming the file.
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": None}))
    (problem,) = check_checkpoint(str(adapter), "teacher 'adapter-teacher'.model_uri").problems
    assert problem.file.endswith("adapter_config.json") and "names no base_model_name_or_path" in problem.message


def test_an_adapter_teacher_names_its_base_in_the_registry_and_every_load_checks_it(lora_experts, tmp_path):
    """An adapter saved on another machine names a base path that is not here: registered with ``base_model`` (the
    local copy) it loads onto that base, as the merged specialist; the record keeps the base's fingerprint, and a
    base whose weights changed since is refused at load and by the preflight, before any weight is read. A base
    named for a full checkpoint, or one other than the adapter's own, is refused at registration."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tasks.merging.merge import load_teacher
    from tasks.modeling.models import checkpoint_fingerprint, load_model
    from tasks.preflight import check_checkpoint, teacher_problems
    from tasks.specs.tokenizer import load_tokenizer
    from teachers.registry import IncompatibleTeacher, TeacherRegistry

    base_dir, experts = lora_experts
    base_copy = shutil.copytree(base_dir, tmp_path / "base-copy")
    adapter = shutil.copytree(Path(experts[0]) / "adapter", tmp_path / "adapter-elsewhere")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config,
                                                            "base_model_name_or_path": "/nonexistent/their-base"}))
    registry = TeacherRegistry(tmp_path / "registry.json")
    with pytest.raises(IncompatibleTeacher, match="config does not load"):  # the named base is not here
        registry.register_checkpoint("t", "arith-answer", adapter, base_dir)
    rec = registry.register_checkpoint("t", "arith-answer", adapter, base_dir, base_model=str(base_copy))
    assert rec.base_model == str(base_copy.resolve())
    assert rec.base_fingerprint == checkpoint_fingerprint(base_dir) and rec.base_fingerprint.startswith("sha256:")
    assert registry.get("t").base_model == rec.base_model  # written to the registry file
    assert check_checkpoint(str(adapter), "teacher 't'.model_uri", base=rec.base_model).problems == []
    student_tok = load_tokenizer(base_dir)
    ids_B_T = torch.tensor([[1, 504, 3299, 28, 2, 30]])
    with torch.no_grad():
        torch.testing.assert_close(load_teacher(rec, student_tok)(ids_B_T).logits,
                                   load_model(experts[0])(ids_B_T).logits, atol=1e-5, rtol=1e-4)

    # The base changes in place after registration (re-converted, fine-tuned): refused at load, and by the preflight.
    weights = next(base_copy.glob("*.safetensors"))
    tensors = load_file(weights)
    key = next(k for k in tensors if k.endswith("q_proj.weight"))
    save_file({**tensors, key: tensors[key] + 0.01}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="the base changed since the adapter was registered"):
        load_teacher(rec, student_tok)
    student = check_checkpoint(str(base_dir), "student_uri")
    problems = teacher_problems(rec, student, str(registry.path), None, "")
    assert [p.field for p in problems if "base changed" in p.message] == ["teacher 't'.base_model"]

    # A base named for a full checkpoint; a base other than the one the adapter names (both here, other weights).
    with pytest.raises(IncompatibleTeacher, match="is a full checkpoint"):
        registry.register_checkpoint("full", "arith-answer", experts[1], base_dir, base_model=str(base_dir))
    with pytest.raises(IncompatibleTeacher, match="is not the base the adapter names"):
        registry.register_checkpoint("other", "arith-answer", Path(experts[0]) / "adapter", base_dir,
                                     base_model=str(base_copy))
    assert registry.names() == ["t"]


def test_registration_refuses_stop_tokens_the_student_cannot_produce(lora_experts, tmp_path):
    """The preflight's stop-token check runs at registration too: a teacher whose generation config stops on an id
    past the student's vocabulary is refused, naming the file and the ids, and nothing is written."""
    import shutil

    from teachers.registry import IncompatibleTeacher, TeacherRegistry

    base_dir, experts = lora_experts
    teacher = shutil.copytree(experts[0], tmp_path / "teacher", ignore=shutil.ignore_patterns("adapter"))
    (teacher / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1_000_000]}))
    registry = TeacherRegistry(tmp_path / "registry.json")
    with pytest.raises(IncompatibleTeacher, match=r"generation_config.json: stop token ids \[1000000\]"):
        registry.register_checkpoint("t", "arith-answer", teacher, base_dir)
    assert registry.list() == []
    (teacher / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert registry.register_checkpoint("t", "arith-answer", teacher, base_dir).base_model == ""
