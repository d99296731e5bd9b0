"""Real tokenizers and checkpoints, handled right (the shipped SmolLM2 tokenizer: 49,152 tokens, ``<|im_start|>`` = 1,
``<|im_end|>`` = 2, ChatML template with a default system prompt): heads padded past the tokenizer, several stop
tokens, a missing pad token, left padding, the template's default system prompt, a long context, and what the
preflight compares between student and teacher. Tiny random Llamas (hidden 32, 2 layers) over the real vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tasks.common.problems import InputError
from tasks.modeling.engines import ServedHead, pack_prompt_logprobs
from tasks.modeling.models import load_model
from tasks.modeling.rollout import (
    PrivateSampler,
    cap_responses,
    eos_ids,
    generate,
    response_ids,
    response_mask,
    rollout_from_responses,
    token_logprobs,
)
from tasks.modeling.teacher import checkpoint_teachers
from tasks.objectives.losses import Objective
from tasks.preflight import check_checkpoint, first_prompt_messages, teacher_problems
from tasks.specs.render import render_prompts
from tasks.specs.spec import parse_spec
from tasks.specs.tokenizer import RemoteCodeRefused, compatibility_problems, load_tokenizer, tokenizer_fingerprint
from tasks.training.distill import Batch, extrapolate_scores, sample_batch, score_with_teachers, update_step

SMOLLM2 = Path(__file__).parent / "data" / "smollm2-tokenizer"
PAD = 64  # rows a padded head has past the tokenizer
PROMPTS = ["The capital of France is", "2 + 2 = 4, and 3 + 3 =", "Write one word, then stop: the opposite of hot is"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SMOLLM2)


def llama(vocab_size: int, seed: int = 0, eos=2, max_positions: int = 8192) -> LlamaForCausalLM:
    """A tiny random Llama over ``vocab_size`` ids (untied head), stopping on ``eos`` (an id or a list)."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=max_positions,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=eos, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 2
    return model


def padded(model: LlamaForCausalLM, scale: float, seed: int = 7) -> LlamaForCausalLM:
    """``model`` with ``PAD`` extra rows in its embedding and head (``config.vocab_size`` = V + PAD, as checkpoints
    pad to a multiple of 64): the first V rows are copies of ``model``'s, the padding ``scale * randn``."""
    V = model.config.vocab_size
    big = llama(V + PAD, eos=model.generation_config.eos_token_id)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for (name, dst), src in zip(big.state_dict().items(), model.state_dict().values()):
            if dst.shape == src.shape:
                dst.copy_(src)
            else:  # embed_tokens and lm_head: [V + PAD, H]
                dst[:V] = src
                dst[V:] = scale * torch.randn(PAD, dst.shape[1], generator=gen)
    return big


@pytest.fixture(scope="module")
def batch(tok):
    """Two rows of real tokens (prompts, then responses ending in EOS), off-policy."""
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, len(tok), (n,), generator=gen).tolist() + [tok.eos_token_id] for n in (7, 4)]
    rollout = rollout_from_responses(tok, PROMPTS[:2], responses)
    return Batch(rollout, ["r", "r"], ["", ""], False, -1, torch.zeros(2))


def merge_loss(student, teacher, batch, vocab_size, obj=Objective(), reference=None) -> float:
    """The loss of one merge update (:func:`update_step`, the teacher scored as the merge scores it; ExOPD with a
    ``reference``). The learning rate is 0: the loss is the one before the step."""
    hidden = score_with_teachers(checkpoint_teachers({"t": teacher}), {"t": [0, 1]}, batch.rollout)
    if reference is not None:
        hidden = extrapolate_scores(hidden, reference, batch.rollout, 1.5, vocab_size=vocab_size)
    optimizer = torch.optim.SGD(student.parameters(), lr=0.0)
    stats = update_step(student, batch, hidden, {"r": obj}, optimizer, vocab_size=vocab_size)
    assert not stats.skipped
    return stats.loss


# ---------------------------------------------------------------------------------------------- padded vocabulary


