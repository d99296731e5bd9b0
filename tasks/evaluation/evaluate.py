"""Greedy evaluation per route with the route's verifier (from its spec, :mod:`tasks.specs.prompt_set`), and retention =
student accuracy / teacher accuracy."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.modeling.rollout import cap_responses, decode_responses, eos_ids, generate, strip_stop
from tasks.specs.verifiers import Verifier


def verdicts(verify: Verifier, texts: list[str], answers: list[str], prompts: list[str]) -> list[float]:
    """The verifier's score of each completion against its reference (the row it sees: prompt and answer)."""
    return [verify(t, a, {"prompt": p, "answer": a}) for t, a, p in zip(texts, answers, prompts)]


def right(verify: Verifier, texts: list[str], answers: list[str], prompts: list[str]) -> list[bool]:
    """Accuracy's verdict: a completion is right only at a full score (partial credit is not accuracy)."""
    return [score >= 1.0 for score in verdicts(verify, texts, answers, prompts)]


@dataclass(frozen=True)
class RouteScore:
    accuracy: float
    response_length: float  # mean tokens including EOS
    truncated: float  # fraction without EOS
    n: int
    exact: float | None = None  # share of responses in the route's exact format (VerifySpec.build_exact); None: not asked


def _score(verify: Verifier, texts: list[str], answers: list[str], prompts: list[str],
           exact: Verifier | None) -> tuple[int, int]:
    """Right answers by the verifier, and by the exact-format check (0 without one)."""
    return sum(right(verify, texts, answers, prompts)), (sum(right(exact, texts, answers, prompts)) if exact else 0)


def evaluate_route(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    verify: Verifier,
    prompts: list[str],
    answers: list[str],
    max_new_tokens: int,
    batch_size: int = 256,
    stop: Sequence[str] = (),
    exact: Verifier | None = None,
) -> RouteScore:
    """Greedy decoding on a route's held-out prompts, each response ended at EOS or at one of the route's ``stop``
    strings; ``verify`` (the route's verifier) checks each response against its reference answer, and ``exact``
    (its exact-format check, when given) gives :attr:`RouteScore.exact` beside it."""
    correct, in_format, length, trunc = 0, 0, 0.0, 0.0
    for s in range(0, len(prompts), batch_size):
        chunk = list(prompts[s:s + batch_size])
        stops = [tuple(stop)] * len(chunk)
        ro = generate(model, tok, chunk, max_new_tokens, greedy=True, stop=stops)
        texts = decode_responses(tok, ro, stops)
        ok, fmt = _score(verify, texts, list(answers[s:s + batch_size]), chunk, exact)
        correct, in_format = correct + ok, in_format + fmt
        length += float(ro.response_lengths_B.float().sum())
        trunc += float(ro.truncated_B.float().sum())
    n = len(prompts)
    return RouteScore(correct / n, length / n, trunc / n, n, in_format / n if exact else None)


def evaluate_teacher(teacher, tok: PreTrainedTokenizerBase, verify: Verifier, rows: list, answers: list[str],
                     max_new_tokens: int, stop: Sequence[str] = (), exact: Verifier | None = None) -> RouteScore:
    """A teacher's greedy accuracy on held-out rows (:class:`tasks.specs.render.RowText` s), through the teacher
    interface: a teacher that reads the student's tokens (its ``model``) is evaluated as the student is; one that
    reads its own text answers in its own template and tokens (``answer``; lengths in its tokens), its text read up
    to the route's first ``stop`` string."""
    prompts = [r.prompt for r in rows]
    if teacher.model is not None:
        return evaluate_route(teacher.model, tok, verify, prompts, answers, max_new_tokens, stop=stop, exact=exact)
    texts, lengths, truncated = teacher.answer(rows, max_new_tokens)
    texts = [strip_stop(t, stop) for t in texts]
    n = max(len(rows), 1)
    ok, fmt = _score(verify, texts, list(answers), prompts, exact)
    return RouteScore(ok / n, sum(lengths) / n, sum(truncated) / n, len(rows), fmt / n if exact else None)


def evaluate_routes(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    eval_sets: dict[str, tuple[list[str], list[str]]],
    max_new_tokens: int | dict[str, int],
    verifiers: Mapping[str, Verifier],
    stops: Mapping[str, Sequence[str]] | None = None,
    exact: Mapping[str, Verifier] | None = None,
) -> dict[str, RouteScore]:
    """``eval_sets``: route -> (prompts, answers); ``max_new_tokens`` one cap or a cap per route; ``verifiers``:
    route -> its verifier; ``stops``: route -> its stop strings; ``exact``: route -> its exact-format check."""
    caps = max_new_tokens if isinstance(max_new_tokens, dict) else {r: max_new_tokens for r in eval_sets}
    return {r: evaluate_route(model, tok, verifiers[r], p, a, caps[r], stop=(stops or {}).get(r, ()),
                              exact=(exact or {}).get(r)) for r, (p, a) in eval_sets.items()}


