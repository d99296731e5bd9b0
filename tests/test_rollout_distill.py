"""Generation masks, teacher rescoring consistent with generation, and the OPD step on tiny real models."""

import pytest
import torch

from tasks.training.distill import opd_step, score_with_teachers
from tasks.modeling.teacher import checkpoint_teachers
from tasks.objectives.losses import Objective, chunked_objective
from tasks.modeling.models import create_model
from tasks.modeling.rollout import (
    PrivateSampler,
    decode_responses,
    forward_hidden,
    generate,
    position_ids_from_mask,
    response_mask,
)
from tasks.world.tokenizer import build_char_tokenizer
from tasks.world.domains import Route, domain_of
from tasks.world.spec import world_verifiers

PROMPTS = ["<bos><shift><low>1:ab=", "<bos><rev><high>abcdefgh=", "<bos><sort><low>5203="]
PROBLEMS = ["1:ab", "abcdefgh", "5203"]
ROUTES = ["shift-low", "rev-high", "sort-low"]
ANSWERS = [domain_of(Route.parse(r)).answer(p) for r, p in zip(ROUTES, PROBLEMS)]


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


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_private_sampler_draws_from_the_tempered_softmax(temperature):
    """Gumbel-max with a private generator: the argmax frequencies over 40000 draws are softmax(scores / T), a banned
    (-inf) token is never drawn, and torch's global generator is not touched."""
    scores = torch.tensor([[0.7, 0.2, 0.1, 0.0]]).log().expand(40000, 4).clone()  # token 3 banned
    state = torch.get_rng_state()
    sampler = PrivateSampler(temperature, torch.Generator().manual_seed(0))
    freq = torch.bincount(sampler(None, scores).argmax(-1), minlength=4).float() / 40000
    want = torch.tensor([0.7, 0.2, 0.1]) ** (1 / temperature)
    want = torch.cat([want / want.sum(), torch.zeros(1)])  # T = 2: 0.5051, 0.2700, 0.2249, 0
    assert torch.allclose(freq, want, atol=0.01), (freq, want)
    assert freq[3] == 0
    assert torch.equal(torch.get_rng_state(), state)


def test_generate_with_a_private_generator_is_reproducible_in_threads(tok):
    """Two threads sampling side by side, each with its own generator, get what each gets alone: the rollouts of a
    seed are fixed whatever else the process samples meanwhile (RL specialists train side by side in threads)."""
    from concurrent.futures import ThreadPoolExecutor

    model = tiny(tok, 1)
    prompts = PROMPTS * 8

    def rollouts(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return [generate(model, tok, prompts, 6, temperature=1.5, generator=gen).sequences_B_T for _ in range(4)]

    alone = {seed: rollouts(seed) for seed in (1, 2)}
    torch.manual_seed(0)
    with ThreadPoolExecutor(3) as pool:
        noise = pool.submit(lambda: [torch.rand(1000) for _ in range(20000)])  # a third thread on the global RNG
        side = {seed: f.result() for seed, f in [(s, pool.submit(rollouts, s)) for s in (1, 2)]}
        noise.result()
    after = torch.get_rng_state()
    for seed in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(alone[seed], side[seed]))
    assert not torch.equal(alone[1][0], alone[2][0])  # and the seed matters
    assert len({tuple(x.flatten().tolist()) for x in alone[1]}) == 4  # the generator advances between calls
    torch.manual_seed(0)
    [torch.rand(1000) for _ in range(20000)]
    assert torch.equal(after, torch.get_rng_state())  # the global generator served the third thread alone


