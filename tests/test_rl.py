"""The GRPO trainer: advantages computed by hand, the loss's gradient, and a few real steps raising the verifier
reward of a tiny model on one route."""

import pytest
import torch

from tasks.training.rl import group_advantages, policy_loss, train_grpo
from tasks.world.spec import world_verifiers

VERIFIERS = world_verifiers(["rev-low"])


def answers_of(route: str, problems: list[str]) -> list[str]:
    """The reference answers of world problems (what the route's verifier compares against)."""
    from tasks.world.domains import Route, domain_of

    return [domain_of(Route.parse(route)).answer(p) for p in problems]


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(r, 4, normalize_std=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])
    adv = group_advantages(r, 4)
    std = (0.75 ** 2 + 3 * 0.25 ** 2) ** 0.5 / 2  # population std of (1, 0, 0, 0) = sqrt(3)/4
    assert adv[:4].tolist() == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert adv[4:].tolist() == [0, 0, 0, 0]  # a group that all agrees teaches nothing
    with pytest.raises(ValueError):
        group_advantages(torch.ones(6), 4)


def test_policy_loss_gradient_is_minus_advantage_times_grad_log_prob():
    from tasks.modeling.models import create_model
    from tasks.modeling.rollout import generate, token_logprobs
    from tasks.world.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = create_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    ro = generate(model, tok, ["<bos><rev><low>abc=", "<bos><sort><low>312="], 6)
    adv = torch.tensor([1.5, -0.5])
    (old,) = token_logprobs(model, ro, (1.0,))
    model.zero_grad()
    policy_loss(model, ro, adv, old, chunk_size=3).backward()
    got = [p.grad.clone() for p in model.parameters()]
    # On-policy the clipped loss has the REINFORCE gradient: -sum_t a_b grad log q(x_t) / tokens.
    model.zero_grad()
    logits = model(input_ids=ro.sequences_B_T, attention_mask=ro.attention_mask_B_T,
                   position_ids=(ro.attention_mask_B_T.cumsum(-1) - 1).clamp(min=0)).logits[:, :-1]
    logq = torch.log_softmax(logits.float(), -1).gather(-1, ro.sequences_B_T[:, 1:, None]).squeeze(-1)
    mask = ro.loss_mask_B_T().float()
    (-(adv[:, None] * logq * mask).sum() / mask.sum()).backward()
    for g, p in zip(got, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)


def test_the_policy_loss_backward_leaves_the_global_rng_alone(monkeypatch):
    """Like the distillation loss (tests/test_losses.py): its chunk recomputation saves and restores no RNG state."""
    from tasks.modeling.models import create_model
    from tasks.modeling.rollout import generate, token_logprobs
    from tasks.world.tokenizer import build_char_tokenizer
    from tests.test_losses import rng_state_calls

    tok = build_char_tokenizer()
    model = create_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    ro = generate(model, tok, ["<bos><rev><low>abc="], 6)
    (old,) = token_logprobs(model, ro, (1.0,))
    calls = rng_state_calls(monkeypatch)
    policy_loss(model, ro, torch.tensor([1.0]), old, chunk_size=2).backward()
    assert next(model.parameters()).grad is not None
    assert calls == []


def warmed_up_rev_low(steps: int = 12):
    """A tiny model after a few supervised steps on one-letter reversal (the answer is the letter itself): it answers
    right sometimes, so GRPO groups disagree and have a signal. Returns (tokenizer, model, prompts, problems)."""
    from tasks.modeling.models import create_model
    from tasks.world.tokenizer import build_char_tokenizer
    from tasks.training.sft import sft_batch, sft_loss
    from tasks.world.domains import Route, format_prompt, gold_completion

    tok = build_char_tokenizer()
    model = create_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    route = Route.parse("rev-low")
    problems = list("abcdefgh")
    prompts = [format_prompt(route, p) for p in problems]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = sft_batch(tok, prompts, [gold_completion(route, p) for p in problems])
    for _ in range(steps):
        opt.zero_grad()
        sft_loss(model, batch).backward()
        opt.step()
    return tok, model.eval(), prompts, problems


def test_grpo_runs_side_by_side_in_threads_end_where_they_end_alone():
    """RL specialists train in parallel threads (flows.specialists --trainer rl --workers 2): each run's prompts and
    samples come from generators of its own, so it ends with the weights it gets alone, whatever runs beside it."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    tok, base, prompts, problems = warmed_up_rev_low()
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731

    def run(seed: int) -> torch.Tensor:
        model = copy.deepcopy(base)
        hist = train_grpo(model, tok, {"rev-low": (prompts, answers_of("rev-low", problems))}, steps=4,
                          prompts_per_step=8, group_size=4, max_new_tokens=3, lr=5e-3, warmup_steps=1, seed=seed,
                          verifiers=VERIFIERS)
        assert 0 < sum(h.reward["rev-low"] for h in hist) < 4  # groups disagreed: the updates had a signal
        return flat(model)

    seeds = [0, 1, 2]
    alone = [run(s) for s in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:
        side = list(pool.map(run, seeds))
    for a, b in zip(alone, side):
        assert torch.equal(a, b)
    assert not torch.equal(alone[0], alone[1]) and not torch.equal(alone[0], flat(base))  # the seed matters


def test_a_few_grpo_steps_raise_the_reward():
    from tasks.modeling.rollout import decode_responses, generate
    from tasks.world.domains import Route, verify

    torch.manual_seed(0)
    tok, model, prompts, problems = warmed_up_rev_low()
    route = Route.parse("rev-low")

    def reward():
        torch.manual_seed(1)
        ro = generate(model, tok, prompts * 8, 3)
        return sum(verify(route, p, t) for p, t in zip(problems * 8, decode_responses(tok, ro))) / 64

    before = reward()
    hist = train_grpo(model, tok, {"rev-low": (prompts, answers_of("rev-low", problems))}, steps=80, prompts_per_step=8,
                      group_size=8, max_new_tokens=3, lr=5e-3, warmup_steps=2, seed=0, verifiers=VERIFIERS)
    after = reward()
    print(f"\nsampled reward {before:.3f} -> {after:.3f}; rollout tokens {sum(h.rollout_tokens for h in hist)}")
    assert after > before + 0.1
