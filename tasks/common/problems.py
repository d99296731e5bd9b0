"""The vocabulary of refusals: a :class:`Problem` names the file, the field and what is wrong (and what was expected);
an :class:`InputError` carries every problem found, not only the first. The lowest module of the tree: specs, prompt
sets, the preflight and the CLI all speak it, and it imports nothing of theirs."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

CONFIG = "config"  # the ``file`` of a problem in a flow's parameters (command line, prefect.yaml or the UI form)


@dataclass(frozen=True)
class Problem:
    """One bad input: ``file`` holds it, ``field`` names where in it, ``message`` says what is wrong and what was
    expected."""

    file: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.field}: {self.message}"


class UserError(Exception):
    """A refusal of what the user asked that the command lines print as one line, without a traceback (e.g.
    :class:`teachers.registry.RegistryError`)."""


class InputError(ValueError):
    """Bad input found before any model work; ``problems`` lists every one found, not only the first."""

    def __init__(self, problems: Iterable[Problem], what: str = "input"):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s) in the {what}, refused before any model work:\n{lines}")


def validation_problems(err: ValidationError, file: str = CONFIG,
                        field_of: Callable[[tuple], str] | None = None) -> list[Problem]:
    """One :class:`Problem` per pydantic error: the field (dotted, or as ``field_of(loc)`` names it), the message
    and the value given; without the link to pydantic's docs that ``str(err)`` ends each error with."""
    problems = []
    for e in err.errors():
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, InputError):  # a validator that read a file or a spec: its own problems, one by one
            problems += cause.problems
            continue
        field = (field_of(e.get("loc", ())) if field_of else ".".join(map(str, e.get("loc", ())))) or "(config)"
        message = re.sub(r"^(Value|Assertion) error, ", "", e["msg"])
        given = e.get("input")
        if e.get("loc") and not isinstance(given, (dict, list, BaseModel)) and e["type"] != "missing":
            message += f" (got {given!r})"
        problems.append(Problem(file, field, message))
    return problems
