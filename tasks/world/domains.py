"""The built-in world: synthetic verifiable domains, reasoning budgets and prompt formatting.

A route is ``<domain>-<budget>``. The budget is part of the prompt (a tag token), so one student must learn to
answer directly (``low``), write a short scratchpad before the answer (``high``), or write a step-by-step trace of
at least 40 characters (``long``) in which each step is computed from the one before, so that the answer depends on
every step. A completion is ``[scratchpad SEP] answer EOS``; verifiers look only at the text after the last separator.

Everything here is pure Python: no torch, no I/O.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable

# Bump when a domain's generator, answer or scratchpad changes: cached prompt sets are keyed on it.
WORLD_VERSION = 4
BUDGETS: tuple[str, ...] = ("low", "high", "long")
ANSWER_SEP = "|"
STEP_SEP = ","  # between the steps of a ``long`` trace
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
    ``scratchpad(problem)`` is the working written at the ``high`` budget. The ``long`` budget writes a trace run by
    a little state machine: ``start(problem)`` is the first step and ``advance(problem, step)`` computes the next
    step from the previous one alone (None after the last), so an error in one step carries into every later step;
    ``replay(steps)`` reads the answer off the trace (ValueError when the trace is unfinished). Every step matches
    ``step_re``. ``min_len``/``max_len`` count the letters (shift, rev, count) or digits (sort) of a problem.
    """

    name: str
    sample: Callable[[random.Random, int, int], str]
    answer: Callable[[str], str]
    scratchpad: Callable[[str], str]
    start: Callable[[str], str]
    advance: Callable[[str, str], str | None]
    replay: Callable[[list[str]], str]
    problem_re: re.Pattern
    answer_re: re.Pattern
    step_re: re.Pattern

    def steps(self, problem: str) -> list[str]:
        """The ``long`` trace of a problem: ``start``, then ``advance`` until it stops."""
        steps = [self.start(problem)]
        while (nxt := self.advance(problem, steps[-1])) is not None:
            steps.append(nxt)
        return steps


# Tape traces (shift, rev, count): a step is ``INPUT LEFT>OUTPUT SO FAR`` (count: ``TARGET:INPUT LEFT>COUNT``); each
# step takes one letter off the tape into the output, so the last step is ``>ANSWER`` (``TARGET:>ANSWER``) and every
# step is computed from the one before.


def _read_tape(steps: list[str]) -> str:
    rest, _, out = steps[-1].partition(">")
    if rest.rpartition(":")[2]:
        raise ValueError(f"the trace stops with {rest!r} still on the tape")
    return out


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


def _advance_shift(problem: str, step: str) -> str | None:
    """The first letter on the tape leaves it shifted, at the end of the output: 2:abz -> ``abz>,bz>c,z>cd,>cdb``."""
    return None if step.startswith(">") else step[1:] + _shift(step[0], int(problem.split(":")[0]))


def _advance_rev(problem: str, step: str) -> str | None:
    """The first letter on the tape goes to the front of the output: abc -> ``abc>,bc>a,c>ba,>cba``."""
    rest, _, out = step.partition(">")
    return f"{rest[1:]}>{rest[0]}{out}" if rest else None


def _start_sort(problem: str) -> str:
    return f"0x{problem.count('0')}>{problem.count('0')}"


def _advance_sort(problem: str, step: str) -> str | None:
    """Counting sort: the next digit value, its count, the running total of digits so far:
    5203 -> ``0x1>1,1x0>1,2x1>2,3x1>3,4x0>3,5x1>4,6x0>4,7x0>4,8x0>4,9x0>4``."""
    d = int(step[0]) + 1
    if d == 10:
        return None
    n = problem.count(str(d))
    return f"{d}x{n}>{int(step.partition('>')[2]) + n}"


def _replay_sort(steps: list[str]) -> str:
    """The sorted digits from the running totals: digit d appears (total after d - total before d) times."""
    if len(steps) != 10:
        raise ValueError(f"a counting trace has 10 steps, not {len(steps)}")
    out, before = [], 0
    for step in steps:
        total = int(step.partition(">")[2])
        if total < before:
            raise ValueError(f"running total goes down at step {step!r}")
        out.append(step[0] * (total - before))
        before = total
    return "".join(out)


def _sample_count(rng: random.Random, min_len: int, max_len: int) -> str:
    """The target letter, then letters from the same four: ``b:abcbbad``."""
    return f"{rng.choice(COUNT_LETTERS)}:" + _sample_letters(COUNT_LETTERS)(rng, min_len, max_len)


def _answer_count(problem: str) -> str:
    target, text = problem.split(":")
    return str(text.count(target))


def _scratch_count(problem: str) -> str:
    """The target, then one copy of it per occurrence (a tally): b:abcbbad -> ``b:bbb``."""
    target, text = problem.split(":")
    return f"{target}:{target * text.count(target)}"


