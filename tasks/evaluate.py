"""Greedy evaluation per route with the route's verifier, and retention = student accuracy / teacher accuracy."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.rollout import decode_responses, generate
from tasks.world import Route, verify


@dataclass(frozen=True)
class RouteScore:
    accuracy: float
    response_length: float  # mean tokens including EOS
    truncated: float  # fraction without EOS
    n: int


def evaluate_route(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    route: str,
    prompts: list[str],
    problems: list[str],
    max_new_tokens: int,
    batch_size: int = 256,
) -> RouteScore:
    """Greedy decoding on the route's held-out prompts; the verifier checks the final answer only."""
    r = Route.parse(route)
    correct, length, trunc = 0, 0.0, 0.0
    for s in range(0, len(prompts), batch_size):
        ro = generate(model, tok, prompts[s:s + batch_size], max_new_tokens, greedy=True)
        texts = decode_responses(tok, ro)
        correct += sum(verify(r, p, t) for p, t in zip(problems[s:s + batch_size], texts))
        length += float(ro.response_lengths_B.float().sum())
        trunc += float(ro.truncated_B.float().sum())
    n = len(prompts)
    return RouteScore(correct / n, length / n, trunc / n, n)


def evaluate_routes(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    eval_sets: dict[str, tuple[list[str], list[str]]],
    max_new_tokens: int,
) -> dict[str, RouteScore]:
    """``eval_sets``: route -> (prompts, problems)."""
    return {r: evaluate_route(model, tok, r, p, q, max_new_tokens) for r, (p, q) in eval_sets.items()}


def retention(student_acc: float, teacher_acc: float) -> float:
    """Student score / specialist score on the same prompts and verifier (0 when the teacher scores 0)."""
    return student_acc / teacher_acc if teacher_acc > 0 else 0.0