def evaluate_prompt_set(model: PreTrainedModel, tok: PreTrainedTokenizerBase, ps,
                        eval_sets: dict[str, tuple[list[str], list[str]]] | None = None) -> dict[str, RouteScore]:
    """:func:`evaluate_routes` on a prompt set's held-out prompts (or ``eval_sets``), as its spec says: each route's
    cap, stop strings, verifier and exact-format check."""
    return evaluate_routes(model, tok, ps.eval_sets() if eval_sets is None else eval_sets, ps.caps(), ps.verifiers,
                           ps.stops(), ps.exact_verifiers)


def derail(tok: PreTrainedTokenizerBase, completion: str, answer: str, rng: random.Random) -> tuple[str, str] | None:
    """One wrong step in a gold ``completion``: ``(prefix, rest)``, the prefix being its trace (the text before its
    final ``answer``) cut at a random token with that token replaced by another token of the completion, and
    ``rest`` the gold text after the replaced token (the right way on). None when the completion does not end in its
    answer or has no trace of two tokens or more to derail (a bare answer)."""
    if not answer or not completion.endswith(answer):
        return None
    trace_ids = tok(completion[: len(completion) - len(answer)], add_special_tokens=False).input_ids
    if len(trace_ids) < 2:
        return None
    pos = rng.randrange(len(trace_ids) - 1)  # never the trace's last token (the separator before the answer)
    others = sorted(set(tok(completion, add_special_tokens=False).input_ids) - {trace_ids[pos]})
    if not others:
        return None
    return tok.decode(trace_ids[:pos] + [rng.choice(others)]), completion[len(tok.decode(trace_ids[:pos + 1])):]


def inject_error(tok: PreTrainedTokenizerBase, completion: str, answer: str, rng: random.Random) -> str | None:
    """The prefix of :func:`derail`: a gold completion's trace cut at one wrong step (None: nothing to derail)."""
    out = derail(tok, completion, answer, rng)
    return None if out is None else out[0]


def recovery_rate(model: PreTrainedModel, tok: PreTrainedTokenizerBase, verify: Verifier, prompts: list[str],
                  answers: list[str], completions: list[str], max_new_tokens: int, seed: int = 0) -> float | None:
    """The recovery diagnostic: from each gold completion's prefix with one injected error (:func:`inject_error`,
    seeded per row so every model sees the same errors), the share of the model's greedy continuations whose whole
    completion (prefix + continuation) the verifier still passes. A teacher that only learnt gold traces derails with
    the error; one that knows how to go on from a mistake recovers, which is what on-policy distillation draws on.
    None when no row has a trace to derail."""
    rows = [(p, a, e) for i, (p, a, c) in enumerate(zip(prompts, answers, completions))
            if (e := inject_error(tok, c, a, random.Random(seed * 1_000_003 + i))) is not None]
    if not rows:
        return None
    # Each prefix leaves its own budget under the route's cap: one batch generated to the largest, each row cut to
    # its own (greedy decoding of a row does not depend on the others).
    rooms = [max(max_new_tokens - len(tok(e, add_special_tokens=False).input_ids), 1) for _, _, e in rows]
    ro = cap_responses(generate(model, tok, [p + e for p, _, e in rows], max(rooms), greedy=True), rooms,
                       eos_ids(tok, model))
    texts = [e + t for (_, _, e), t in zip(rows, decode_responses(tok, ro))]
    return sum(right(verify, texts, [a for _, a, _ in rows], [p for p, _, _ in rows])) / len(rows)


@dataclass(frozen=True)
class GateResult:
    """The cold-start gate: per route, the fraction of sampled responses that end with EOS and the fraction that also
    have the route's shape (its spec's ``verify.format``)."""

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
    well_formed: Callable[[str, str], bool],
    temperature: float = 1.0,
) -> GateResult:
    """Sample the student as the on-policy stage will (at the sampling temperature) on each route's ``prompts`` and
    measure EOS and format compliance (``well_formed(route, text)``): reverse KL can only teach behaviour the student
    already samples."""
    eos, fmt = {}, {}
    for r, plist in prompts.items():
        ro = generate(model, tok, plist, caps[r], greedy=False, temperature=temperature)
        texts = decode_responses(tok, ro)
        ended_B = ~ro.truncated_B
        eos[r] = float(ended_B.float().mean())
        fmt[r] = sum(bool(e) and well_formed(r, t) for e, t in zip(ended_B, texts)) / len(plist)
    return GateResult(threshold, eos, fmt)