def _advance_count(problem: str, step: str) -> str | None:
    """The first letter leaves the tape; the running count goes up when it is the target, which every step
    restates: b:abcb -> ``b:abcb>0,b:bcb>0,b:cb>1,b:b>1,b:>2``."""
    target, _, rest = step.partition(">")[0].partition(":")
    count = int(step.partition(">")[2])
    return f"{target}:{rest[1:]}>{count + (rest[0] == target)}" if rest else None


def _sample_letters(alphabet: str) -> Callable[[random.Random, int, int], str]:
    def sample(rng: random.Random, min_len: int, max_len: int) -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))

    return sample


def _scratch_sort(problem: str) -> str:
    """The count of each digit present, in order, e.g. 5203 -> ``0x1,2x1,3x1,5x1``."""
    return ",".join(f"{d}x{problem.count(d)}" for d in sorted(set(problem)))


LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
COUNT_LETTERS = "abcd"  # few letters, so that counts spread over 0..n

DOMAINS: dict[str, Domain] = {
    "shift": Domain(
        name="shift",
        sample=_sample_shift,
        answer=_answer_shift,
        scratchpad=_scratch_shift,
        start=lambda p: p.split(":")[1] + ">",
        advance=_advance_shift,
        replay=_read_tape,
        problem_re=re.compile(r"^[1-9]:[a-z]{1,40}$"),
        answer_re=re.compile(r"^[a-z]+$"),
        step_re=re.compile(r"^[a-z]*>[a-z]*$"),
    ),
    "rev": Domain(
        name="rev",
        sample=_sample_letters(LETTERS),
        answer=lambda p: p[::-1],
        scratchpad=lambda p: str(len(p)),
        start=lambda p: p + ">",
        advance=_advance_rev,
        replay=_read_tape,
        problem_re=re.compile(r"^[a-z]{1,40}$"),
        answer_re=re.compile(r"^[a-z]+$"),
        step_re=re.compile(r"^[a-z]*>[a-z]*$"),
    ),
    "sort": Domain(
        name="sort",
        sample=_sample_letters(DIGITS),
        answer=lambda p: "".join(sorted(p)),
        scratchpad=_scratch_sort,
        start=_start_sort,
        advance=_advance_sort,
        replay=_replay_sort,
        problem_re=re.compile(r"^\d{1,40}$"),
        answer_re=re.compile(r"^\d+$"),
        step_re=re.compile(r"^\dx\d+>\d+$"),
    ),
    # Counting: how many times the target letter occurs; the long trace keeps a running count.
    "count": Domain(
        name="count",
        sample=_sample_count,
        answer=_answer_count,
        scratchpad=_scratch_count,
        start=lambda p: p + ">0",
        advance=_advance_count,
        replay=_read_tape,
        problem_re=re.compile(r"^[a-d]:[a-d]{1,40}$"),
        answer_re=re.compile(r"^\d+$"),
        step_re=re.compile(r"^[a-d]:[a-d]*>\d+$"),
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
    """Every route of the built-in world (4 domains x 3 budgets), domain by domain."""
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


def scratchpad(route: Route, problem: str) -> str:
    """The working written before the answer: none at ``low``, the domain's short scratchpad at ``high``, the
    step-by-step trace at ``long``."""
    dom = domain_of(route)
    if route.budget == "long":
        return STEP_SEP.join(dom.steps(problem))
    return dom.scratchpad(problem) if route.budget == "high" else ""


def gold_completion(route: Route, problem: str) -> str:
    """The reference completion text (without EOS) that specialists are fine-tuned on."""
    answer = domain_of(route).answer(problem)
    work = scratchpad(route, problem)
    return f"{work}{ANSWER_SEP}{answer}" if work else answer


def extract_answer(completion: str) -> str:
    """The final answer: the text after the last separator; scratchpad text does not count."""
    return completion.rsplit(ANSWER_SEP, 1)[-1].strip()


def verify(route: Route, problem: str, completion: str) -> bool:
    """True when the completion's final answer is correct for the problem (computed from the problem itself)."""
    return extract_answer(completion) == domain_of(route).answer(problem)


def _bare(pattern: re.Pattern) -> str:
    return pattern.pattern.removeprefix("^").removesuffix("$")


def format_pattern(route: Route) -> str:
    """The regex a completion of the route's shape matches whole, right or wrong: at the ``high`` and ``long``
    budgets a non-empty scratchpad (at ``long``, steps of the domain's step format joined by ``,``), one separator
    and an answer; at ``low`` the answer alone; the answer in the domain's alphabet. (The route spec's
    ``verify.format``.)"""
    dom = domain_of(route)
    answer, sep = _bare(dom.answer_re), re.escape(ANSWER_SEP)
    if route.budget == "low":
        return answer
    if route.budget == "long":
        step = _bare(dom.step_re)
        return f"(?:{step})(?:{re.escape(STEP_SEP)}(?:{step}))*{sep}{answer}"
    return f"[^{sep}]+{sep}{answer}"


def format_ok(route: Route, completion: str) -> bool:
    """True when a completion has the route's shape (:func:`format_pattern`)."""
    return re.fullmatch(format_pattern(route), completion, re.DOTALL) is not None


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