@pytest.mark.parametrize("which", ["student", "teacher", "both"])
@pytest.mark.parametrize("obj", [Objective(), Objective(loss="jsd", top_k=8)], ids=["reverse_kl", "jsd_top8"])
def test_a_padded_head_gives_the_loss_of_its_first_len_tok_rows(tok, batch, which, obj):
    # Student and teacher share the tokenizer; either head may be padded (each its own way). The padding is no
    # token: the loss must be that of the models whose heads are the first len(tok) rows, however large the
    # padding's logits (scale 10 here: unsliced, they would take most of the probability).
    V = len(tok)
    student, teacher = llama(V, seed=0), llama(V, seed=1)
    expected = merge_loss(student, teacher, batch, V, obj)
    got = merge_loss(padded(student, 10.0) if which != "teacher" else student,
                     padded(teacher, 10.0, seed=8) if which != "student" else teacher, batch, V, obj)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_a_padded_teacher_without_vocab_size_is_refused_naming_both_widths(tok, batch):
    V = len(tok)
    student, teacher = llama(V, seed=0), padded(llama(V, seed=1), 10.0)
    W = teacher.get_output_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=rf"student's head has {V} outputs and the teacher's {W}.*vocab_size"):
        merge_loss(student, teacher, batch, None)
    assert merge_loss(student, teacher, batch, V) > 0  # with it, the two compare over the tokenizer's ids


@pytest.mark.parametrize("which", ["teacher", "reference"])
def test_extrapolated_teacher_and_reference_heads_are_cut_to_the_tokenizer(tok, batch, which):
    # ExOPD: the teacher's and the reference's log-softmax each run over the real vocabulary, whichever is padded.
    V = len(tok)
    student, teacher, reference = llama(V, 0), llama(V, 1), llama(V, 2)
    expected = merge_loss(student, teacher, batch, V, reference=reference)
    got = merge_loss(student, padded(teacher, 10.0) if which == "teacher" else teacher, batch, V,
                     reference=padded(reference, 10.0, seed=9) if which == "reference" else reference)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_token_logprobs_are_over_the_tokenizer_not_the_padded_head(tok, batch):
    V = len(tok)
    model = llama(V)
    (expected,) = token_logprobs(model, batch.rollout, (1.0,))
    (got,) = token_logprobs(padded(model, 10.0), batch.rollout, (1.0,), vocab_size=V)
    assert torch.allclose(got, expected, atol=1e-5)


def test_sampled_batches_record_logprobs_over_the_tokenizer(tok):
    # The behaviour log-probs of on-policy rollouts (the importance ratio's denominator) are over the ids the
    # rollout could sample: the tokenizer's.
    V = len(tok)
    model = llama(V)
    batch = sample_batch(padded(model, 10.0), tok, PROMPTS, ["r"] * 3, [""] * 3, [5] * 3, 0, with_logprobs=True,
                         verifiers={"r": lambda text, answer, row: 0.0})
    (expected,) = token_logprobs(model, batch.rollout, (1.0,))
    assert torch.allclose(batch.tokens.logq_behaviour_B_T, expected, atol=1e-5)


def test_the_rl_policy_loss_is_over_the_tokenizer(tok, batch):
    from tasks.training.rl import policy_loss

    V = len(tok)
    model = llama(V)
    (old,) = token_logprobs(model, batch.rollout, (1.0,))
    adv_B = torch.tensor([1.0, -0.5])
    with torch.no_grad():
        expected = float(policy_loss(model, batch.rollout, adv_B, old))
        got = float(policy_loss(padded(model, 10.0), batch.rollout, adv_B, old, vocab_size=V))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_served_ids_past_the_tokenizer_are_dropped_when_packed(tok, batch):
    # A served teacher with a padded head returns log-probs of its padding too (the whole vocabulary): packing for
    # the student's V drops them, and the head's distribution is the one without them.
    V = len(tok)
    served = [[None] + [{5: -0.5, 9: -1.5, V + 3: -2.0} for _ in range(len(seq) - 1)]
              for seq in (batch.rollout.sequences_B_T[r][batch.rollout.attention_mask_B_T[r].bool()] for r in (0, 1))]
    without = [[None if d is None else {t: lp for t, lp in d.items() if t < V} for d in seq] for seq in served]
    got = ServedHead(V)(pack_prompt_logprobs(served, batch.rollout, [0, 1], V))
    assert got.shape[-1] == V
    assert torch.equal(got, ServedHead(V)(pack_prompt_logprobs(without, batch.rollout, [0, 1])))


