"""Generation masks, teacher rescoring consistent with generation, and the OPD step on tiny real models."""

import pytest
import torch

from tasks.distill import opd_step, score_with_teachers
from tasks.losses import Objective, chunked_objective
from tasks.models import create_model
from tasks.rollout import decode_responses, forward_hidden, generate, position_ids_from_mask, response_mask
from tasks.tokenizer import build_char_tokenizer

PROMPTS = ["<bos><shift><low>1:ab=", "<bos><rev><high>abcdefgh=", "<bos><sort><low>5203="]
PROBLEMS = ["1:ab", "abcdefgh", "5203"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny(tok, seed):
    return create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)


def test_response_mask_keeps_first_eos_and_drops_what_follows():
    eos = 2
    gen = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 7, 2, 0], [5, 6, 7, 8, 9]])
    assert response_mask(gen, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_rescoring_matches_generation_logits(tok):
    # The teacher scores the student's sequence in one forward pass; with the same model, its logits at each
    # response position must equal what generation computed step by step (left padding included).
    model = tiny(tok, 0).eval()
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=5, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=tok.pad_token_id, eos_token_id=-1)
    gen_logits_B_R_V = torch.stack(out.logits, 1)
    mask = torch.cat([enc.attention_mask, torch.ones(3, 5, dtype=torch.long)], 1)
    with torch.no_grad():
        hidden = forward_hidden(model, out.sequences, mask)
        logits_B_T_V = model.get_output_embeddings()(hidden)
    P = enc.input_ids.shape[1]
    assert torch.allclose(logits_B_T_V[:, P - 1:-1], gen_logits_B_R_V, atol=1e-4)


def test_generate_returns_consistent_masks(tok):
    torch.manual_seed(0)
    model = tiny(tok, 1)
    ro = generate(model, tok, PROMPTS, max_new_tokens=6)
    P = ro.prompt_width
    assert ro.sequences_B_T.shape == (3, P + 6)
    assert ro.response_mask_B_T[:, :P].sum() == 0
    assert torch.equal(ro.attention_mask_B_T[:, P:], ro.response_mask_B_T[:, P:])
    special = set(tok.all_special_ids)
    for row, text in enumerate(decode_responses(tok, ro)):
        ids = ro.sequences_B_T[row, P:][ro.response_mask_B_T[row, P:].bool()].tolist()
        assert len(ids) == int(ro.response_lengths_B[row])
        assert (ids[-1] == tok.eos_token_id) == (not bool(ro.truncated_B[row]))
        assert tok.eos_token_id not in ids[:-1]
        assert len(text) == sum(i not in special for i in ids)  # one character per non-special token


@pytest.mark.parametrize("loss", ["reverse_kl", "forward_kl", "jsd", "skew_reverse_kl", "sampled_token"])
def test_opd_steps_reduce_reverse_kl_to_the_teacher(tok, loss):
    torch.manual_seed(0)
    student, teacher = tiny(tok, 1), tiny(tok, 2).requires_grad_(False).eval()
    teacher_params = [p.clone() for p in teacher.parameters()]
    prompts, routes, problems = PROMPTS * 8, ["shift-low", "rev-high", "sort-low"] * 8, PROBLEMS * 8
    groups = {"t": list(range(len(prompts)))}
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)

    def measured_kl():
        torch.manual_seed(123)
        ro = generate(student, tok, prompts, max_new_tokens=6)
        with torch.no_grad():
            hs = forward_hidden(student, ro.sequences_B_T, ro.attention_mask_B_T)[:, :-1]
            ht = score_with_teachers({"t": teacher}, groups, ro)["t"][1][:, :-1]
            return chunked_objective(hs, ht, student.get_output_embeddings(), teacher.get_output_embeddings(),
                                     ro.loss_mask_B_T(), Objective()).loss.item()

    before = measured_kl()
    for _ in range(40):
        stats = opd_step(student, {"t": teacher}, tok, prompts, routes, problems, groups, opt, None, max_new_tokens=6,
                         objective=Objective(loss=loss))
    after = measured_kl()
    assert after < 0.5 * before, (before, after)
    assert set(stats.kl_sum) == {"shift-low", "rev-high", "sort-low"}
    assert stats.tokens == int(sum(stats.kl_tokens.values()))
    assert all(torch.equal(a, b) for a, b in zip(teacher_params, teacher.parameters()))  # teacher untouched
