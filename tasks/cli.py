"""Command-line flags generated from a flow's pydantic config: the flag names are the config's dotted field names."""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ValidationError

from tasks.config import _deep_merge, flatten, unflatten

C = TypeVar("C", bound=BaseModel)


def _parse_value(text: str, default: Any) -> Any:
    if isinstance(default, (list, dict)) or default is None:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            if isinstance(default, list):
                return [x.strip() for x in text.split(",") if x.strip()]
            return text
    return text  # pydantic coerces "300" -> 300, "true" -> True


def build_parser(cfg: BaseModel, description: str, with_profile: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if with_profile:
        parser.add_argument("--profile", choices=["quick", "default"], default="default", help="Named preset.")
    for key, default in flatten(cfg).items():
        if key == "profile":
            continue
        shown = json.dumps(default) if isinstance(default, (list, dict)) else default
        parser.add_argument(f"--{key}", dest=key, default=None, metavar="VALUE", help=f"(default: {shown})")
    return parser


def parse_config(
    argv: list[str] | None,
    make_default: Callable[..., C],
    description: str,
    with_profile: bool = False,
) -> C:
    """Parse flags into a validated config; ``make_default(profile=...)`` gives the defaults flags override."""
    probe = make_default(profile="default") if with_profile else make_default()
    args = build_parser(probe, description, with_profile).parse_args(argv)
    base = make_default(profile=args.profile) if with_profile else probe
    flat_defaults = flatten(base)
    given = {
        k: _parse_value(v, flat_defaults[k]) for k, v in vars(args).items() if k != "profile" and v is not None
    }
    try:
        return type(base).model_validate(_deep_merge(base.model_dump(), unflatten(given)))
    except ValidationError as e:
        raise SystemExit(f"invalid configuration:\n{e}") from None
