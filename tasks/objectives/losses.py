"""The objective menu: divergences between the student's and a teacher's next-token distributions, and the
sampled-token policy-gradient form of reverse KL. Pure functions over tensors; the merge picks one per route.

Conventions: ``q`` is the student, ``p`` the teacher. Position ``t`` of a hidden state predicts token ``t + 1``; the
caller passes a mask that is 1 exactly at the positions whose next token is a response token.

Where temperature applies (the one place it is defined):

- ``sample_temperature`` (``opd.sample_temperature``) is the distribution the rollouts were drawn from. Behaviour
  log-probs and the importance ratio ``q_theta(x) / q_old(x)`` are both computed at it, so an on-policy ratio is
  exactly 1.
- ``temperature`` (``opd.divergence_temperature``) divides the logits of *both* student and teacher before any
  divergence, top-k selection or per-token advantage ``log p(x) - log q_old(x)`` is computed.
- Evaluation is greedy; no temperature applies there.

Divergences over C categories with ``a``, ``b`` normalised (``KL(a || b) = sum_c a_c (log a_c - log b_c)``):

=================== ========================================================================================
``reverse_kl``      KL(q || p), mode-seeking (the OPD default)
``forward_kl``      KL(p || q), mass-covering (supervised token KD)
``jsd``             generalized JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m), m = beta p + (1 - beta) q.
                    At the endpoints the GKD/TRL convention applies: beta = 0 is forward KL and beta = 1 reverse
                    KL (the limits of JSD(beta)/beta and JSD(beta)/(1 - beta))
``skew_kl``         KL(p || alpha p + (1 - alpha) q) (DistiLLM's SKL; alpha = 0 is forward KL)
``skew_reverse_kl`` KL(q || alpha q + (1 - alpha) p) (DistiLLM's SRKL; alpha = 0 is reverse KL)
``sampled_token``   policy gradient with per-token advantage ``a_t = sg(log p(x_t) - log q_old(x_t))`` at the
                    sampled token only: one teacher number per token (see :func:`policy_gradient_loss`)
``sft``             ``-log q(x_t)`` of the sequence's own token: cross-entropy on the completion (SFT on teacher
                    samples or gold text; off-policy data only). The teacher is not in the loss, only in the
                    diagnostics
=================== ========================================================================================

Top-k (``top_k > 0``): the divergence over the teacher's (or student's) k most likely tokens, with ``top_k_support``

- ``tail``: plus one tail bucket holding the rest of the mass, ``log(1 - sum_topk prob)`` on each side: an exact
  divergence between two (k + 1)-category distributions, a lower bound on the full one (data processing);
- ``renormalize``: both sides renormalised over the k tokens;
- ``truncate``: the raw sum over the k tokens (verl's legacy form). For reverse KL its gradient carries an extra
  ``sum_k grad q_k`` term that lowers the student's top-k mass itself: the bias behind unstable top-k reverse KL.
  ``top_k_stop_grad`` uses the surrogate ``sum_k q_k * sg(log q_k - log p_k)``: same value, and the gradient
  ``sum_k grad q_k (log q_k - log p_k)`` keeps exactly the full reverse KL's gradient terms on the k tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, get_args

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Head = Callable[[torch.Tensor], torch.Tensor]
LossName = Literal["reverse_kl", "forward_kl", "jsd", "skew_kl", "skew_reverse_kl", "sampled_token", "sft"]
TopKSource = Literal["teacher", "student"]
TopKSupport = Literal["tail", "renormalize", "truncate"]
Correction = Literal["clip", "truncate", "none"]
LOSSES: tuple[str, ...] = get_args(LossName)

# The largest log-mass a top-k set may hold before its tail bucket is treated as empty (keeps log(tail) finite).
_MAX_TOPK_LOGMASS = -1e-7


@dataclass(frozen=True)
class Objective:
    """Everything that defines the per-token loss of one route (built from ``OPDConfig``; see the module docstring)."""

    loss: LossName = "reverse_kl"
    beta: float = 0.5
    alpha: float = 0.1
    top_k: int = 0
    top_k_source: TopKSource = "teacher"
    top_k_support: TopKSupport = "tail"
    top_k_stop_grad: bool = False
    temperature: float = 1.0
    sample_temperature: float = 1.0
    correction: Correction = "clip"
    clip_eps: float = 0.2
    ratio_cap: float = 2.0

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; known: {list(LOSSES)}")
        if not 0.0 <= self.beta <= 1.0 or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"beta ({self.beta}) and alpha ({self.alpha}) must lie in [0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = full vocabulary), got {self.top_k}")
        if self.top_k_stop_grad and self.loss != "reverse_kl":
            raise ValueError(f"top_k_stop_grad applies to reverse_kl only, not {self.loss!r}")
        if self.top_k and self.loss in ("sampled_token", "sft"):
            raise ValueError(f"top_k does not apply to the {self.loss} loss (it uses one log-prob per token)")
        for name in ("temperature", "sample_temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def policy_gradient(self) -> bool:
        return self.loss == "sampled_token"


def kl(loga_N_C: torch.Tensor, logb_N_C: torch.Tensor) -> torch.Tensor:
    """``KL(a || b) = sum_c a_c (log a_c - log b_c)`` from log-probabilities (finite), per row: ``[N]``."""
    return (loga_N_C.exp() * (loga_N_C - logb_N_C)).sum(-1)


def _log_mix(logp_N_C: torch.Tensor, logq_N_C: torch.Tensor, w: float) -> torch.Tensor:
    """``log(w p + (1 - w) q)`` for 0 < w < 1."""
    return torch.logaddexp(logp_N_C + math.log(w), logq_N_C + math.log1p(-w))


def divergence(
    logq_N_C: torch.Tensor,
    logp_N_C: torch.Tensor,
    loss: str,
    beta: float = 0.5,
    alpha: float = 0.1,
    stop_grad: bool = False,
) -> torch.Tensor:
    """One of the full divergences of the module docstring between the student's and the teacher's log-distributions
    over C categories, per row (``[N]``). The teacher side is always detached."""
    logp_N_C = logp_N_C.detach()
    if loss == "reverse_kl":
        if stop_grad:
            return (logq_N_C.exp() * (logq_N_C - logp_N_C).detach()).sum(-1)
        return kl(logq_N_C, logp_N_C)
    if loss == "forward_kl":
        return kl(logp_N_C, logq_N_C)
    if loss == "jsd":
        if beta == 0.0:
            return kl(logp_N_C, logq_N_C)
        if beta == 1.0:
            return kl(logq_N_C, logp_N_C)
        logm_N_C = _log_mix(logp_N_C, logq_N_C, beta)
        return beta * kl(logp_N_C, logm_N_C) + (1.0 - beta) * kl(logq_N_C, logm_N_C)
    if loss in ("skew_kl", "skew_reverse_kl") and alpha == 1.0:
        return (logq_N_C * 0.0).sum(-1)  # KL(a || a) = 0, with a (zero) gradient path to the student
    if loss == "skew_kl":
        return kl(logp_N_C, logq_N_C if alpha == 0.0 else _log_mix(logp_N_C, logq_N_C, alpha))
    if loss == "skew_reverse_kl":
        return kl(logq_N_C, logp_N_C if alpha == 0.0 else _log_mix(logq_N_C, logp_N_C, alpha))
    raise ValueError(f"{loss!r} is not a full-distribution divergence; known: {list(LOSSES[:-2])}")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate at both ends (Maechler's switch at ``-ln 2``)."""
    x = x.clamp(max=_MAX_TOPK_LOGMASS)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def topk_log_probs(
    logq_N_V: torch.Tensor,
    logp_N_K: torch.Tensor,
    idx_N_K: torch.Tensor,
    support: str = "tail",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's and teacher's log-distributions over a top-k support (``[N, K]`` token ids ``idx_N_K`` with the
    teacher's log-probs ``logp_N_K`` there, which is all a served teacher has to return).

    ``tail`` appends the bucket ``log(1 - sum_k prob)`` to each side (``[N, K + 1]``), ``renormalize`` renormalises
    over the K tokens, ``truncate`` returns the raw ``[N, K]`` values.
    """
    logq_N_K = logq_N_V.gather(-1, idx_N_K)
    if support == "truncate":
        return logq_N_K, logp_N_K
    if support == "renormalize":
        return (logq_N_K - logq_N_K.logsumexp(-1, keepdim=True), logp_N_K - logp_N_K.logsumexp(-1, keepdim=True))
    if support == "tail":
        tail_q_N_1 = log1mexp(logq_N_K.logsumexp(-1, keepdim=True))
        tail_p_N_1 = log1mexp(logp_N_K.logsumexp(-1, keepdim=True))
        return torch.cat([logq_N_K, tail_q_N_1], -1), torch.cat([logp_N_K, tail_p_N_1], -1)
    raise ValueError(f"unknown top_k_support {support!r}; known: {list(get_args(TopKSupport))}")


def token_divergence(student_logits_N_V: torch.Tensor, teacher_logits_N_V: torch.Tensor, obj: Objective) -> torch.Tensor:
    """The objective's divergence at each of N positions from raw logits (fp32, divergence temperature applied,
    top-k support selected without gradient). Returns ``div_N``."""
    logq_N_V = F.log_softmax(student_logits_N_V.float() / obj.temperature, dim=-1)
    logp_N_V = F.log_softmax(teacher_logits_N_V.detach().float() / obj.temperature, dim=-1)
    if obj.top_k:
        k = min(obj.top_k, logq_N_V.shape[-1])
        source_N_V = logp_N_V if obj.top_k_source == "teacher" else logq_N_V.detach()
        idx_N_K = source_N_V.topk(k, dim=-1).indices
        logq_N_V, logp_N_V = topk_log_probs(logq_N_V, logp_N_V.gather(-1, idx_N_K), idx_N_K, obj.top_k_support)
    return divergence(logq_N_V, logp_N_V, obj.loss, obj.beta, obj.alpha, obj.top_k_stop_grad)


def policy_gradient_loss(
    logq_N: torch.Tensor,
    logq_old_N: torch.Tensor,
    adv_N: torch.Tensor,
    correction: str = "clip",
    clip_eps: float = 0.2,
    ratio_cap: float = 2.0,
) -> torch.Tensor:
    """Per-token policy-gradient loss for sampled tokens with advantages ``adv_N`` (detached here) and the importance
    ratio ``r = q_theta(x) / q_old(x)`` correcting rollouts from a stale policy:

    - ``clip`` (PPO): ``-min(r a, clip(r, 1 - eps, 1 + eps) a)``;
    - ``truncate`` (truncated IS): ``-min(r, cap) a``, with gradient ``-min(r, cap) a grad log q``;
    - ``none``: ``-r a``.

    On-policy (``q_old = q_theta``) every form has the gradient ``-a grad log q(x)``. Returns ``loss_N``.
    """
    adv_N = adv_N.detach()
    ratio_N = torch.exp(logq_N - logq_old_N.detach())
    if correction == "clip":
        return -torch.minimum(ratio_N * adv_N, ratio_N.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv_N)
    if correction == "truncate":
        return -(ratio_N.clamp(max=ratio_cap) / ratio_N).detach() * ratio_N * adv_N
    if correction == "none":
        return -ratio_N * adv_N
    raise ValueError(f"unknown correction {correction!r}; known: {list(get_args(Correction))}")


def sampled_token_advantage(logp_N: torch.Tensor, logq_old_N: torch.Tensor) -> torch.Tensor:
    """``a_t = sg(log p(x_t) - log q_old(x_t))``: minus the one-sample estimate of the reverse KL at position t."""
    return (logp_N - logq_old_N).detach()


class ExtrapolatedHead(torch.nn.Module):
    """Reward extrapolation (generalized OPD, ExOPD, arXiv 2602.12125) as a teacher head. OPD is KL-regularised RL
    with the dense reward ``log p_T(x) - log p_ref(x)``; scaling that reward by ``scale`` makes the optimal policy

        pi*(x) ∝ p_ref(x) * (p_T(x) / p_ref(x)) ** scale,   i.e. logits  scale * log p_T + (1 - scale) * log p_ref

    so every objective of the menu (full, top-k or sampled-token) targets ``pi*`` when this head replaces the
    teacher's. ``scale = 1`` is the teacher itself; ``scale > 1`` pushes past it, away from the reference.

    Input: the teacher's and the reference's hidden states concatenated on the last axis ``[..., Ht + Hr]``.
    ``vocab_size`` (the tokenizer's, ``len(tok)``): both heads' logits are cut to it before their log-softmax, since
    either model's head may be padded past the real vocabulary (to a multiple of 64 or 128), each its own way."""

    def __init__(self, teacher_head: Head, reference_head: Head, teacher_width: int, scale: float,
                 vocab_size: int | None = None):
        super().__init__()
        self.teacher_head, self.reference_head = teacher_head, reference_head
        self.teacher_width, self.scale, self.vocab_size = teacher_width, scale, vocab_size

    def forward(self, hidden_N_H: torch.Tensor) -> torch.Tensor:
        V = self.vocab_size
        h_t_N_H = head_input(self.teacher_head, hidden_N_H[..., : self.teacher_width])
        h_r_N_H = head_input(self.reference_head, hidden_N_H[..., self.teacher_width:])
        logp_t_N_V = F.log_softmax(self.teacher_head(h_t_N_H)[..., :V].float(), dim=-1)
        logp_r_N_V = F.log_softmax(self.reference_head(h_r_N_H)[..., :V].float(), dim=-1).to(logp_t_N_V.device)
        return self.scale * logp_t_N_V + (1.0 - self.scale) * logp_r_N_V


def head_input(head: Head, hidden_N_H: torch.Tensor) -> torch.Tensor:
    """``hidden_N_H`` on ``head``'s device and in its weights' dtype (a teacher and a reference may sit on different
    devices, in different dtypes, their hidden states concatenated in fp32); unchanged for a head without weights."""
    weight = next(iter(head.parameters()), None) if isinstance(head, torch.nn.Module) else None
    return hidden_N_H if weight is None else hidden_N_H.to(device=weight.device, dtype=weight.dtype)


# Diagnostics summed per sequence by :func:`chunked_objective` (all at the divergence temperature, no gradient).
DIAGNOSTICS: tuple[str, ...] = ("student_entropy", "teacher_entropy", "teacher_nll", "topk_overlap")
DIAG_TOP_K = 8


def token_diagnostics(logq_N_V: torch.Tensor, logp_N_V: torch.Tensor, targets_N: torch.Tensor | None) -> torch.Tensor:
    """Per-position health signals ``[N, 4]`` (see :data:`DIAGNOSTICS`): the student's and the teacher's entropies
    ``-sum q log q`` and ``-sum p log p`` (their gap shows a student collapsing or staying too diffuse), the
    teacher's NLL ``-log p(x)`` of the token the sequence actually has (a teacher out of its depth on the student's
    states shows here; 0 when no targets are given), and the overlap ``|top_k(q) & top_k(p)| / k`` of the two top-8
    sets."""
    with torch.no_grad():
        h_q_N = -(logq_N_V.exp() * logq_N_V).sum(-1)
        h_p_N = -(logp_N_V.exp() * logp_N_V).sum(-1)
        nll_N = torch.zeros_like(h_q_N) if targets_N is None else -logp_N_V.gather(-1, targets_N[:, None]).squeeze(-1)
        k = min(DIAG_TOP_K, logq_N_V.shape[-1])
        top_q_N_K = logq_N_V.topk(k, dim=-1).indices
        top_p_N_K = logp_N_V.topk(k, dim=-1).indices
        overlap_N = (top_q_N_K[:, :, None] == top_p_N_K[:, None, :]).any(-1).float().mean(-1)
        return torch.stack([h_q_N, h_p_N, nll_N, overlap_N], dim=-1)


@dataclass
class ObjectiveResult:
    """``loss`` is the weighted sum over masked tokens / normalizer; the ``*_B`` sums are per sequence (detached):
    the objective's own per-token values and, as a diagnostic every objective logs, the full-vocabulary reverse KL at
    the divergence temperature; ``diagnostics_B_4`` sums :func:`token_diagnostics` over each sequence's tokens."""

    loss: torch.Tensor
    loss_sum_B: torch.Tensor
    reverse_kl_sum_B: torch.Tensor
    tokens_B: torch.Tensor
    diagnostics_B_4: torch.Tensor | None = None
    # Each sequence's share of ``loss`` (with the gradient: ``loss == loss_B.sum()``) and its per-token values'
    # squares summed (detached): what per-route signal normalisation (:func:`spread_scales`) rescales and measures.
    loss_B: torch.Tensor | None = None
    loss_sq_sum_B: torch.Tensor | None = None


@dataclass
class TokenInputs:
    """Per-position inputs the policy-gradient terms need, aligned with the hidden positions ``[B, T]``: the token
    each position predicts, its behaviour log-prob at the sampling temperature and the old policy's log-prob at the
    divergence temperature (the same tensor when the temperatures are equal)."""

    targets_B_T: torch.Tensor
    logq_behaviour_B_T: torch.Tensor
    logq_old_B_T: torch.Tensor


def chunked_objective(
    student_hidden_B_T_H: torch.Tensor,
    teacher_hidden_B_T_Ht: torch.Tensor,
    student_head: Head,
    teacher_head: Head,
    mask_B_T: torch.Tensor,
    obj: Objective,
    tokens: TokenInputs | None = None,
    seq_adv_B: torch.Tensor | None = None,
    weight_B: torch.Tensor | None = None,
    chunk_size: int = 64,
    normalizer: float | None = None,
    targets_B_T: torch.Tensor | None = None,
    vocab_size: int | None = None,
) -> ObjectiveResult:
    """The objective summed over masked positions, computed chunk by chunk along T:

        loss = sum_{b,t} w[b] * m[b,t] * l[b,t] / normalizer

    with ``l`` the per-token divergence (:func:`token_divergence`) for full-distribution losses, ``-log q(x)`` of
    the target token for ``sft`` (needs ``targets_B_T``), or the policy-gradient loss with advantage ``a[b,t] = sg(log p - log q_old) + seq_adv[b]`` for ``sampled_token``. A
    full-distribution loss with ``seq_adv_B`` (the verifier reward, GKD+RL) adds the policy-gradient term with
    advantage ``seq_adv[b]``. ``normalizer`` defaults to the number of masked positions; ``weight_B`` (per-route
    weights) to 1. ``targets_B_T`` (the token each position predicts; else ``tokens.targets_B_T`` if given) feeds
    the teacher-NLL diagnostic.

    Shapes: hidden states ``[B, T, H]`` (the teacher's width may differ), heads map ``[..., H] -> [..., V]``,
    ``mask_B_T`` 0/1. ``vocab_size`` (the tokenizer's, ``len(tok)``) cuts both heads' logits to ids ``[0, V)``
    before any softmax: a checkpoint's head may be padded past its tokenizer (``config.vocab_size`` a multiple of 64
    or 128), and student and teacher padded differently; the padding is no token, so it takes no probability. None
    keeps the heads' own widths (which must then agree). Each chunk's logits are recomputed in the backward pass
    (activation checkpointing), so neither model's ``[B, T, V]`` fp32 logits exist whole: peak extra memory is
    ``O(B * chunk_size * V)``. The teacher runs under ``no_grad``; the gradient flows only through the student's
    hidden states and head.
    """
    if student_hidden_B_T_H.shape[:2] != mask_B_T.shape or teacher_hidden_B_T_Ht.shape[:2] != mask_B_T.shape:
        raise ValueError(
            f"shape mismatch: student {tuple(student_hidden_B_T_H.shape)}, teacher {tuple(teacher_hidden_B_T_Ht.shape)},"
            f" mask {tuple(mask_B_T.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    needs_tokens = obj.policy_gradient or seq_adv_B is not None
    if obj.loss == "sft" and targets_B_T is None and tokens is None:
        raise ValueError("loss 'sft' needs the target tokens (targets_B_T)")
    if needs_tokens and tokens is None:
        raise ValueError(f"loss {obj.loss!r} with a sequence advantage needs TokenInputs (targets and old log-probs)")
    # Everything meets on the student's device (masks, weights and token inputs may come from the CPU); the teacher's
    # logits are moved there chunk by chunk.
    device = student_hidden_B_T_H.device
    mask_B_T = mask_B_T.to(device=device, dtype=torch.float32)
    B, T = mask_B_T.shape
    weight_B = mask_B_T.new_ones(B) if weight_B is None else weight_B.to(mask_B_T)
    seq_adv_B = mask_B_T.new_zeros(B) if seq_adv_B is None else seq_adv_B.to(mask_B_T)

    targets_B_T = tokens.targets_B_T if targets_B_T is None and tokens is not None else targets_B_T
    targets_B_T = None if targets_B_T is None else targets_B_T.to(device)
    if tokens is not None:
        tokens = TokenInputs(*(t.to(device) for t in (tokens.targets_B_T, tokens.logq_behaviour_B_T,
                                                      tokens.logq_old_B_T)))

    def chunk(hs_B_C_H, ht_B_C_H, m_B_C, tgt_B_C, *tok_B_C):
        # The teacher's head in its own dtype (a student's autocast must not lower an fp32 teacher's precision), then
        # fp32 on the student's device; both sides' log-softmax and every difference below are fp32.
        with torch.no_grad(), torch.autocast(ht_B_C_H.device.type, enabled=False):
            zt_B_C_V = teacher_head(ht_B_C_H)[..., :vocab_size].float().to(device)
        zs_B_C_V = student_head(hs_B_C_H)[..., :vocab_size].float()
        logq_B_C_V = F.log_softmax(zs_B_C_V / obj.temperature, dim=-1)
        logp_B_C_V = F.log_softmax(zt_B_C_V / obj.temperature, dim=-1)
        rkl_B_C = kl(logq_B_C_V.detach(), logp_B_C_V)
        diag_N_4 = token_diagnostics(logq_B_C_V.detach().flatten(0, 1), logp_B_C_V.flatten(0, 1),
                                     None if tgt_B_C is None else tgt_B_C.flatten())
        diag_B_4 = (diag_N_4.view(*m_B_C.shape, -1) * m_B_C[..., None]).sum(1)
        if obj.policy_gradient:
            per_tok_B_C = torch.zeros_like(m_B_C)
        elif obj.loss == "sft":
            per_tok_B_C = -logq_B_C_V.gather(-1, tgt_B_C[..., None]).squeeze(-1)
        else:
            per_tok_B_C = token_divergence(zs_B_C_V.flatten(0, 1), zt_B_C_V.flatten(0, 1), obj).view(m_B_C.shape)
        if needs_tokens:
            targets_B_C, logq_beh_B_C, logq_old_B_C = tok_B_C
            # Padding may hold -inf log-probs; masked positions must not turn the gradient into NaN.
            logq_beh_B_C = logq_beh_B_C.masked_fill(m_B_C == 0, 0.0)
            logq_old_B_C = logq_old_B_C.masked_fill(m_B_C == 0, 0.0)
            adv_B_C = seq_adv_B[:, None].expand_as(m_B_C)
            if obj.policy_gradient:
                logp_x_B_C = logp_B_C_V.gather(-1, targets_B_C[..., None]).squeeze(-1)
                adv_B_C = adv_B_C + sampled_token_advantage(logp_x_B_C, logq_old_B_C)
            logq_x_B_C = F.log_softmax(zs_B_C_V / obj.sample_temperature, dim=-1).gather(-1, targets_B_C[..., None]).squeeze(-1)
            per_tok_B_C = per_tok_B_C + policy_gradient_loss(
                logq_x_B_C, logq_beh_B_C, adv_B_C, obj.correction, obj.clip_eps, obj.ratio_cap
            )
        return ((per_tok_B_C * m_B_C).sum(-1), (rkl_B_C * m_B_C).sum(-1), diag_B_4,
                (per_tok_B_C.detach() ** 2 * m_B_C).sum(-1))

    loss_sum_B = mask_B_T.new_zeros(B)
    rkl_sum_B = mask_B_T.new_zeros(B)
    diag_sum_B_4 = mask_B_T.new_zeros(B, len(DIAGNOSTICS))
    sq_sum_B = mask_B_T.new_zeros(B)
    for start in range(0, T, chunk_size):
        sl = slice(start, min(start + chunk_size, T))
        m_B_C = mask_B_T[:, sl]
        if not bool(m_B_C.any()):
            continue
        args = [student_hidden_B_T_H[:, sl], teacher_hidden_B_T_Ht[:, sl].detach(), m_B_C,
                None if targets_B_T is None else targets_B_T[:, sl]]
        if needs_tokens:
            args += [tokens.targets_B_T[:, sl], tokens.logq_behaviour_B_T[:, sl], tokens.logq_old_B_T[:, sl]]
        if torch.is_grad_enabled() and student_hidden_B_T_H.requires_grad:
            # The chunk draws no random numbers: preserving torch's RNG state would only save and restore the global
            # generator during backward, rewinding the draws of an overlapped rollout thread sampling meanwhile.
            l_B, r_B, d_B_4, q_B = checkpoint(chunk, *args, use_reentrant=False, preserve_rng_state=False)
        else:
            l_B, r_B, d_B_4, q_B = chunk(*args)
        loss_sum_B = loss_sum_B + l_B
        sq_sum_B = sq_sum_B + q_B.detach()
        rkl_sum_B = rkl_sum_B + r_B.detach()
        diag_sum_B_4 = diag_sum_B_4 + d_B_4.detach()
    tokens_B = mask_B_T.sum(-1)
    denom = float(normalizer) if normalizer is not None else max(float(tokens_B.sum()), 1.0)
    loss_B = loss_sum_B * weight_B / denom
    return ObjectiveResult(
        loss=loss_B.sum(),
        loss_sum_B=loss_sum_B.detach(),
        reverse_kl_sum_B=rkl_sum_B,
        tokens_B=tokens_B,
        diagnostics_B_4=diag_sum_B_4,
        loss_B=loss_B,
        loss_sq_sum_B=sq_sum_B,
    )


def spread_scales(sums: dict[str, tuple[float, float, float]], clip: float) -> dict[str, float]:
    """Per-group signal normalisation (DN-MOPD's per-domain advantage normalisation): each group's (a route's, or a
    spec label value's) per-token signal is scaled by ``std(batch) / std(group)``, clipped to ``[1 / clip, clip]``,
    so that one group's large divergences do not drown the others' gradients. ``sums``: group -> (tokens, sum of the
    per-token values, sum of their squares); the batch's spread pools every group's tokens. A group with no spread (or
    a batch with none) keeps scale 1."""
    def std(n: float, s: float, q: float) -> float:
        return max(q / n - (s / n) ** 2, 0.0) ** 0.5 if n > 0 else 0.0

    whole = std(*(sum(v[i] for v in sums.values()) for i in range(3)))
    out = {}
    for group, (n, s, q) in sums.items():
        own = std(n, s, q)
        out[group] = min(max(whole / own, 1.0 / clip), clip) if own > 0 and whole > 0 else 1.0
    return out
