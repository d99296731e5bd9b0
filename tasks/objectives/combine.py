"""Several teachers of one route as one target: pure functions over tensors (the merge applies them per route, the
route spec's ``teachers`` + ``combine``; :func:`tasks.training.distill.combine_scores` wires them in).

With K teachers' log-distributions ``log p_k`` over V tokens at a position and weights ``w_k`` (normalised to sum 1):

================== =====================================================================================
``select``         per sequence, the teacher with the lowest mean NLL ``-log p_k(x_t)`` over the sequence's
                   response tokens scores the whole sequence (:func:`select_teachers`)
``mixture``        per token ``log sum_k w_k p_k``: the weighted mixture of the teachers' distributions
                   (:func:`mixture_logprobs`)
``average_logits`` per token ``sum_k w_k log p_k``: a weighted geometric mean (product of experts), left
                   unnormalised; the objective's log-softmax renormalises it (:func:`average_logprobs`). Its
                   weights may hold negative terms (summing to a positive number): a composed teacher,
                   e.g. weak-to-strong's large base plus ``alpha`` times a small model's RL delta, weights
                   ``[1, alpha, -alpha]`` over (large base, small RL model, small base)
================== =====================================================================================

The per-token modes run as a head over the teachers' features concatenated on the last axis
(:class:`CombinedHead`, like :class:`tasks.objectives.losses.ExtrapolatedHead`), so the objective applies it chunk by
chunk and no ``[B, T, V]`` tensor exists for the whole batch. Off-policy completions of such a route (GKD's
``1 - lambda`` batches, the two-stage cold start) come from one of its teachers per prompt, drawn in proportion to the
weights by a hash of the prompt (:func:`sampling_teacher`), so every teacher writes some and a prompt's is stable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from tasks.objectives.losses import Head, head_input


def normalized_weights(weights: Sequence[float], k: int, signed: bool = False) -> torch.Tensor:
    """``[K]`` weights summing to 1: ``weights`` scaled, or uniform when empty. ValueError on a wrong count or a
    weight that is not positive; with ``signed`` (``average_logits``: a composed teacher) a weight may be negative
    or 0 as long as their sum is positive."""
    if not weights:
        return torch.full((k,), 1.0 / k)
    w_K = torch.tensor([float(w) for w in weights], dtype=torch.float64)
    if len(weights) != k or not bool(torch.isfinite(w_K).all()) or not (signed or bool((w_K > 0).all())):
        raise ValueError(f"weights {list(weights)}: expected {k} positive finite numbers")
    if signed and not float(w_K.sum()) > 0:
        raise ValueError(f"weights {list(weights)}: expected {k} finite numbers with a positive sum")
    return (w_K / w_K.sum()).float()


def composed(weights: Sequence[float]) -> bool:
    """Whether a route's teacher weights compose a teacher rather than mix or vote (a term not positive: weak-to-
    strong's ``log p_large + alpha * (log p_small_rl - log p_small_base)`` is ``average_logits`` over weights
    ``[1, alpha, -alpha]``). Such a route's off-policy samples come from its primary teacher alone."""
    return any(float(w) <= 0 for w in weights)


def sampling_teacher(prompt: str, names: Sequence[str], weights: Sequence[float] = ()) -> str:
    """The teacher of ``names`` that samples ``prompt``'s off-policy completion: ``u`` = the prompt's SHA-256 as a
    number in [0, 1), the first teacher whose cumulative weight (normalised, uniform when empty) exceeds ``u``. The same
    prompt always gets the same teacher, in any process; over many prompts each gets its weight's share."""
    u = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2.0**64
    cum = 0.0
    for name, w in zip(names, normalized_weights(weights, len(names)).tolist()):
        cum += w
        if u < cum:
            return name
    return names[-1]  # u within rounding of 1


def mixture_logprobs(logp_K_N_V: torch.Tensor, w_K: torch.Tensor) -> torch.Tensor:
    """``log sum_k w_k p_k`` per position (``logsumexp_k(log w_k + log p_k)``): ``[N, V]``, normalised when each
    ``log p_k`` is and the weights sum to 1."""
    log_w_K = w_K.to(logp_K_N_V).log()
    return torch.logsumexp(logp_K_N_V + log_w_K.view(-1, *([1] * (logp_K_N_V.dim() - 1))), dim=0)


