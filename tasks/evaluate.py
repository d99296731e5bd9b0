"""Greedy evaluation per route with the route's verifier, and retention = student accuracy / teacher accuracy."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.rollout import decode_responses, generate
from tasks.world import Route, format_ok, verify


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
    max_new_tokens: int | dict[str, int],
) -> dict[str, RouteScore]:
    """``eval_sets``: route -> (prompts, problems); ``max_new_tokens`` one cap or a cap per route."""
    caps = max_new_tokens if isinstance(max_new_tokens, dict) else {r: max_new_tokens for r in eval_sets}
    return {r: evaluate_route(model, tok, r, p, q, caps[r]) for r, (p, q) in eval_sets.items()}


@dataclass(frozen=True)
class GateResult:
    """The cold-start gate: per route, the fraction of sampled responses that end with EOS and the fraction that also
    have the route's format (:func:`tasks.world.format_ok`)."""

    threshold: float
    eos_rate: dict[str, float]
    format_rate: dict[str, float]

    @property
    def failing(self) -> list[str]:
        return [r for r in self.eos_rate if min(self.eos_rate[r], self.format_rate[r]) < self.threshold]

    @property
    def passed(self) -> bool:
        return not self.failing

    def describe(self) -> str:
        return ", ".join(
            f"{r} eos {self.eos_rate[r]:.2f} format {self.format_rate[r]:.2f}" for r in self.eos_rate
        ) + f" (threshold {self.threshold:.2f})"


def compliance_gate(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: dict[str, list[str]],
    caps: dict[str, int],
    threshold: float,
    temperature: float = 1.0,
) -> GateResult:
    """Sample the student as the on-policy stage will (at the sampling temperature) on each route's ``prompts`` and
    measure EOS and format compliance: reverse KL can only teach behaviour the student already samples."""
    eos, fmt = {}, {}
    for r, plist in prompts.items():
        ro = generate(model, tok, plist, caps[r], greedy=False, temperature=temperature)
        texts = decode_responses(tok, ro)
        ended_B = ~ro.truncated_B
        route = Route.parse(r)
        eos[r] = float(ended_B.float().mean())
        fmt[r] = sum(bool(e) and format_ok(route, t) for e, t in zip(ended_B, texts)) / len(plist)
    return GateResult(threshold, eos, fmt)


def retention(student_acc: float, teacher_acc: float) -> float:
    """Student score / specialist score on the same prompts and verifier (0 when the teacher scores 0)."""
    return student_acc / teacher_acc if teacher_acc > 0 else 0.0


def route_mean(per_route: Mapping[str, float] | Iterable[float]) -> float:
    """The mean over routes, each route counting once whatever its number of prompts: the one mean behind every
    ``<metric>/mean`` in MLflow, the tables' mean and the registered student's ``mean_retention``."""
    values = list(per_route.values() if isinstance(per_route, Mapping) else per_route)
    if not values:
        raise ValueError("a mean over no routes")
    return sum(values) / len(values)


def mean_retention(rows: Iterable[Mapping[str, Any]]) -> float:
    """:func:`route_mean` of the rows' ``retention`` (one row per route, as the merge and evaluate tables have)."""
    return route_mean(row["retention"] for row in rows)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` are right: ``1 - C(n-c, k) / C(n, k)``
    (Chen et al., 2021), computed as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def sampled_pass_at_k(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    route: str,
    prompts: list[str],
    problems: list[str],
    max_new_tokens: int,
    k: int,
    n: int,
    temperature: float = 1.0,
) -> float:
    """Mean pass@k over ``prompts`` from ``n`` samples each at ``temperature`` (route verifier): whether the right
    answer is still within the student's reach when its greedy answer is wrong (diversity a collapse would lose)."""
    r = Route.parse(route)
    ro = generate(model, tok, [p for p in prompts for _ in range(n)], max_new_tokens, temperature=temperature)
    right = [verify(r, q, t) for q, t in zip([q for q in problems for _ in range(n)], decode_responses(tok, ro))]
    return sum(pass_at_k(n, sum(right[i * n:(i + 1) * n]), k) for i in range(len(prompts))) / len(prompts)
