"""The built-in world: synthetic verifiable domains, reasoning budgets and prompt formatting.

A route is ``<domain>-<budget>``. The budget is part of the prompt (a tag token), so one student must learn to
answer directly (``low``) or write a short scratchpad before the answer (``high``). A completion is
``[scratchpad SEP] answer EOS``; verifiers look only at the text after the last separator.

Everything here is pure Python: no torch, no I/O.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

# Bump when a domain's generator, answer or scratchpad changes: cached prompt sets are keyed on it.
WORLD_VERSION = 3
BUDGETS: tuple[str, ...] = ("low", "high")
ANSWER_SEP = "|"
PROMPT_END = "="
ROUTE_RE = re.compile(r"^(?P<domain>[a-z][a-z0-9_]*)-(?P<budget>[a-z][a-z0-9_]*)$")


@dataclass(frozen=True, order=True)
class Route:
    """One prompt family: a domain at a reasoning budget, written ``domain-budget``."""

    domain: str
    budget: str

    @property
    def name(self) -> str:
        return f"{self.domain}-{self.budget}"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, text: str) -> "Route":
        """Parse ``"shift-high"``; raise ValueError naming the expected form otherwise."""
        m = ROUTE_RE.match(text.strip()) if isinstance(text, str) else None
        if m is None:
            raise ValueError(f"route {text!r} is not of the form '<domain>-<budget>' (for example 'shift-high')")
        return cls(m["domain"], m["budget"])


@dataclass(frozen=True)
class Domain:
    """A verifiable task family.

    ``sample(rng, min_len, max_len)`` draws a problem string; ``answer(problem)`` is the gold final answer;
    ``scratchpad(problem)`` is the working written at the ``high`` budget. ``min_len``/``max_len`` count the
    letters (shift, rev) or digits (sort) of a problem.
    """

    name: str
    sample: Callable[[random.Random, int, int], str]
    answer: Callable[[str], str]
    scratchpad: Callable[[str], str]
    problem_re: re.Pattern
    answer_re: re.Pattern


def _sample_shift(rng: random.Random, min_len: int, max_len: int) -> str:
    key = rng.randint(1, 3)
    return f"{key}:" + _sample_letters(LETTERS)(rng, min_len, max_len)


def _shift(letter: str, key: int) -> str:
    return LETTERS[(LETTERS.index(letter) + key) % 26]


def _answer_shift(problem: str) -> str:
    key, text = problem.split(":")
    return "".join(_shift(c, int(key)) for c in text)


def _scratch_shift(problem: str) -> str:
    """The rule first, as where ``a`` goes: 2:xyz -> ``a>c``."""
    return f"a>{_shift('a', int(problem.split(':')[0]))}"


def _sample_letters(alphabet: str) -> Callable[[random.Random, int, int], str]:
    def sample(rng: random.Random, min_len: int, max_len: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))

    return sample


def _scratch_sort(problem: str) -> str:
    """The count of each digit present, in order, e.g. 5203 -> ``0x1,2x1,3x1,5x1``."""
    return ",".join(f"{d}x{problem.count(d)}" for d in sorted(set(problem)))


LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"

DOMAINS: dict[str, Domain] = {
    "shift": Domain(
        name="shift",
        sample=_sample_shift,
        answer=_answer_shift,
        scratchpad=_scratch_shift,
        problem_re=re.compile(r"^[1-9]:[a-z]{1,40}$"),
        answer_re=re.compile(r"^[a-z]+$"),
    ),
    "rev": Domain(
        name="rev",
        sample=_sample_letters(LETTERS),
        answer=lambda p: p[::-1],
        scratchpad=lambda p: str(len(p)),
        problem_re=re.compile(r"^[a-z]{1,40}$"),
        answer_re=re.compile(r"^[a-z]+$"),
    ),
    "sort": Domain(
        name="sort",
        sample=_sample_letters(DIGITS),
        answer=lambda p: "".join(sorted(p)),
        scratchpad=_scratch_sort,
        problem_re=re.compile(r"^\d{1,40}$"),
        answer_re=re.compile(r"^\d+$"),
    ),
}

# Every character a prompt or completion of the built-in world can contain, besides special tokens.
CHARSET: str = "".join(sorted(set(DIGITS + LETTERS + "=|,:x>")))


def domain_of(route: Route) -> Domain:
    try:
        return DOMAINS[route.domain]
    except KeyError:
        raise ValueError(f"unknown domain {route.domain!r} in route {route.name!r}; known: {sorted(DOMAINS)}") from None


def check_route(route: Route) -> Route:
    """Validate a route against the built-in domains and budgets."""
    domain_of(route)
    if route.budget not in BUDGETS:
        raise ValueError(f"unknown budget {route.budget!r} in route {route.name!r}; known: {list(BUDGETS)}")
    return route


def all_routes() -> list[Route]:
    return [Route(d, b) for d in DOMAINS for b in BUDGETS]


def route_tags(route: Route) -> tuple[str, str]:
    """The two special tokens that name a route inside a prompt."""
    return f"<{route.domain}>", f"<{route.budget}>"


DEFAULT_TEMPLATE = "{bos}{domain}{budget}{problem}" + PROMPT_END
TEMPLATE_FIELDS = ("bos", "domain", "budget", "problem")


def check_template(template: str) -> str:
    """A prompt template: Python format fields from :data:`TEMPLATE_FIELDS` ({problem} required) and literal text
    the character tokenizer knows (:data:`CHARSET`), ending with the prompt terminator ``=``."""
    import string

    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"template {template!r}: {e}") from None
    fields, literal = set(), ""
    for text, name, spec, conv in parts:
        literal += text
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS:
            raise ValueError(f"template {template!r}: unknown field {{{name}}}; allowed: {list(TEMPLATE_FIELDS)}")
        if spec or conv:
            raise ValueError(f"template {template!r}: field {{{name}}} takes no format spec or conversion")
        fields.add(name)
    if "problem" not in fields:
        raise ValueError(f"template {template!r} must contain {{problem}}")
    bad = sorted(set(literal) - set(CHARSET))
    if bad:
        raise ValueError(f"template {template!r}: characters {bad} are not in the tokenizer's charset {CHARSET!r}")
    if not template.endswith(PROMPT_END):
        raise ValueError(f"template {template!r} must end with {PROMPT_END!r} (where the completion starts)")
    return template


def format_prompt(route: Route, problem: str, bos: str = "<bos>", template: str = DEFAULT_TEMPLATE) -> str:
    """``<bos><sort><high>5203=`` with the default template: what the student and every teacher see before the
    completion. A budget's template (``world.budget_templates``) may reword it, e.g. ``{bos}{domain}{problem}x=``."""
    d, b = route_tags(route)
    return template.format(bos=bos, domain=d, budget=b, problem=problem)


