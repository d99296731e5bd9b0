"""Divergences between the student's and a teacher's next-token distributions.

Conventions: ``q`` is the student, ``p`` the teacher. Position ``t`` of a hidden state predicts token ``t + 1``; the
caller passes a mask that is 1 exactly at the positions whose next token is a response token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]


def reverse_kl_per_token(student_logits_N_V: torch.Tensor, teacher_logits_N_V: torch.Tensor) -> torch.Tensor:
    """KL(q || p) = sum_v q_v (log q_v - log p_v) at each of N positions, in fp32. Returns ``kl_N``.

    The teacher side is detached: gradients reach only the student's logits.
    """
    logq_N_V = F.log_softmax(student_logits_N_V.float(), dim=-1)
    logp_N_V = F.log_softmax(teacher_logits_N_V.detach().float(), dim=-1)
    return (logq_N_V.exp() * (logq_N_V - logp_N_V)).sum(-1)


@dataclass
class DivergenceResult:
    """``loss`` is the mean over masked tokens; ``kl_sum_B`` and ``tokens_B`` are per sequence (detached)."""

    loss: torch.Tensor
    kl_sum_B: torch.Tensor
    tokens_B: torch.Tensor


def chunked_reverse_kl(
    student_hidden_B_T_H: torch.Tensor,
    teacher_hidden_B_T_Ht: torch.Tensor,
    student_head: Head,
    teacher_head: Head,
    mask_B_T: torch.Tensor,
    chunk_size: int = 64,
    normalizer: float | None = None,
) -> DivergenceResult:
    """Per-token full-vocabulary reverse KL, KL(student || teacher), summed over masked positions.

        loss = sum_{b,t} m[b,t] * sum_v q[b,t,v] (log q[b,t,v] - log p[b,t,v]) / normalizer

    with ``q = softmax(student_head(h_s))`` and ``p = softmax(teacher_head(h_t))``; ``normalizer`` defaults to the
    number of masked positions. Shapes: hidden states ``[B, T, H]`` (the teacher's width may differ), heads map
    ``[..., H] -> [..., V]``, ``mask_B_T`` is 0/1. The sequence is cut into chunks of ``chunk_size`` positions and each
    chunk's logits are recomputed in the backward pass (activation checkpointing), so neither model's
    ``[B, T, V]`` fp32 logits exist whole: peak extra memory is ``O(B * chunk_size * V)``. The teacher is run under
    ``no_grad``; the gradient flows only through the student's hidden states and head.
    """
    if student_hidden_B_T_H.shape[:2] != mask_B_T.shape or teacher_hidden_B_T_Ht.shape[:2] != mask_B_T.shape:
        raise ValueError(
            f"shape mismatch: student {tuple(student_hidden_B_T_H.shape)}, teacher {tuple(teacher_hidden_B_T_Ht.shape)},"
            f" mask {tuple(mask_B_T.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    mask_B_T = mask_B_T.to(torch.float32)
    B, T = mask_B_T.shape

    def chunk_kl(hs_B_C_H: torch.Tensor, ht_B_C_H: torch.Tensor, m_B_C: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = teacher_head(ht_B_C_H)
        kl_B_C = reverse_kl_per_token(
            student_head(hs_B_C_H).flatten(0, 1), teacher_logits.flatten(0, 1)
        ).view(m_B_C.shape)
        return (kl_B_C * m_B_C).sum(-1)

    kl_sum_B = student_hidden_B_T_H.new_zeros(B, dtype=torch.float32)
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        m_B_C = mask_B_T[:, sl]
        if not bool(m_B_C.any()):
            continue
        args = (student_hidden_B_T_H[:, sl], teacher_hidden_B_T_Ht[:, sl].detach(), m_B_C)
        if torch.is_grad_enabled() and student_hidden_B_T_H.requires_grad:
            kl_sum_B = kl_sum_B + checkpoint(chunk_kl, *args, use_reentrant=False)
        else:
            kl_sum_B = kl_sum_B + chunk_kl(*args)
    tokens_B = mask_B_T.sum(-1)
    denom = float(normalizer) if normalizer is not None else max(float(tokens_B.sum()), 1.0)
    return DivergenceResult(loss=kl_sum_B.sum() / denom, kl_sum_B=kl_sum_B.detach(), tokens_B=tokens_B)
