"""Command-line flags generated from a flow's pydantic config (the flag names are the config's dotted field names),
and :func:`run_main`, which turns a refusal into ``error: ...`` lines and exit code 2 for every entry point.

    if __name__ == "__main__":
        sys.exit(run_main(main))      # main(argv) parses with parse_config, checks its input, then runs the flow

A refusal names the file or field, what was found and what was expected, one line per problem, with no traceback
(``--debug`` on any command line shows it). Only the project's own user-facing errors are refusals
(:data:`USER_ERRORS`); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import textwrap
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Callable, Iterator, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

# tasks.config is imported where needed: it imports torch, which `python -m teachers list` should not wait for.
from tasks.common.problems import CONFIG, InputError, Problem, UserError, validation_problems

C = TypeVar("C", bound=BaseModel)

DEBUG = "--debug"
DEBUG_HELP = "on a refusal, show the Python traceback instead of the error lines"
# Config fields that name a checkpoint or tokenizer (a local folder or a hub id): the last part of the dotted name.
PATH_FIELDS = ("model_uri", "student_uri", "base_uri", "reference_uri", "tokenizer", "student_tokenizer")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # models:/..., runs:/..., hf://..., s3://...


class InvalidConfig(SystemExit):
    """Flags that fail the config's checks; ``problems`` lists every one. A :class:`SystemExit`, so a script calling
    :func:`parse_config` without :func:`run_main` still stops with the message and no traceback."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(
            f"  - {p.field}: {p.message}" if p.file == CONFIG else f"  - {p}" for p in self.problems))


# The refusals run_main prints as messages: bad input found by the project's own checks.
USER_ERRORS: tuple[type[BaseException], ...] = (InvalidConfig, InputError, UserError)


def _parse_value(text: str, default: Any) -> Any:
    if isinstance(default, (list, dict)) or default is None:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            if isinstance(default, list):
                return [x.strip() for x in text.split(",") if x.strip()]
            return text
    return text  # pydantic coerces "300" -> 300, "true" -> True


HELP_WIDTH = 100  # --help lines wrap to the terminal, but no wider than this: longer lines are hard to read
_SHORT_CHOICES = 24  # Literal choices up to this long are the metavar ({llama,qwen2}); longer ones go in the help