def average_logprobs(logp_K_N_V: torch.Tensor, w_K: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k log p_k`` per position: ``[N, V]`` logits (not normalised; a log-softmax makes them the
    normalised geometric mean ``prod_k p_k ** w_k / Z``)."""
    return (logp_K_N_V * w_K.to(logp_K_N_V).view(-1, *([1] * (logp_K_N_V.dim() - 1)))).sum(0)


def select_teachers(nll_sum_K_B: torch.Tensor, tokens_B: torch.Tensor) -> torch.Tensor:
    """Per sequence, the index of the teacher with the lowest mean NLL over its response tokens (``nll_sum_K_B``:
    each teacher's summed NLL per sequence, ``tokens_B`` the response tokens). Ties, and sequences without response
    tokens, go to the lower index (the primary teacher). ``[B]`` long."""
    mean_K_B = nll_sum_K_B / tokens_B.clamp(min=1).to(nll_sum_K_B)
    # argmin returns the first minimum on ties; rows without tokens have all-zero means, so index 0.
    return mean_K_B.argmin(dim=0)


def sequence_nll(head: Head, features_B_T_F: torch.Tensor, targets_B_T: torch.Tensor, mask_B_T: torch.Tensor,
                 chunk_size: int = 64, vocab_size: int | None = None) -> torch.Tensor:
    """``sum_t m[b,t] * -log p(targets[b,t])`` per sequence (``[B]``, fp32, no gradient): a teacher's NLL of the
    tokens a sequence holds, at temperature 1, its head applied ``chunk_size`` positions at a time (peak
    ``O(B * chunk_size * V)``). ``features_B_T_F`` and ``targets_B_T`` / ``mask_B_T`` are aligned: position t
    predicts ``targets[b, t]``; ``vocab_size`` cuts a padded head to the tokenizer's ids."""
    B, T = mask_B_T.shape
    nll_B = torch.zeros(B)
    with torch.no_grad():
        for start in range(0, T, chunk_size):
            sl = slice(start, min(start + chunk_size, T))
            m_B_C = mask_B_T[:, sl].float()
            if not bool(m_B_C.any()):
                continue
            z_B_C_V = head(head_input(head, features_B_T_F[:, sl]))[..., :vocab_size].float()
            logp_B_C_V = F.log_softmax(z_B_C_V, dim=-1)
            tgt_B_C = targets_B_T[:, sl].to(logp_B_C_V.device)
            nll_B_C = -logp_B_C_V.gather(-1, tgt_B_C[..., None]).squeeze(-1)
            nll_B += (nll_B_C.cpu() * m_B_C.cpu()).sum(-1)
    return nll_B


Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logp_K_N_V, w_K) -> logits_N_V


class CombinedHead(torch.nn.Module):
    """K teachers' heads as one: input their features concatenated on the last axis ``[..., F_1 + ... + F_K]``
    (``widths``: each ``F_k``), output ``combine(stack_k log_softmax(head_k(features_k)), w_K)`` (``[..., V]``).
    ``vocab_size`` (``len(tok)``) cuts each head, padded or not, to the real vocabulary before its log-softmax."""

    def __init__(self, heads: Sequence[Head], widths: Sequence[int], combine: Combine, weights_K: torch.Tensor,
                 vocab_size: int | None = None):
        super().__init__()
        if len(heads) != len(widths) or len(heads) != len(weights_K):
            raise ValueError(f"{len(heads)} heads, {len(widths)} widths and {len(weights_K)} weights; expected one "
                             "each per teacher")
        self.heads = torch.nn.ModuleList(heads) if all(isinstance(h, torch.nn.Module) for h in heads) else list(heads)
        self.widths, self.combine, self.vocab_size = list(widths), combine, vocab_size
        self.register_buffer("weights_K", weights_K.float(), persistent=False)

    def forward(self, features_N_F: torch.Tensor) -> torch.Tensor:
        parts, start, device = [], 0, None
        for head, width in zip(self.heads, self.widths):
            h_N_H = head_input(head, features_N_F[..., start:start + width])
            start += width
            logp_N_V = F.log_softmax(head(h_N_H)[..., :self.vocab_size].float(), dim=-1)
            device = device or logp_N_V.device
            parts.append(logp_N_V.to(device))
        return self.combine(torch.stack(parts), self.weights_K.to(device))


# The per-token modes, by their route-spec name (``select`` needs no head: it picks each sequence's teacher).
PER_TOKEN: dict[str, Combine] = {"mixture": mixture_logprobs, "average_logits": average_logprobs}