@pytest.mark.parametrize("mode", ["greedy", "sampled", "private"])
def test_generation_never_emits_an_id_past_the_tokenizer(tok, mode):
    V = len(tok)
    model = padded(llama(V), 1e3)  # padding logits of order 1e3 * |h|: the padded head itself would pick them
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        assert (model(**enc).logits[:, -1].argmax(-1) >= V).all()
    kwargs = {"greedy": dict(greedy=True), "sampled": dict(temperature=1.0),
              "private": dict(temperature=1.0, generator=torch.Generator().manual_seed(0))}[mode]
    torch.manual_seed(0)
    ro = generate(model, tok, PROMPTS, 8, **kwargs)
    assert ro.sequences_B_T.shape[1] > ro.prompt_width
    assert int(ro.sequences_B_T.max()) < V


# ------------------------------------------------------------------------------------------------- stop tokens


def test_the_stop_ids_are_the_tokenizers_eos_and_the_generation_configs(tok):
    assert eos_ids(tok) == (2,)
    assert eos_ids(tok, llama(len(tok), eos=[2, 0])) == (2, 0)
    assert eos_ids(tok, llama(len(tok), eos=0)) == (2, 0)


def test_generation_stops_on_any_stop_token(tok):
    # generation_config.eos_token_id = [<|im_end|>, <|endoftext|>]; with a zero final norm every logit is 0 and
    # greedy decoding picks id 0, <|endoftext|>: the response ends there, not at the cap.
    model = llama(len(tok), eos=[2, 0])
    with torch.no_grad():
        model.model.norm.weight.zero_()
    ro = generate(model, tok, PROMPTS, 6, greedy=True)
    assert response_ids(ro) == [[0]] * len(PROMPTS)
    assert not ro.truncated_B.any()
    capped = cap_responses(ro, [6, 6, 6], eos_ids(tok, model))
    assert not capped.truncated_B.any()


def test_masks_and_truncation_read_any_stop_id_as_the_end(tok):
    eos = (2, 0)
    gen_B_R = torch.tensor([[5, 0, 7, 2], [5, 2, 0, 9], [5, 6, 7, 8]])
    assert response_mask(gen_B_R, eos).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    ro = rollout_from_responses(tok, PROMPTS, [[5, 0], [5, 2], [5, 6, 7]], eos)
    assert ro.truncated_B.tolist() == [False, False, True]
    assert cap_responses(ro, [1, 3, 3], eos).truncated_B.tolist() == [True, False, True]
    assert rollout_from_responses(tok, PROMPTS, [[5, 0], [5, 2], [5, 6, 7]]).truncated_B.tolist() == [True, False, True]


# ------------------------------------------------------------------------------------- pad token, left padding


def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_says_so(tmp_path, capsys):
    raw = AutoTokenizer.from_pretrained(str(SMOLLM2))
    raw.pad_token = None
    raw.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(str(tmp_path)).pad_token is None
    tok = load_tokenizer(tmp_path)
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)
    assert "no pad token" in capsys.readouterr().out
    ro = generate(llama(len(tok)), tok, PROMPTS, 3, greedy=True)  # batched, left-padded: needs a pad token
    assert ro.sequences_B_T.shape[0] == len(PROMPTS)


def test_left_padded_batched_greedy_decoding_equals_one_prompt_at_a_time(tok):
    model = llama(len(tok), seed=3)
    lengths = [len(ids) for ids in tok(PROMPTS, add_special_tokens=False)["input_ids"]]
    assert len(set(lengths)) == len(PROMPTS)  # every row padded differently
    batched = response_ids(generate(model, tok, PROMPTS, 8, greedy=True))
    alone = [response_ids(generate(model, tok, [p], 8, greedy=True))[0] for p in PROMPTS]
    assert batched == alone