def gold_completion(route: Route, problem: str) -> str:
    """The reference completion text (without EOS) that specialists are fine-tuned on."""
    dom = domain_of(route)
    answer = dom.answer(problem)
    if route.budget == "high":
        return f"{dom.scratchpad(problem)}{ANSWER_SEP}{answer}"
    return answer


def extract_answer(completion: str) -> str:
    """The final answer: the text after the last separator; scratchpad text does not count."""
    return completion.rsplit(ANSWER_SEP, 1)[-1].strip()


def verify(route: Route, problem: str, completion: str) -> bool:
    """True when the completion's final answer is correct for the problem (computed from the problem itself)."""
    return extract_answer(completion) == domain_of(route).answer(problem)


def format_ok(route: Route, completion: str) -> bool:
    """True when a completion has the route's shape, right or wrong: at the ``high`` budget a non-empty scratchpad,
    one separator and an answer; at ``low`` the answer alone; the answer in the domain's alphabet."""
    dom = domain_of(route)
    if route.budget == "high":
        scratch, sep, answer = completion.partition(ANSWER_SEP)
        return bool(scratch) and bool(sep) and ANSWER_SEP not in answer and bool(dom.answer_re.match(answer))
    return bool(dom.answer_re.match(completion))


def sample_problems(route: Route, n: int, seed: int, min_len: int, max_len: int, exclude: set[str] | None = None) -> list[str]:
    """``n`` distinct problems for a route, deterministic in ``seed``; never one from ``exclude``."""
    dom = domain_of(route)
    rng = random.Random(f"{seed}/{route.name}")
    exclude = exclude or set()
    seen: set[str] = set()
    out: list[str] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"route {route.name}: only {len(out)} distinct problems of length {min_len}-{max_len} exist, {n} asked"
            )
        p = dom.sample(rng, min_len, max_len)
        if p in seen or p in exclude:
            continue
        seen.add(p)
        out.append(p)
    return out
