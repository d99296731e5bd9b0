"""Verifiers a route spec names (``verify.kind``): each turns (completion, reference, row) into a score in [0, 1],
1.0 for right. Accuracy counts a prompt right only at 1.0, so a verifier that gives partial credit is reported beside
the accuracy, never instead of it.

    exact     the completion's final answer equals the reference (whitespace-trimmed; ``case_sensitive``)
    numeric   both parse as numbers and differ by at most ``tolerance`` (absolute) or ``rel_tolerance``
    regex     ``pattern``'s ``group`` extracted from the completion (the last match), then compared exactly
    math      math-verify's parse + verify of the completion against the reference (LaTeX, fractions, sets, ...);
              on free text it reads the last number ("3 + 5 = 8, so 8." -> 8): an answer extractor, not a format check
    last_number  the last number in the completion (signed, decimals, thousands commas), compared as ``numeric``
              does: "8 + 5 = 13." -> 13; "To calculate 6 - 10 + 3, we need to add" -> 3 (never the question's
              expression evaluated: math-verify credits that one with -1)
    contains  the reference appears in the completion as a whole (not inside a longer word or number), wherever it
              stands: "The reversed list is: c, b, a." holds "c, b, a"
    function  ``module:function``, the user's own: imported (never eval-ed), called as
              ``fn(completion: str, reference: str, row: dict) -> bool | float``

``answer_after`` (e.g. ``"|"`` or ``"####"``) keeps only the text after its last occurrence before comparing, so a
scratchpad or chain of thought before the answer does not count against it.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Verifier = Callable[[str, str, Mapping[str, Any]], float]

_FUNCTION_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class VerifierError(ValueError):
    """A verifier spec that cannot be built (unknown function, bad pattern, missing package)."""


def final_answer(completion: str, answer_after: str = "") -> str:
    """The text a verifier compares: after the last ``answer_after`` (all of it when absent), trimmed."""
    if answer_after and answer_after in completion:
        completion = completion.rsplit(answer_after, 1)[1]
    return completion.strip()


def _number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def exact(case_sensitive: bool = True, answer_after: str = "") -> Verifier:
    def verify(completion: str, reference: str, row: Mapping[str, Any]) -> float:
        got, want = final_answer(completion, answer_after), str(reference).strip()
        return float(got == want if case_sensitive else got.casefold() == want.casefold())
    return verify


def numeric(tolerance: float = 1e-6, rel_tolerance: float = 0.0, answer_after: str = "") -> Verifier:
    def verify(completion: str, reference: str, row: Mapping[str, Any]) -> float:
        got, want = _number(final_answer(completion, answer_after)), _number(str(reference))
        if got is None or want is None:
            return 0.0
        return float(abs(got - want) <= max(tolerance, rel_tolerance * abs(want)))
    return verify


def regex(pattern: str, group: int | str = 1, case_sensitive: bool = True) -> Verifier:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise VerifierError(f"pattern {pattern!r} does not compile: {e}") from None
    if isinstance(group, int) and group > compiled.groups:
        raise VerifierError(f"pattern {pattern!r} has {compiled.groups} group(s); group {group} was asked for")
    if isinstance(group, str) and group not in compiled.groupindex:
        raise VerifierError(f"pattern {pattern!r} has no group named {group!r}")

    def verify(completion: str, reference: str, row: Mapping[str, Any]) -> float:
        matches = list(compiled.finditer(completion))
        if not matches:
            return 0.0
        got, want = (matches[-1].group(group) or "").strip(), str(reference).strip()
        return float(got == want if case_sensitive else got.casefold() == want.casefold())
    return verify


_NUMBER_RE = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(tolerance: float = 1e-6, rel_tolerance: float = 0.0, answer_after: str = "") -> Verifier:
    def verify(completion: str, reference: str, row: Mapping[str, Any]) -> float:
        found = _NUMBER_RE.findall(final_answer(completion, answer_after))
        got, want = (_number(found[-1]) if found else None), _number(str(reference))
        if got is None or want is None:
            return 0.0
        return float(abs(got - want) <= max(tolerance, rel_tolerance * abs(want)))
    return verify


def contains(case_sensitive: bool = True, answer_after: str = "") -> Verifier:
    def verify(completion: str, reference: str, row: Mapping[str, Any]) -> float:
        want = str(reference).strip()
        if not want:
            return 0.0
        pattern = rf"(?<![\w]){re.escape(want)}(?![\w])"
        flags = 0 if case_sensitive else re.IGNORECASE
        return float(re.search(pattern, final_answer(completion, answer_after), flags) is not None)
    return verify


def math_verify(answer_after: str = "") -> Verifier:
    try:
        from math_verify import parse, verify as mv_verify
    except ImportError:
        raise VerifierError("verify.kind 'math' needs the math-verify package: pip install math-verify") from None

    def verify(completion: str, reference: str, row: Mapping[str, Any]) -> float:
        gold = parse(str(reference))
        answer = parse(final_answer(completion, answer_after))
        return float(bool(gold) and bool(answer) and mv_verify(gold, answer))
    return verify


def function(target: str, folder: str | Path | None = None) -> Verifier:
    """The user's ``module:function`` (:func:`import_function`); its result is checked to be a bool or a number in
    [0, 1]."""
    fn = import_function(target, folder)

    def verify(completion: str, reference: str, row: Mapping[str, Any]) -> float:
        value = fn(completion, reference, row)
        if isinstance(value, bool) or (isinstance(value, (int, float)) and 0.0 <= float(value) <= 1.0):
            return float(value)
        raise VerifierError(f"verifier {target} returned {value!r}; expected a bool or a number in [0, 1]")
    return verify


def import_function(target: str, folder: str | Path | None = None) -> Callable:
    """The user's ``module:function`` (a verifier, a completion writer), imported, never eval-ed. A module whose file
    lies in ``folder`` (the spec's own folder: ``checks.py``, ``pkg/checks.py``) is loaded from that file, fresh at
    every build, so that an edited function is the one used and two specs' ``checks`` modules never shadow each
    other; any other module is imported as usual. :class:`VerifierError` when it cannot be."""
    if not _FUNCTION_RE.match(target):
        raise VerifierError(f"function {target!r}: expected 'module:function' (e.g. my_project.checks:is_right)")
    module_name, _, attr = target.partition(":")
    local = Path(folder).joinpath(*module_name.split(".")).with_suffix(".py") if folder else None
    try:
        if local is not None and local.is_file():
            spec = importlib.util.spec_from_file_location(f"_opd_verifier_{abs(hash(str(local)))}", local)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # an ImportError, or the user's module failing as it runs
        raise VerifierError(f"function {target!r}: module {module_name!r} does not import "
                            f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise VerifierError(f"function {target!r}: {module_name} has no callable {attr!r}")
    return fn