# ------------------------------------------------------------------------------- chat template, long context


def chat_route(system: str, max_new_tokens: int = 16, source: str = "rows.jsonl"):
    spec = parse_spec({"routes": [{"name": "chat", "data": {"source": source, "prompt_column": "q",
                                                            "answer_column": "a", "eval_size": 2},
                                   "render": {"kind": "chat", "system": system},
                                   "generate": {"max_new_tokens": max_new_tokens}}]})
    return spec.routes[0]


def test_an_empty_system_prompt_gets_the_templates_default(tok):
    # SmolLM2's template writes its own system prompt when the messages have none: what a route with an empty
    # render.system renders (tasks/specs/render.py says so); a route's (or a row's) system prompt replaces it.
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    (text,) = render_prompts(chat_route(""), [{"prompt": "hi"}], tok)
    assert text == f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    (own,) = render_prompts(chat_route("Answer."), [{"prompt": "hi"}], tok)
    assert own.startswith("<|im_start|>system\nAnswer.<|im_end|>\n") and default not in own
    (row,) = render_prompts(chat_route("Answer."), [{"prompt": "hi", "system": "Be brief."}], tok)
    assert row.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_the_length_check_uses_the_models_own_context(tok, tmp_path):
    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set

    rows = [{"q": " ".join(f"word{i}-{j}" for j in range(60)), "a": str(i)} for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"routes": [{"name": "long", "data": {"source": "rows.jsonl", "prompt_column": "q", "answer_column": "a",
                                                 "eval_size": 2},
                        "render": {"kind": "chat", "system": "Answer."}, "generate": {"max_new_tokens": 200}}]}
    (tmp_path / "routes.yaml").write_text(json.dumps(spec))
    n = max(len(x) for x in tok(render_prompts(chat_route("Answer."), [{"prompt": r["q"]} for r in rows], tok),
                                add_special_tokens=False)["input_ids"])
    assert n > 128 and n + 200 < 8192
    for context in (8192, n + 100):
        model = tmp_path / f"model-{context}"
        llama(len(tok), max_positions=context).config.save_pretrained(model)
        tok.save_pretrained(model)
        if context == 8192:  # fits: nothing assumes 128 positions
            ps = load_prompt_set(build_prompt_set(tmp_path / "routes.yaml", str(model), root=tmp_path / "sets"))
            assert ps.context == 8192
            # What the preflight renders through a teacher's own chat template: the route's first prompt.
            system, user = first_prompt_messages(ps, "long")
            assert system == {"role": "system", "content": "Answer."} and user["content"] in {r["q"] for r in rows}
        else:
            with pytest.raises(InputError, match=f"exceeds the model's {context}-token context"):
                build_prompt_set(tmp_path / "routes.yaml", str(model), root=tmp_path / "sets")


# ---------------------------------------------------------------------------- what the preflight compares


