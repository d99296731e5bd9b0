"""Teachers that are LoRA adapters of one base, held as one copy of it with every adapter attached
(tasks/modeling/shared_base.py, opd.teacher_sharing adapters): which teachers share, that a teacher scores what its
merged checkpoint scores whichever teacher asked before it, that the shared model is one base plus adapters, and the
refusals (an adapter on the output head, a background generation thread)."""

import json
from pathlib import Path

import pytest
import torch

from tasks.common.paths import PROJECT_ROOT
from teachers.registry import TeacherRecord

TOKENIZER = PROJECT_ROOT / "tests" / "data" / "smollm2-tokenizer"


def record(name: str, uri, **kw) -> TeacherRecord:
    return TeacherRecord(name=name, route=name, model_uri=str(uri), tokenizer_fingerprint="sha256:x", **kw)


def frozen(model):
    return model.requires_grad_(False).eval()


def test_adapters_of_one_base_share_it_and_the_rest_stay_merged_models(lora_experts, tmp_path):
    from tasks.modeling.shared_base import adapter_of, sharing_groups

    base_dir, (a, b) = lora_experts
    assert adapter_of(record("a", a)) == (str(Path(a) / "adapter"), str(base_dir))
    assert adapter_of(record("base", base_dir)) is None  # a full checkpoint: no adapter beside it
    # An adapter folder registered as model_uri shares too, onto the base its record names.
    assert adapter_of(record("c", Path(b) / "adapter", base_model=str(base_dir))) == (str(Path(b) / "adapter"),
                                                                                     str(base_dir))
    groups = sharing_groups({"a": record("a", a), "b": record("b", b), "full": record("full", base_dir),
                             "aligned": record("aligned", a, wrapper="aligned")})
    assert groups == {str(base_dir): {"a": str(Path(a) / "adapter"), "b": str(Path(b) / "adapter")}}
    assert sharing_groups({"a": record("a", a), "full": record("full", base_dir)}) == {}  # one adapter: nothing shared


def test_each_teacher_scores_what_its_merged_checkpoint_scores_whichever_asked_before(lora_experts):
    from tasks.modeling.models import load_model, num_parameters
    from tasks.modeling.rollout import Rollout
    from tasks.modeling.shared_base import SharedBase
    from tasks.modeling.teacher import CheckpointTeacher, TeacherBatch

    base_dir, (a, b) = lora_experts
    shared = SharedBase(str(base_dir), {"a": str(Path(a) / "adapter"), "b": str(Path(b) / "adapter")},
                        lambda: frozen(load_model(base_dir)))
    merged = {"a": frozen(load_model(a)), "b": frozen(load_model(b))}
    ids_B_T = torch.tensor([[2, 504, 3299, 28, 2, 30, 17], [0, 0, 1, 504, 33, 90, 17]])
    mask_B_T = (ids_B_T != 0).long()
    rollout = Rollout(ids_B_T, mask_B_T, torch.zeros_like(mask_B_T), torch.zeros(2, dtype=torch.bool), 3)
    batch = TeacherBatch(rollout, [0, 1])

    def logits(models, name):
        score = CheckpointTeacher(name, models).score(batch)
        return score.head(score.features_b_T_F)

    for name in ("a", "b", "a", "b"):  # switching back and forth: each time its own adapter
        torch.testing.assert_close(logits(shared, name), logits(merged, name), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(logits(shared, "a"), logits(shared, "b"), atol=1e-3)  # two teachers, not one twice
    assert shared.loads == 1 and shared["a"] is shared["b"]  # one model...
    base_params = num_parameters(load_model(base_dir))
    adapters = num_parameters(shared.model) - base_params
    lora = json.loads((Path(a) / "adapter" / "adapter_config.json").read_text())
    assert lora["r"] == 4 and 0 < adapters < 0.1 * base_params  # ... of one base plus two rank-4 adapters
    assert not any(p.requires_grad for p in shared.model.parameters())


def test_an_adapter_on_the_output_head_is_refused_before_any_score(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tasks.modeling.models import load_model, save_model
    from tasks.modeling.shared_base import SharedBase

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    base_dir = save_model(base, tok, tmp_path / "base")
    folders = {}
    for name in ("x", "y"):
        peft = get_peft_model(load_model(base_dir), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
        peft.save_pretrained(tmp_path / name)
        folders[name] = str(tmp_path / name)
    shared = SharedBase(str(base_dir), folders, lambda: frozen(load_model(base_dir)))
    with pytest.raises(ValueError, match="embeddings or output head"):
        shared["x"]
    with pytest.raises(KeyError, match="no adapter on base"):
        shared["z"]


def test_teacher_sharing_is_refused_with_a_background_generation_thread_or_served_teachers():
    from tasks.config import OPDConfig

    assert OPDConfig(teacher_sharing="adapters").teacher_sharing == "adapters"
    with pytest.raises(ValueError, match="overlap_generation off"):
        OPDConfig(teacher_sharing="adapters", overlap_generation=True)
    with pytest.raises(ValueError, match="teacher_backend 'hf'"):
        OPDConfig(teacher_sharing="adapters", teacher_backend="vllm")