class HelpFormatter(argparse.HelpFormatter):
    """Wraps to the terminal width (at most :data:`HELP_WIDTH`); keeps a docstring's indented command examples
    (``Run:  python -m ...``) as they are written and refills its prose paragraphs."""

    def __init__(self, prog: str):
        width = max(40, min(shutil.get_terminal_size((HELP_WIDTH + 2, 24)).columns - 2, HELP_WIDTH))
        super().__init__(prog, max_help_position=min(36, width * 2 // 5), width=width)

    def _format_usage(self, usage, actions, groups, prefix) -> str:  # a given usage line wraps too
        text = super()._format_usage(usage, actions, groups, prefix).strip("\n")
        if "\n" in text or len(text) <= self._width:
            return text + "\n\n"
        head, _, rest = text.partition("[")
        lines = [""]
        for part in re.findall(r"\[[^\]]*\]|\S+", "[" + rest):  # whole [--flag VALUE] groups, never split
            if lines[-1] and len(head) + len(lines[-1]) + 1 + len(part) > self._width:
                lines.append("")
            lines[-1] += (" " if lines[-1] else "") + part
        return head + ("\n" + " " * len(head)).join(lines) + "\n\n"

    def _split_lines(self, text: str, width: int) -> list[str]:  # never inside shift-high or a long name
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in textwrap.dedent(text).strip("\n").split("\n\n"):
            lines = para.splitlines()
            verbatim = lines[0].startswith("Run:") or any(ln[:1].isspace() for ln in lines[1:])
            out.append("\n".join(indent + ln for ln in lines) if verbatim else "\n".join(
                indent + ln for ln in self._split_lines(para, width - len(indent))))
        return "\n\n".join(out)


def _field(cfg: BaseModel, key: str) -> tuple[FieldInfo, Any]:
    """The pydantic field behind a dotted name (``opd.steps``) and its value in ``cfg``."""
    *parents, leaf = key.split(".")
    for name in parents:
        cfg = getattr(cfg, name)
    return type(cfg).model_fields[leaf], getattr(cfg, leaf)


def _choices(annotation: Any) -> tuple[Any, ...]:
    """The values of a ``Literal`` (or ``Literal | None``) annotation; empty for any other type."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    if get_origin(annotation) in (Union, UnionType):
        return tuple(c for a in get_args(annotation) if a is not type(None) for c in _choices(a))
    return ()


def _metavar(annotation: Any) -> str:
    """What a flag takes, from the field's type: INT, FLOAT, BOOL, STR, LIST (comma-separated or JSON), JSON (an
    object), {a,b} (a short Literal) or CHOICE (a long one, listed in the help)."""
    if choices := _choices(annotation):
        short = "{" + ",".join(map(str, choices)) + "}"
        return short if len(short) <= _SHORT_CHOICES else "CHOICE"
    if get_origin(annotation) is Annotated:  # a union member with a title: its type
        return _metavar(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):  # int | None: the flag takes the int (or null)
        return next((_metavar(a) for a in get_args(annotation) if a is not type(None)), "VALUE")
    origin = get_origin(annotation) or annotation
    names = {bool: "BOOL", int: "INT", float: "FLOAT", str: "STR", list: "LIST", tuple: "LIST", dict: "JSON"}
    return names.get(origin, "VALUE")


def _shown(value: Any) -> str:
    """A default as one would type it on the command line: JSON for lists, dicts, booleans and null."""
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)


def field_help(cfg: BaseModel, key: str) -> tuple[str, str]:
    """(metavar, help text) of a dotted field: its pydantic description, the choices of a long ``Literal`` and its
    default (``Optimizer steps of the on-policy stage. (default 800)``)."""
    info, value = _field(cfg, key)
    metavar = _metavar(info.annotation)
    text = " ".join((info.description or "").split())
    if metavar == "CHOICE":
        text += f" One of: {', '.join(map(str, _choices(info.annotation)))}."
    text += " (required)" if info.is_required() else f" (default {_shown(value)})"
    return metavar, text.strip()


def _section_description(cfg: BaseModel, section: str) -> str | None:
    """What a section (``opd``) is: the description of the field holding it, else its model's docstring."""
    info, value = _field(cfg, section)
    doc = info.description or (type(value).__doc__ or "").split("\n\n")[0]
    return " ".join(doc.split()) or None


def build_parser(cfg: BaseModel, description: str, with_profile: bool = False) -> argparse.ArgumentParser:
    """One flag per config field (``--opd.steps INT``) with its description and default, grouped by section
    (``world``, ``model``, ``opd``, ...); top-level fields sit with ``--profile`` and ``--debug`` under options."""
    from tasks.config import Profile, flatten

    profiles = get_args(Profile)
    profile = f"[--profile {{{','.join(profiles)}}}] " if with_profile else ""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter, prog=_prog(),
                                     usage=f"%(prog)s [-h] {profile}[{DEBUG}] [--FIELD VALUE ...]")
    if with_profile:
        parser.add_argument("--profile", choices=list(profiles), default="default",
                            help="Named preset the flags override. (default default)")
    parser.add_argument(DEBUG, action="store_true", help=DEBUG_HELP)
    groups: dict[str, Any] = {}
    for key in flatten(cfg):
        if key == "profile":
            continue
        section = key.rpartition(".")[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(section, _section_description(cfg, section)) if section \
                else parser
        metavar, text = field_help(cfg, key)
        groups[section].add_argument(f"--{key}", dest=key, default=None, metavar=metavar,
                                     help=text.replace("%", "%%"))
    return parser


def _prog() -> str | None:
    """``python -m flows.merge`` when run that way (argparse alone would say ``merge.py``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return f"python -m {name}" if name and not name.endswith("__main__") else None


def looks_like_path(uri: str) -> bool:
    """Written as a local path rather than a hub id (``org/name``: at most one ``/``) or a URI with a scheme
    (``models:/name@alias``): starts with ``/``, ``.`` or ``~``, has more than one ``/``, or holds the OS's own
    separator where that is not ``/``."""
    if not uri or _SCHEME.match(uri):
        return False
    return uri.startswith(("/", ".", "~")) or uri.count("/") > 1 or (os.sep != "/" and os.sep in uri)


def missing_path_problems(values: dict[str, str], file: str = CONFIG) -> list[Problem]:
    """The values (field -> checkpoint or tokenizer) written as local paths that do not exist, refused before any
    hub lookup (which would otherwise report them as malformed repo ids)."""
    problems = []
    for field, value in values.items():
        if not isinstance(value, str) or not looks_like_path(value):
            continue
        path = Path(value).expanduser()
        if not path.exists():
            problems.append(Problem(file, field, f"{value}: no such folder; expected an existing local folder, or a "
                                    "hub id such as org/name"))
        elif not path.is_dir():
            problems.append(Problem(file, field, f"{value}: a file, not a folder; expected the folder holding the "
                                    "checkpoint or tokenizer files"))
    return problems


def path_fields(cfg: BaseModel) -> dict[str, str]:
    """The config's checkpoint and tokenizer fields (:data:`PATH_FIELDS`), by dotted name."""
    from tasks.config import flatten

    return {k: v for k, v in flatten(cfg).items() if k.rsplit(".", 1)[-1] in PATH_FIELDS}


def parse_config(
    argv: list[str] | None,
    make_default: Callable[..., C],
    description: str,
    with_profile: bool = False,
    check: Callable[[C], list[Problem]] | None = None,
) -> C:
    """Parse flags into a validated config; ``make_default(profile=...)`` gives the defaults flags override. Raises
    :class:`InvalidConfig` listing every field that fails validation, or else every checkpoint/tokenizer path that
    does not exist and every other problem the flow's own ``check`` of the config finds (e.g. its preflight)."""
    from tasks.config import _deep_merge, flatten, unflatten

    probe = make_default(profile="default") if with_profile else make_default()
    args = build_parser(probe, description, with_profile).parse_args(argv)
    base = make_default(profile=args.profile) if with_profile else probe
    flat_defaults = flatten(base)
    given = {
        k: _parse_value(v, flat_defaults[k])
        for k, v in vars(args).items() if k not in ("profile", "debug") and v is not None
    }
    try:
        cfg = type(base).model_validate(_deep_merge(base.model_dump(), unflatten(given)))
    except ValidationError as e:
        raise InvalidConfig(validation_problems(e)) from e
    problems = missing_path_problems(path_fields(cfg))
    named = {p.field for p in problems}  # a check may say the same of a missing folder, in its own words
    problems += [p for p in (check(cfg) if check else []) if p.field not in named]
    if problems:
        raise InvalidConfig(problems)
    return cfg


def problems_of(check: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Problem]:
    """The problems of a check that raises :class:`InputError` (a preflight), as a list: empty when it passes."""
    try:
        check(*args, **kwargs)
    except InputError as e:
        return e.problems
    return []


def _error_line(text: str) -> str:
    """One ``error: ...`` line: the text with its whitespace (newlines included) folded to single spaces."""
    return f"error: {' '.join(text.split())}"


def error_lines(e: BaseException) -> list[str]:
    """``error: ...`` lines for a refusal: one per problem or line when it lists them, else its message on one line."""
    problems = getattr(e, "problems", None)
    if isinstance(e, (InvalidConfig, InputError)) and problems:
        return [_error_line(str(p)) for p in problems]
    if isinstance(e, UserError) and getattr(e, "lines", None):  # a refusal that says itself in a few lines
        return [_error_line(line) for line in e.lines]
    return [_error_line(str(e) or type(e).__name__)]


class _NoRefusalTracebacks(logging.Filter):
    """Prefect logs an exception raised in a flow or task with its traceback; for a refusal the error lines say it
    all, so the record keeps its one-line message (console and Prefect UI) and loses the traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], USER_ERRORS):
            record.exc_info = record.exc_text = None
        return True


@contextmanager
def _refusals_without_tracebacks() -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")]
    quiet = _NoRefusalTracebacks()
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)


def run_main(main: Callable[[list[str]], Any], argv: list[str] | None = None) -> int:
    """Run an entry point ``main(argv)``; returns the exit code: 0 done, 2 refused (:data:`USER_ERRORS`, printed as
    ``error: ...`` lines on stderr) or argparse's own code (``--help``, a usage error). ``--debug`` in ``argv``
    re-raises a refusal with its traceback; any other exception is a bug and always propagates."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = DEBUG in argv
    try:
        with nullcontext() if debug else _refusals_without_tracebacks():
            main(argv)
    except USER_ERRORS as e:
        if debug and not isinstance(e, InvalidConfig):
            raise
        if debug:  # a SystemExit: re-raised, Python would print its message without the traceback
            traceback.print_exc()
        for line in error_lines(e):
            print(line, file=sys.stderr)
        return 2
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:  # argparse: --help (0) or a usage error (2), already printed
            return e.code or 0
        raise
    return 0