def save_checkpoint(model, tok, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def record(folder: Path, tok) -> SimpleNamespace:
    """A registry entry for the checkpoint at ``folder`` (the fields :func:`teacher_problems` reads)."""
    return SimpleNamespace(name="t", route="chat", model_uri=str(folder), trust_remote_code=False,
                           tokenizer_fingerprint=tokenizer_fingerprint(tok),
                           provenance=SimpleNamespace(base="", data=""))


def test_a_differing_vocabulary_is_named_by_its_first_differing_ids(tok):
    other = AutoTokenizer.from_pretrained(str(SMOLLM2))
    vocab = json.loads(other.backend_tokenizer.to_str())
    ids = vocab["model"]["vocab"]
    ids["hello"], ids["world"] = ids["world"], ids["hello"]  # the same tokens, two ids swapped
    other = type(other)(tokenizer_object=type(other.backend_tokenizer).from_str(json.dumps(vocab)),
                        **{k: getattr(tok, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")})
    (problem,) = compatibility_problems(tok, other)
    low, high = sorted((tok.convert_tokens_to_ids("hello"), tok.convert_tokens_to_ids("world")))
    first = tok.convert_ids_to_tokens(low)
    assert f"first differing ids: id {low}: student {first!r} vs teacher" in problem
    assert f"id {high}: student" in problem


def test_a_teachers_own_chat_template_must_render_the_first_prompt_as_the_students(tok, tmp_path):
    student = check_checkpoint(str(save_checkpoint(llama(len(tok)), tok, tmp_path / "student")), "student_uri")
    first = [{"role": "user", "content": "hi"}]
    other = AutoTokenizer.from_pretrained(str(SMOLLM2))
    other.chat_template = tok.chat_template.replace("You are a helpful AI assistant", "You are an AI assistant")
    folder = save_checkpoint(llama(len(tok), seed=1), other, tmp_path / "teacher")
    problems = teacher_problems(record(folder, other), student, "registry.json", None, "", lambda: None,
                                lambda: first)
    assert [p.field for p in problems] == ["teacher 't'.model_uri (tokenizer)"]
    assert ("chat templates render a route's first prompt differently from character 28: student 'rt|>system\\nYou "
            "are a helpful AI assistant named SmolLM, trai' vs teacher 'rt|>system\\nYou are an AI assistant named "
            "SmolLM, trained by '") in problems[0].message
    # The same template text (or no messages to render) is no problem.
    same = save_checkpoint(llama(len(tok), seed=1), tok, tmp_path / "same")
    assert teacher_problems(record(same, tok), student, "registry.json", None, "", lambda: None, lambda: first) == []


def test_a_teacher_must_stop_only_on_tokens_the_student_can_produce(tok, tmp_path):
    student = check_checkpoint(str(save_checkpoint(llama(len(tok)), tok, tmp_path / "student")), "student_uri")
    teacher = padded(llama(len(tok), eos=[2, 0]), 1.0)  # a padded head may hold ids past the tokenizer ...
    teacher.generation_config.eos_token_id = [2, len(tok) + 3]  # ... but a stop id there is never produced
    folder = save_checkpoint(teacher, tok, tmp_path / "teacher")
    (problem,) = teacher_problems(record(folder, tok), student, "registry.json", None, "", lambda: None)
    assert problem.field == "teacher 't'.model_uri eos_token_id"
    assert f"stop token ids [{len(tok) + 3}] (of [2, {len(tok) + 3}]) lie outside the student's {len(tok)}" in \
        problem.message
    teacher.generation_config.eos_token_id = [2, 0]
    save_checkpoint(teacher, tok, folder)
    assert teacher_problems(record(folder, tok), student, "registry.json", None, "", lambda: None) == []


def test_a_vocab_size_short_of_the_tokenizer_is_refused_and_a_padded_one_is_not(tok, tmp_path):
    short = check_checkpoint(str(save_checkpoint(llama(len(tok) - 64), tok, tmp_path / "short")), "student_uri")
    assert [(p.field, p.message.split(";")[0]) for p in short.problems] == \
        [("vocab_size", f"{len(tok) - 64} < {len(tok)} tokens of its tokenizer")]
    assert check_checkpoint(str(save_checkpoint(padded(llama(len(tok)), 1.0), tok, tmp_path / "padded")),
                            "student_uri").problems == []


def test_a_checkpoint_asking_for_its_own_code_is_refused_without_the_grant(tok, tmp_path):
    # A known model_type with an auto_map would otherwise load silently as the built-in class.
    folder = save_checkpoint(llama(len(tok)), tok, tmp_path / "remote")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}}))
    with pytest.raises(RemoteCodeRefused, match="auto_map.*trust_remote_code is not granted.*Grant it"):
        load_model(folder)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tok_config, "auto_map": {
        "AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}}))
    with pytest.raises(RemoteCodeRefused, match="tokenizer_config.json names the checkpoint's own Python code"):
        load_tokenizer(folder)
