"""Reference completions written from a reasoning-gym entry's metadata, for routes whose generator gives only the
final answer (a spec's ``data.completion_function``): what an SFT specialist is fine-tuned on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def arithmetic_steps(row: Mapping[str, Any]) -> str:
    """A left-to-right worked solution of a ``basic_arithmetic`` expression without parentheses (``+`` and ``-``),
    one operation per line, then ``Answer: <value>``::

        "4 - 1 + 5"  ->  "4 - 1 = 3\\n3 + 5 = 8\\nAnswer: 8"

    The value is checked against the row's answer, so a solution never teaches a wrong result."""
    tokens = str(row["metadata"]["expression"]).split()
    if len(tokens) < 3 or len(tokens) % 2 == 0 or any(op not in "+-" for op in tokens[1::2]):
        raise ValueError(f"expression {row['metadata']['expression']!r}: expected numbers joined by + and -")
    value, lines = int(tokens[0]), []
    for op, term in zip(tokens[1::2], tokens[2::2]):
        new = value + int(term) if op == "+" else value - int(term)
        lines.append(f"{value} {op} {term} = {new}")
        value = new
    if str(value) != str(row["answer"]).strip():
        raise ValueError(f"expression {row['metadata']['expression']!r} gives {value}, the row's answer is "
                         f"{row['answer']!r}")
    return "\n".join(lines + [f"Answer: {value}"])
