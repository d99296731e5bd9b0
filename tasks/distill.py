"""On-policy distillation: the student samples, each sample's routed teacher scores it in one forward pass, and the
student minimises the per-token full-vocabulary reverse KL on its own states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.losses import chunked_reverse_kl
from tasks.rollout import Rollout, forward_hidden, generate


@dataclass
class StepStats:
    loss: float
    tokens: int
    kl_sum: dict[str, float] = field(default_factory=dict)  # per route: summed per-token KL
    kl_tokens: dict[str, float] = field(default_factory=dict)  # per route: response tokens scored
    sequences: dict[str, int] = field(default_factory=dict)  # per route: rollouts
    truncated: dict[str, int] = field(default_factory=dict)  # per route: rollouts without EOS
    seconds: dict[str, float] = field(default_factory=dict)  # generate / teacher / update


def score_with_teachers(
    teachers: dict[str, PreTrainedModel], groups: dict[str, list[int]], rollout: Rollout
) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Final hidden states of each row's teacher on the student's exact sequence, one forward per teacher over its
    rows (``groups``: teacher -> row indices, as :meth:`teachers.router.Router.group` makes them):
    teacher -> (rows, hidden ``[b, T, H]``)."""
    out = {}
    with torch.no_grad():
        for name, rows in groups.items():
            idx = torch.tensor(rows)
            out[name] = (rows, forward_hidden(teachers[name], rollout.sequences_B_T[idx], rollout.attention_mask_B_T[idx]))
    return out


def opd_step(
    student: PreTrainedModel,
    teachers: dict[str, PreTrainedModel],
    tok: PreTrainedTokenizerBase,
    prompts: list[str],
    routes: list[str],
    groups: dict[str, list[int]],
    optimizer: torch.optim.Optimizer,
    scheduler,
    max_new_tokens: int,
    sample_temperature: float = 1.0,
    chunk_size: int = 16,
    grad_clip: float = 1.0,
) -> StepStats:
    """One on-policy distillation step over a batch mixed across routes; returns per-route statistics.

    ``routes[i]`` is row i's route (for metrics); ``groups`` maps each teacher to the rows it scores.
    """
    t0 = time.perf_counter()
    rollout = generate(student, tok, prompts, max_new_tokens, greedy=False, temperature=sample_temperature)
    t1 = time.perf_counter()
    teacher_hidden = score_with_teachers(teachers, groups, rollout)
    t2 = time.perf_counter()

    student.train()
    # Position t predicts token t+1: drop the last position, and mask to positions whose next token is a response token.
    student_hidden_B_T_H = forward_hidden(student, rollout.sequences_B_T, rollout.attention_mask_B_T)[:, :-1]
    mask_B_T = rollout.loss_mask_B_T()
    total_tokens = max(int(mask_B_T.sum()), 1)
    loss = student_hidden_B_T_H.new_zeros(())
    stats = StepStats(loss=0.0, tokens=total_tokens)
    for name, (rows, hidden_b_T_H) in teacher_hidden.items():
        idx = torch.tensor(rows)
        res = chunked_reverse_kl(
            student_hidden_B_T_H[idx],
            hidden_b_T_H[:, :-1],
            student.get_output_embeddings(),
            teachers[name].get_output_embeddings(),
            mask_B_T[idx],
            chunk_size=chunk_size,
            normalizer=total_tokens,
        )
        loss = loss + res.loss
        for j, row in enumerate(rows):
            r = routes[row]
            stats.kl_sum[r] = stats.kl_sum.get(r, 0.0) + float(res.kl_sum_B[j])
            stats.kl_tokens[r] = stats.kl_tokens.get(r, 0.0) + float(res.tokens_B[j])
    for row, r in enumerate(routes):
        stats.sequences[r] = stats.sequences.get(r, 0) + 1
        stats.truncated[r] = stats.truncated.get(r, 0) + int(rollout.truncated_B[row])
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite OPD loss {loss.item()}")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), grad_clip)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    student.eval()
    t3 = time.perf_counter()
    stats.loss = float(loss.detach())
    stats.seconds = {"generate": t1 - t0, "teacher": t2 - t1, "update": t3 - t2}
    return stats