def retention(student_acc: float, teacher_acc: float) -> float:
    """Student score / specialist score on the same prompts and verifier (0 when the teacher scores 0)."""
    return student_acc / teacher_acc if teacher_acc > 0 else 0.0


def gain_recovered(student_acc: float, teacher_acc: float, base_acc: float) -> float | None:
    """The share of the specialist's gain over the base that the student kept: (student - base) / (teacher - base),
    on the same prompts and verifier; negative when the student ends below the base, None when the teacher gained
    nothing over the base (no gain to recover)."""
    gain = teacher_acc - base_acc
    return (student_acc - base_acc) / gain if gain > 0 else None


def retention_row(route: str, teacher: str, student_acc: float, teacher_acc: float,
                  base_acc: float | None) -> dict[str, Any]:
    """One route's row of a retention table (the merge's and the evaluate flow's, as
    :func:`tasks.tracking.runs.format_retention_table` prints them): the accuracies, :func:`retention` and
    :func:`gain_recovered`; ``base_acc`` None = no base measured (its gain recovered None too)."""
    return {"route": route, "teacher": teacher, "base_accuracy": base_acc, "teacher_accuracy": teacher_acc,
            "student_accuracy": student_acc, "retention": retention(student_acc, teacher_acc),
            "gain_recovered": None if base_acc is None else gain_recovered(student_acc, teacher_acc, base_acc)}


def teacher_metrics(metric: str, per_teacher: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """MLflow metrics of one measurement of every teacher of each route (``per_teacher``: route -> teacher name ->
    value): ``<metric>/<route>``, the best of the route's teachers (a route with several is measured against the best),
    and ``<metric>/<route>/<name>`` for each teacher of a route that has several. Routes with no value are left out."""
    best = {f"{metric}/{r}": max(values.values()) for r, values in per_teacher.items() if values}
    return best | {f"{metric}/{r}/{name}": v for r, values in per_teacher.items() if len(values) > 1
                   for name, v in values.items()}


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


def below_base(rows: Iterable[Mapping[str, Any]]) -> str:
    """The summary's warning when the merge left any route below its base (student accuracy < base accuracy on the
    same held-out prompts: a negative gain recovered, which a high retention can hide), naming each such route with
    both accuracies; empty when none is. Rows without a base accuracy (none measured) are skipped."""
    under = [f"{r['route']} (student {r['student_accuracy']:.3f} < base {r['base_accuracy']:.3f})" for r in rows
             if r["base_accuracy"] is not None and r["student_accuracy"] < r["base_accuracy"]]
    return f"warning: the student ended below its base on {len(under)} route(s): " + ", ".join(under) if under else ""


def label_means(per_route: Mapping[str, float], labels: Mapping[str, Mapping[str, str]]) -> dict[str, float]:
    """``{"<label>/<value>": mean}`` for every label a route spec gives (``domain``, ``budget``, ...): the
    :func:`route_mean` over the routes carrying that value, so "how much math did the merge keep" (``domain/math``)
    reads as directly as one route. Routes without the label are left out of its means."""
    groups: dict[str, list[float]] = {}
    for route, value in per_route.items():
        for key, label in sorted(labels.get(route, {}).items()):
            groups.setdefault(f"{key}/{label}", []).append(value)
    return {group: route_mean(values) for group, values in sorted(groups.items())}


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
    verify: Verifier,
    prompts: list[str],
    answers: list[str],
    max_new_tokens: int,
    k: int,
    n: int,
    temperature: float = 1.0,
) -> float:
    """Mean pass@k over ``prompts`` from ``n`` samples each at ``temperature`` (the route's verifier): whether the
    right answer is still within the student's reach when its greedy answer is wrong (diversity a collapse would
    lose)."""
    many = [p for p in prompts for _ in range(n)]
    ro = generate(model, tok, many, max_new_tokens, temperature=temperature)
    ok = right(verify, decode_responses(tok, ro), [a for a in answers for _ in range(n)], many)
    return sum(pass_at_k(n, sum(ok[i * n:(i + 1) * n]), k) for i in range(len(prompts))) / len(prompts)
