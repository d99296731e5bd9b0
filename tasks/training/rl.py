"""Outcome-reward RL (GRPO-style): a group of samples per prompt, the route's verifier as the reward, group-normalised
advantages, and a clipped policy-gradient update on the sampled tokens. It trains RL specialists (RLVR teachers) and
is the RL baseline a merge is compared with; it shares the policy-gradient loss of the objective menu
(:func:`tasks.objectives.losses.policy_gradient_loss`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.training.distill import verifier_rewards
from tasks.objectives.losses import policy_gradient_loss
from tasks.modeling.device import autocast_for
from tasks.modeling.rollout import Rollout, forward_hidden, generate, token_logprobs
from tasks.training.sft import make_optimizer
from tasks.specs.verifiers import Verifier


def group_advantages(rewards_B: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each reward minus its group's mean (rows ``g*G .. g*G+G-1`` share a prompt), divided by the
    group's standard deviation when ``normalize_std`` (Dr. GRPO drops that division). A group whose samples all score
    the same carries no signal: 0. ``[B]``."""
    if rewards_B.numel() % group_size:
        raise ValueError(f"{rewards_B.numel()} rewards do not split into groups of {group_size}")
    r_G_S = rewards_B.view(-1, group_size).float()
    adv_G_S = r_G_S - r_G_S.mean(-1, keepdim=True)
    if normalize_std:
        adv_G_S = adv_G_S / (r_G_S.std(-1, unbiased=False, keepdim=True) + eps)
    return adv_G_S.flatten()