@pytest.mark.parametrize("loss", ["reverse_kl", "forward_kl", "jsd", "skew_reverse_kl", "sampled_token"])
def test_opd_steps_reduce_reverse_kl_to_the_teacher(tok, loss):
    torch.manual_seed(0)
    student, teacher = tiny(tok, 1), tiny(tok, 2).requires_grad_(False).eval()
    teacher_params = [p.clone() for p in teacher.parameters()]
    prompts, routes, answers = PROMPTS * 8, ROUTES * 8, ANSWERS * 8
    groups = {"t": list(range(len(prompts)))}
    opt = torch.optim.AdamW(student.parameters(), lr=3e-3)

    def measured_kl():
        torch.manual_seed(123)
        ro = generate(student, tok, prompts, max_new_tokens=6)
        with torch.no_grad():
            hs = forward_hidden(student, ro.sequences_B_T, ro.attention_mask_B_T)[:, :-1]
            ht = score_with_teachers(checkpoint_teachers({"t": teacher}), groups, ro)["t"][1][:, :-1]
            return chunked_objective(hs, ht, student.get_output_embeddings(), teacher.get_output_embeddings(),
                                     ro.loss_mask_B_T(), Objective()).loss.item()

    before = measured_kl()
    for _ in range(40):
        stats = opd_step(student, checkpoint_teachers({"t": teacher}), tok, prompts, routes, answers, groups, opt, None, max_new_tokens=6,
                         objective=Objective(loss=loss), verifiers=world_verifiers(ROUTES))
    after = measured_kl()
    assert after < 0.5 * before, (before, after)
    assert set(stats.kl_sum) == {"shift-low", "rev-high", "sort-low"}
    assert stats.tokens == int(sum(stats.kl_tokens.values()))
    assert all(torch.equal(a, b) for a, b in zip(teacher_params, teacher.parameters()))  # teacher untouched


@pytest.mark.slow
def test_compiled_generation_decodes_as_eager_and_follows_weight_updates(tok):
    """opd.compile_generation: a marked model generates through torch.compile (dynamo compiles graphs) with a static
    cache, greedy tokens equal the eager ones, an in-place weight update changes them the same way without a
    recompile being needed for correctness, and a deepcopy (the overlap's rollout copy) keeps the mark."""
    import copy

    from torch._dynamo.utils import counters

    from tasks.modeling.rollout import compile_generation, compiled_generation_kwargs

    model = tiny(tok, 3).eval()
    assert compiled_generation_kwargs(model) == {}
    eager = generate(model, tok, PROMPTS, 12, greedy=True).sequences_B_T
    compile_generation(model)
    assert compiled_generation_kwargs(model)["cache_implementation"] == "static"
    counters.clear()
    compiled = generate(model, tok, PROMPTS, 12, greedy=True).sequences_B_T
    assert counters["stats"]["unique_graphs"] > 0  # it really went through torch.compile
    assert torch.equal(compiled, eager)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p, generator=torch.Generator().manual_seed(1)))
    after = generate(model, tok, PROMPTS, 12, greedy=True).sequences_B_T
    assert not torch.equal(after, eager)
    assert torch.equal(after, generate(compile_generation(copy.deepcopy(model), False), tok, PROMPTS, 12,
                                       greedy=True).sequences_B_T)
    assert compiled_generation_kwargs(copy.deepcopy(model)) != {}


def test_a_copy_of_a_compiled_model_generates_with_its_own_weights(tok):
    """The overlap's rollout model is a deepcopy of the student taken after the student has generated (its compiled
    call cached on it): the copy must sample from its own weights, never through the student's compiled call (which
    would read the live student mid-update)."""
    import copy

    from tasks.modeling.rollout import compile_generation

    student = compile_generation(tiny(tok, 4).eval())
    generate(student, tok, PROMPTS, 12, greedy=True)  # the student's compiled call now exists
    rollout_copy = copy.deepcopy(student)
    own = generate(compile_generation(copy.deepcopy(rollout_copy), False), tok, PROMPTS, 12, greedy=True)
    with torch.no_grad():  # the student moves on (an update); the copy does not
        for p in student.parameters():
            p.add_(0.5 * torch.randn_like(p, generator=torch.Generator().manual_seed(2)))
    assert torch.equal(generate(rollout_copy, tok, PROMPTS, 12, greedy=True).sequences_B_T, own.sequences_B_T)
