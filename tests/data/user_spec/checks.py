"""A user's own verifier, named in routes.yaml as ``checks:number_in_reply`` (the spec's folder is importable)."""

import re


def number_in_reply(completion: str, reference: str, row: dict) -> bool:
    """Right when the first whole number in the reply is the reference count ("5", "5 letters", "it has 5")."""
    match = re.search(r"\d+", completion)
    return match is not None and int(match.group()) == int(reference)