def policy_loss(
    model: PreTrainedModel,
    rollout: Rollout,
    adv_B: torch.Tensor,
    logq_old_B_T: torch.Tensor,
    clip_eps: float = 0.2,
    chunk_size: int = 64,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Mean over response tokens of the PPO-clipped policy-gradient loss with each sequence's advantage on every one
    of its tokens. The policy is the model's distribution at the sampling ``temperature`` (the one ``logq_old_B_T``
    was taken at) over the tokenizer's ids ``[0, vocab_size)`` (a padded head's padding is never sampled), so an
    on-policy ratio is 1. The head runs chunk by chunk with recomputation, so no ``[B, T, V]``
    tensor is kept."""
    hidden_B_T_H = forward_hidden(model, rollout.sequences_B_T, rollout.attention_mask_B_T)[:, :-1]
    device = hidden_B_T_H.device
    targets_B_T = rollout.sequences_B_T[:, 1:].to(device)
    mask_B_T = rollout.loss_mask_B_T().float().to(device)
    adv_B, logq_old_B_T = adv_B.to(device), logq_old_B_T.to(device)
    head = model.get_output_embeddings()

    def chunk(h_B_C_H, tgt_B_C, old_B_C, m_B_C):
        with autocast_for(model):
            z_B_C_V = head(h_B_C_H)[..., :vocab_size].float()
        logq_B_C = F.log_softmax(z_B_C_V / temperature, dim=-1).gather(-1, tgt_B_C[..., None]).squeeze(-1)
        adv_B_C = adv_B[:, None].expand_as(m_B_C)
        old_B_C = old_B_C.masked_fill(m_B_C == 0, 0.0)
        return (policy_gradient_loss(logq_B_C, old_B_C, adv_B_C, "clip", clip_eps) * m_B_C).sum()

    total = hidden_B_T_H.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden_B_T_H.shape[1], chunk_size):
        sl = slice(s, s + chunk_size)
        if not bool(mask_B_T[:, sl].any()):
            continue
        total = total + checkpoint(chunk, hidden_B_T_H[:, sl], targets_B_T[:, sl], logq_old_B_T[:, sl],
                                   mask_B_T[:, sl], use_reentrant=False, preserve_rng_state=False)  # no RNG draws
    return total / mask_B_T.sum().clamp(min=1.0)


@dataclass
class RLStats:
    step: int
    reward: dict[str, float] = field(default_factory=dict)  # per route: mean verifier reward of the samples
    loss: float = 0.0
    rollout_tokens: int = 0  # response tokens sampled this step
    seconds: float = 0.0


def grpo_step(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: list[str],
    routes: list[str],
    answers: list[str],
    group_size: int,
    max_new_tokens: int,
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    temperature: float = 1.0,
    clip_eps: float = 0.2,
    grad_clip: float = 1.0,
    normalize_std: bool = True,
    generator: torch.Generator | None = None,
    *,
    verifiers: Mapping[str, Verifier],
) -> RLStats:
    """One GRPO step: ``group_size`` samples of each prompt (drawn from ``generator`` when given, else from torch's
    global one), verifier rewards, group advantages, one clipped update (on-policy, so the ratio starts at 1 and the
    clip only matters for reuse)."""
    t0 = time.perf_counter()
    rep = lambda xs: [x for x in xs for _ in range(group_size)]  # noqa: E731
    rollout = generate(model, tok, rep(prompts), max_new_tokens, temperature=temperature, generator=generator)
    rewards_B = verifier_rewards(tok, rollout, rep(routes), rep(answers), verifiers)
    adv_B = group_advantages(rewards_B, group_size, normalize_std)
    (logq_old_B_T,) = token_logprobs(model, rollout, (temperature,), vocab_size=len(tok))
    model.train()
    loss = policy_loss(model, rollout, adv_B, logq_old_B_T, clip_eps, temperature=temperature, vocab_size=len(tok))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    model.eval()
    stats = RLStats(step=0, loss=float(loss.detach()), rollout_tokens=int(rollout.response_lengths_B.sum()))
    for r in set(routes):
        idx = [i for i, x in enumerate(rep(routes)) if x == r]
        stats.reward[r] = float(rewards_B[idx].mean())
    stats.seconds = time.perf_counter() - t0
    return stats


def train_grpo(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    train: dict[str, tuple[list[str], list[str]]],
    steps: int,
    prompts_per_step: int,
    group_size: int,
    max_new_tokens: int,
    lr: float,
    warmup_steps: int = 10,
    seed: int = 0,
    temperature: float = 1.0,
    clip_eps: float = 0.2,
    normalize_std: bool = True,
    on_step=None,
    *,
    verifiers: Mapping[str, Verifier],
) -> list[RLStats]:
    """``steps`` GRPO steps on prompts drawn uniformly over the routes of ``train`` (route -> (prompts, answers));
    ``on_step(stats)`` after each (logging, evaluation). Prompts and samples come from generators of its own seeded
    with ``seed``, never torch's global one: specialists trained side by side in threads are reproducible."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    optimizer, scheduler = make_optimizer(model, lr, 0.0, min(warmup_steps, steps // 2), steps)
    route_names = list(train)
    history = []
    for step in range(1, steps + 1):
        routes = [route_names[rng.randrange(len(route_names))] for _ in range(prompts_per_step)]
        picks = [rng.randrange(len(train[r][0])) for r in routes]
        st = grpo_step(model, tok, [train[r][0][i] for r, i in zip(routes, picks)], routes,
                       [train[r][1][i] for r, i in zip(routes, picks)], group_size, max_new_tokens, optimizer,
                       scheduler, temperature, clip_eps, normalize_std=normalize_std, generator=gen,
                       verifiers=verifiers)
        st.step = step
        history.append(st)
        if on_step is not None:
            on_step(st)
    return history


def run_grpo(model: PreTrainedModel, tok: PreTrainedTokenizerBase, train: dict[str, tuple[list[str], list[str]]],
             rl, max_new_tokens: int, on_step=None, *, verifiers: Mapping[str, Verifier]) -> list[RLStats]:
    """:func:`train_grpo` with the settings of a :class:`tasks.config.RLConfig` (``rl.max_new_tokens`` wins over
    ``max_new_tokens`` when set): RL specialists and the benchmark's Mix-RL baseline both run it."""
    return train_grpo(model, tok, train, rl.steps, rl.prompts_per_step, rl.group_size, rl.max_new_tokens or max_new_tokens,
                      rl.lr, rl.warmup_steps, rl.seed, rl.temperature, rl.clip_eps, rl.normalize_std, on_step=on_step,
                      verifiers=verifiers)
