"""The route spec: one YAML or JSON file, written by the user, listing the routes of a merge. Each route says where
its prompts come from, how they are rendered, how the student generates on them, how an answer is checked and which
teacher serves it. This module reads and validates the file and loads each route's train / held-out rows; it does
not know the built-in world (which will become one provider of such files).

    from tasks.specs.spec import load_spec, load_route_rows
    spec = load_spec("routes.yaml")                 # InputError naming file, route and field on a bad spec
    rows = load_route_rows(spec.routes[0], spec)    # train / eval datasets.Dataset, never overlapping

A minimal file::

    version: 1
    routes:
      - name: gsm8k-think
        labels: {domain: math, budget: high}
        data: {source: data/gsm8k.jsonl, prompt_column: question, answer_column: answer, eval_fraction: 0.1}
        render: {kind: chat, system: "Think step by step, then give the answer after ####."}
        generate: {max_new_tokens: 512, temperature: 1.0, stop: ["</s>"]}
        verify: {kind: numeric, answer_after: "####"}
        teacher: newest          # or a registry name
        # or several: teachers: [NAME, NAME], combine: select | mixture | average_logits, teacher_weights: [..]

The same spec may be given inline instead of as a file (the Prefect form's JSON, ``--spec '{"routes": [...]}'``):
:func:`parse_inline` validates it with the same model, its problems named ``inline spec: routes[<name>].<field>``,
and :func:`write_inline_spec` writes it once as ``<state>/specs/inline-<sha12>/routes.yaml``, which every later
step reads as it would a user's file. An inline spec has no folder of its own, so its local data paths (and a local
``tokenizer``) must be absolute; a hub id stays as it is, and a ``module:function`` verifier is imported from the
Python path.
"""

from __future__ import annotations

import functools
import hashlib
import json
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.common.problems import InputError, Problem, validation_problems
from tasks.specs import verifiers

DataFormat = Literal["auto", "jsonl", "json", "parquet", "csv", "disk", "hub", "reasoning_gym"]
VerifyKind = Literal["exact", "numeric", "regex", "math", "last_number", "contains", "function"]
# How several teachers of one route make one target (tasks/objectives/combine.py; the merge applies it).
CombineMode = Literal["select", "mixture", "average_logits"]
# Values of a split column that mean "held out" and "train" (case-insensitive).
HELD_OUT_VALUES = frozenset({"eval", "test", "validation", "heldout", "held_out", "held-out"})
TRAIN_VALUES = frozenset({"train", "training"})
TEMPLATE_FIELDS = ("prompt", "system", "context")
SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ROW_COLUMNS = ("prompt", "answer", "system", "context", "completion")  # what load_route_rows returns, in order


ROUTE_NAME_PATTERN = r"^[A-Za-z0-9][\w .-]*$"  # letters, digits, space, _ . -; MLflow keys are metric/<name>
ROUTE_NAME_MAX = 100


def check_route_name(name: object) -> str:
    """A route name as a spec, the registry and the router take it; ValueError naming the rule otherwise."""
    import re

    if not isinstance(name, str) or len(name) > ROUTE_NAME_MAX or not re.match(ROUTE_NAME_PATTERN, name):
        raise ValueError(f"route {name!r} is not a route name (1-{ROUTE_NAME_MAX} letters, digits, spaces, _ . -, "
                         "starting with a letter or digit)")
    return name


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# How a teacher with privileged context (a registry record's ``wrapper: context``) sees a row's user turn by default.
CONTEXT_TEMPLATE = "{prompt}\n\nA worked solution, for reference:\n{context}"


@functools.cache  # a teacher renders every row it scores with the same template: parsed once
def check_context_template(template: str) -> str:
    """``template`` if it is a ``str.format`` string over exactly ``{context}`` and ``{prompt}`` (both present),
    else ValueError saying what it holds."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"context template {template!r} is not a format string: {e}") from None
    if names != {"context", "prompt"}:
        raise ValueError(f"context template {template!r} names {sorted(names)}; expected exactly {{context}} and "
                         "{prompt}")
    return template


class DataSpec(_Spec):
    """Where a route's prompts come from and how its held-out split is drawn."""

    source: str = Field(..., min_length=1, description="A JSONL, JSON, parquet or CSV file, a folder written by "
                        "datasets.save_to_disk (paths relative to the spec file), or a hub dataset id.")
    format: DataFormat = Field("auto", description="How to read source; auto = by suffix (a folder: save_to_disk).")
    prompt_column: str = Field("prompt", min_length=1, description="Column holding the prompt text.")
    answer_column: str = Field("answer", min_length=1, description="Column holding the reference answer.")
    system_column: str | None = Field(None, description="Optional column with a per-row system prompt.")
    context_column: str | None = Field(None, description="Optional column with privileged context for teachers.")
    completion_column: str | None = Field(None, description="Optional column with a reference completion (what an "
                                          "SFT specialist is fine-tuned on, and off-policy gold data).")
    split_column: str | None = Field(None, description="Optional column saying train or eval/test/validation per "
                                     "row; without it the held-out rows are drawn by eval_fraction / eval_size.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of distinct prompts held out (no split_column).")
    eval_size: int | None = Field(None, ge=1, description="Held-out prompts, instead of eval_fraction.")
    seed: int = Field(0, ge=0, description="Seed of the held-out draw (and of a generator's rows).")
    size: int = Field(1000, ge=2, le=10_000_000, description="format reasoning_gym: rows generated (duplicates are "
                      "dropped after, so fewer distinct prompts may remain).")
    generator: dict[str, Any] = Field(default_factory=dict, description="format reasoning_gym: the generator's "
                                      "config (keyword arguments of reasoning_gym.create_dataset).")
    completion_function: str = Field("", description="'module:function' writing a row's reference completion, "
                                     "called as fn(row) -> str (row: the source's columns; a generator's metadata "
                                     "as a dict), e.g. a worked solution built from a generator's metadata; used "
                                     "where completion_column is not set.")
    context_function: str = Field("", description="'module:function' writing a row's privileged context (what a "
                                  "teacher of wrapper context reads and the student never sees), called as "
                                  "fn(row) -> str like completion_function; used where context_column is not set.")

    @model_validator(mode="after")
    def _generator(self) -> "DataSpec":
        if self.generator and self.format != "reasoning_gym":
            raise ValueError("generator settings apply to format reasoning_gym only")
        if self.completion_function and self.completion_column:
            raise ValueError("give completion_column or completion_function, not both")
        if self.context_function and self.context_column:
            raise ValueError("give context_column or context_function, not both")
        return self


class RenderSpec(_Spec):
    """How a prompt becomes the text a model sees: the tokenizer's own chat template, or a plain format string."""

    kind: Literal["chat", "format"] = Field("chat", description="chat: messages through the tokenizer's chat "
                                            "template; format: `template` filled in (base models).")
    system: str = Field("", description="System prompt of this route (e.g. a think / no-think switch); a row's "
                        "system column overrides it.")
    template: str = Field("{prompt}", description="kind=format only: a str.format string over {prompt}, {system} "
                          "and {context}.")

    @model_validator(mode="after")
    def _template(self) -> "RenderSpec":
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        except ValueError as e:
            raise ValueError(f"template {self.template!r}: {e}") from None
        unknown = sorted(names - set(TEMPLATE_FIELDS))
        if unknown:
            raise ValueError(f"template {self.template!r} uses {unknown}; expected fields from {list(TEMPLATE_FIELDS)}")
        if "prompt" not in names:
            raise ValueError(f"template {self.template!r} has no {{prompt}} field")
        return self


@dataclass(frozen=True)
class Sampling:
    """How one route's rollouts sample (:meth:`GenerateSpec.sampling`): temperature (0 = greedy), nucleus mass
    ``top_p`` and the ``stop`` strings that end a response as EOS does."""

    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()


class GenerateSpec(_Spec):
    """How the student samples on this route (evaluation is greedy under the same cap and stop strings)."""

    max_new_tokens: int = Field(256, ge=1, le=131072, description="Rollout length cap in tokens.")
    temperature: float = Field(1.0, ge=0, le=10, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a response (besides EOS).")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    def sampling(self, default_temperature: float = 1.0) -> Sampling:
        """This route's rollout sampling: its ``temperature`` where the spec sets one, else ``default_temperature``
        (the merge's ``opd.sample_temperature``), its ``top_p`` and ``stop`` strings."""
        temperature = self.temperature if "temperature" in self.model_fields_set else default_temperature
        return Sampling(temperature, self.top_p, tuple(self.stop))


class VerifySpec(_Spec):
    """How an answer is checked (tasks/specs/verifiers.py)."""

    kind: VerifyKind = Field("exact", description="exact, numeric, regex, math (math-verify), last_number (the last number "
                          "of free text, as numeric compares), contains (the reference anywhere in the response) or "
                          "function.")
    answer_after: str = Field("", description="Compare only the text after the last occurrence of this marker.")
    case_sensitive: bool = Field(True, description="exact, contains and regex: compare case-sensitively.")
    tolerance: float = Field(1e-6, ge=0, description="numeric and last_number: largest absolute difference accepted.")
    rel_tolerance: float = Field(0.0, ge=0, description="numeric and last_number: largest difference relative to the reference.")
    pattern: str = Field("", description="regex: the pattern whose group is the answer (last match).")
    group: int | str = Field(1, description="regex: group number or name.")
    function: str = Field("", description="function: 'module:function', called as fn(completion, reference, row).")
    format: str = Field("", description="Optional regex a well-formed response matches whole, right or wrong (the "
                        "cold-start gate's format rate); empty = every response that ends is well-formed.")

    @model_validator(mode="after")
    def _needs(self) -> "VerifySpec":
        if self.kind == "regex" and not self.pattern:
            raise ValueError("kind 'regex' needs a pattern")
        if self.kind == "function" and not self.function:
            raise ValueError("kind 'function' needs function: 'module:function'")
        if self.format:
            import re

            try:
                re.compile(self.format)
            except re.error as e:
                raise ValueError(f"format {self.format!r} does not compile: {e}") from None
        return self

    def well_formed(self, completion: str) -> bool:
        """The response has the route's shape (``format`` matched whole; always true without one)."""
        import re

        return not self.format or re.fullmatch(self.format, completion, re.DOTALL) is not None

    def build(self, folder: str | Path | None = None) -> verifiers.Verifier:
        """The verifier itself (``folder``: the spec's, where a ``function`` verifier's module may lie);
        :class:`tasks.specs.verifiers.VerifierError` when it cannot be built."""
        if self.kind == "exact":
            return verifiers.exact(self.case_sensitive, self.answer_after)
        if self.kind == "numeric":
            return verifiers.numeric(self.tolerance, self.rel_tolerance, self.answer_after)
        if self.kind == "regex":
            return verifiers.regex(self.pattern, self.group, self.case_sensitive)
        if self.kind == "math":
            return verifiers.math_verify(self.answer_after)
        if self.kind == "last_number":
            return verifiers.last_number(self.tolerance, self.rel_tolerance, self.answer_after)
        if self.kind == "contains":
            return verifiers.contains(self.case_sensitive, self.answer_after)
        return verifiers.function(self.function, folder)

    def build_exact(self) -> verifiers.Verifier:
        """The exact-format check reported beside the verifier's accuracy: the response (after ``answer_after``) is the
        reference, character for character. A lenient verifier (``last_number``, ``contains``, ``math``) says whether the answer is
        right; this says whether it is also in the route's format."""
        return verifiers.exact(self.case_sensitive, self.answer_after)


class RouteSpec(_Spec):
    """One route of a merge."""

    name: str = Field(..., pattern=ROUTE_NAME_PATTERN, max_length=ROUTE_NAME_MAX,
                      description="Unique name (letters, digits, space, _ . -): MLflow keys are metric/<name>.")
    labels: dict[str, str] = Field(default_factory=dict, description="Free labels such as domain and budget, for "
                                   "grouping (retention per domain), routing rules and MLflow.")
    data: DataSpec
    render: RenderSpec = Field(default_factory=RenderSpec)
    generate: GenerateSpec = Field(default_factory=GenerateSpec)
    verify: VerifySpec = Field(default_factory=VerifySpec)
    teacher: str = Field("newest", min_length=1, description="A registry name, or 'newest': the newest teacher "
                         "registered for this route.")
    teachers: list[str] = Field(default_factory=list, description="Several registry names, all registered for this "
                                "route, that score it together (instead of teacher; the first is the primary, which "
                                "samples off-policy completions); how is said by combine.")
    combine: CombineMode = Field("select", description="How the teachers of teachers combine: select (each sequence "
                                 "scored whole by the teacher with the lowest mean NLL on its response tokens), "
                                 "mixture (per token, log of the weighted mean of their probabilities) or "
                                 "average_logits (per token, the weighted mean of their log-probabilities).")
    teacher_weights: list[float] = Field(default_factory=list, description="mixture and average_logits: one weight "
                                         "per name of teachers, normalised to sum 1; empty = uniform. Positive, "
                                         "except with average_logits, where terms may be negative if the sum is "
                                         "positive: a composed teacher, e.g. weak-to-strong [1, alpha, -alpha] over "
                                         "(large base, small RL model, small base).")
    specialist: dict[str, Any] = Field(default_factory=dict, description="This route's specialist recipe where it "
                                       "differs from the flow's (specialist_train, or specialist_rl with "
                                       "specialist_trainer rl): field: value, e.g. {steps: 600}. Names and values "
                                       "are checked by the preflights, before anything trains.")

    @field_validator("teachers")
    @classmethod
    def _teachers(cls, v: list[str]) -> list[str]:
        if any(not name for name in v):
            raise ValueError("teacher names must be non-empty")
        dupes = sorted({n for i, n in enumerate(v) if n in v[:i]})
        if dupes:
            raise ValueError(f"teachers {dupes} appear more than once; expected distinct registry names")
        if len(v) == 1:
            raise ValueError(f"one teacher {v[0]!r}: write teacher: {v[0]} (teachers lists two or more)")
        return v

    @model_validator(mode="after")
    def _combination(self) -> "RouteSpec":
        if self.teachers and self.teacher != "newest":
            raise ValueError(f"give teacher ({self.teacher!r}) or teachers ({self.teachers}), not both")
        if not self.teachers and (self.combine != "select" or self.teacher_weights):
            raise ValueError("combine and teacher_weights apply to a route that lists teachers: [NAME, NAME, ...]")
        if self.teacher_weights and self.combine == "select":
            raise ValueError("teacher_weights apply to combine mixture or average_logits, not select (each sequence "
                             "goes to one teacher)")
        if self.teacher_weights and len(self.teacher_weights) != len(self.teachers):
            raise ValueError(f"{len(self.teacher_weights)} teacher_weights for {len(self.teachers)} teachers; expected "
                             "one weight per teacher, in the same order")
        finite = all(abs(w) < float("inf") for w in self.teacher_weights)
        if self.combine == "average_logits" and self.teacher_weights:  # a composed teacher may subtract one
            if not (finite and sum(self.teacher_weights) > 0):
                raise ValueError(f"teacher_weights {self.teacher_weights}: expected finite numbers with a positive "
                                 "sum (negative terms compose a teacher, e.g. [1, alpha, -alpha])")
        elif any(not (0 < w < float("inf")) for w in self.teacher_weights):
            raise ValueError(f"teacher_weights {self.teacher_weights}: expected positive finite numbers (negative "
                             "terms only with combine average_logits: a composed teacher)")
        return self

    @property
    def teacher_names(self) -> list[str]:
        """The registry names this route names (teachers, or teacher unless 'newest'); empty: its newest teacher."""
        return list(self.teachers) or ([] if self.teacher == "newest" else [self.teacher])


class RouteSpecFile(_Spec):
    """The whole file: its routes, and where it was read from (relative data paths resolve against it)."""

    version: Literal[1] = Field(1, description="Spec format version.")
    routes: list[RouteSpec] = Field(..., min_length=1, description="The routes of the merge.")
    tokenizer: str = Field("", description="Tokenizer folder (relative to this file) or hub id the prompts are "
                           "rendered with when the pipeline pre-trains its own base; empty = a character tokenizer "
                           "built from the data, with a chat template. A given base model's tokenizer wins.")
    path: str = Field("", description="The file this spec was read from (set by load_spec).")

    @model_validator(mode="after")
    def _unique(self) -> "RouteSpecFile":
        seen: set[str] = set()
        dupes = sorted({r.name for r in self.routes if r.name in seen or seen.add(r.name)})
        if dupes:
            raise ValueError(f"route names {dupes} appear more than once; expected unique names")
        return self

    def route(self, name: str) -> RouteSpec:
        for r in self.routes:
            if r.name == name:
                return r
        raise KeyError(f"no route {name!r} in {self.path or 'the spec'}; routes: {[r.name for r in self.routes]}")

    @property
    def folder(self) -> Path:
        return Path(self.path).resolve().parent if self.path else Path.cwd()


def _where(loc: tuple, raw: Any) -> str:
    """A pydantic error location as a field path, naming routes by their name: ``routes[gsm8k].data.source``."""
    parts: list[str] = []
    node = raw
    for i, key in enumerate(loc):
        if isinstance(key, int) and parts and parts[-1] == "routes":
            name = node[key].get("name") if isinstance(node, list) and key < len(node) and isinstance(
                node[key], dict) else None
            parts[-1] = f"routes[{name if name else key}]"
        elif isinstance(key, int):
            parts[-1] = f"{parts[-1]}[{key}]" if parts else f"[{key}]"
        else:
            parts.append(str(key))
        node = node[key] if isinstance(node, (dict, list)) and _has(node, key) else None
    return ".".join(parts) or "(spec)"


def _has(node: Any, key: Any) -> bool:
    return (isinstance(node, dict) and key in node) or (isinstance(node, list) and isinstance(key, int)
                                                         and key < len(node))


def parse_spec(raw: Any, path: str = "<spec>") -> RouteSpecFile:
    """Validate a spec already read into Python objects; :class:`InputError` lists every problem."""
    if not isinstance(raw, dict):
        raise InputError([Problem(path, "(spec)", f"a {type(raw).__name__}; expected a mapping with 'routes'")],
                         f"route spec {path}")
    try:
        return RouteSpecFile.model_validate({**raw, "path": path})
    except ValidationError as e:
        raise InputError(validation_problems(e, path, lambda loc: _where(loc, raw)), f"route spec {path}") from None


INLINE = "inline spec"  # the ``file`` an inline spec's problems name: it has no file of its own (yet)
INLINE_FILE = "routes.yaml"  # what an inline spec is written as, in its own folder under tasks.common.paths.specs_dir()


def inline_mapping(raw: Any) -> dict[str, Any]:
    """An inline spec as plain JSON data: a mapping, or JSON text of one (the command line's ``--spec '{...}'``)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InputError([Problem(INLINE, "(text)", f"does not parse as JSON ({e}); expected a JSON object with "
                                      "'routes', or the path of a spec file")], f"route spec {INLINE}") from None
    if not isinstance(raw, Mapping):
        raise InputError([Problem(INLINE, "(spec)", f"a {type(raw).__name__}; expected a mapping with 'routes'")],
                         f"route spec {INLINE}")
    try:  # what Prefect stores and the spec file will hold: JSON values only
        return json.loads(json.dumps({k: v for k, v in raw.items() if k != "path"}))
    except (TypeError, ValueError) as e:
        raise InputError([Problem(INLINE, "(spec)", f"holds a value that is not JSON ({e}); expected strings, "
                                  "numbers, booleans, lists and mappings")], f"route spec {INLINE}") from None


def _path_like(value: str) -> bool:
    """Written as a local path rather than a hub id (``org/name``: at most one ``/``)."""
    return value.startswith(("/", ".", "~")) or value.count("/") > 1 or "\\" in value


def _relative_path_problems(raw: dict[str, Any]) -> list[Problem]:
    """An inline spec's local paths must be absolute: there is no spec folder to resolve a relative one against.
    Read from the raw mapping, so that they are listed with the model's own problems, all at once."""
    from types import SimpleNamespace

    problems = []
    why = "an inline spec has no folder to resolve a relative path against: expected an absolute path"
    routes = raw.get("routes")
    for i, route in enumerate(routes if isinstance(routes, list) else []):
        data = route.get("data") if isinstance(route, dict) else None
        source, fmt = (data.get("source"), data.get("format", "auto")) if isinstance(data, dict) else (None, None)
        if not (isinstance(source, str) and source and isinstance(fmt, str)):
            continue  # missing or mistyped: the model says so
        local = _format_of(SimpleNamespace(source=source, format=fmt), Path(source)) not in ("hub", "reasoning_gym")
        if local and not Path(source).is_absolute():
            name = route.get("name") or i
            problems.append(Problem(INLINE, f"routes[{name}].data.source",
                                    f"{source}: a relative path; {why} (or a hub dataset id, with format: hub)"))
    tokenizer = raw.get("tokenizer")
    if isinstance(tokenizer, str) and _path_like(tokenizer) and not Path(tokenizer).is_absolute():
        problems.append(Problem(INLINE, "tokenizer", f"{tokenizer}: a relative path; {why} (or a hub id)"))
    return problems


def parse_inline(raw: Any) -> RouteSpecFile:
    """Validate an inline spec (a mapping with the :class:`RouteSpecFile` fields, or JSON text of one) with the same
    model as a file; :class:`InputError` lists every problem, named ``inline spec: routes[<name>].<field>``, and every
    local path that is not absolute."""
    raw = inline_mapping(raw)
    problems = _relative_path_problems(raw)
    try:
        spec = parse_spec(raw, INLINE)
    except InputError as e:
        problems = e.problems + problems
    if problems:
        raise InputError(problems, f"route spec {INLINE}")
    return spec


def inline_text(raw: Any) -> str:
    """The file an inline spec is written as: YAML, its keys in the order given."""
    import yaml

    return yaml.safe_dump(inline_mapping(raw), sort_keys=False, allow_unicode=True, width=120)


def inline_name(raw: Any) -> str:
    """``inline-<sha12>``: an inline spec's folder, named by the hash of its text (the same spec, the same folder)."""
    return "inline-" + hashlib.sha256(inline_text(raw).encode()).hexdigest()[:12]


def write_inline_spec(raw: Any, root: str | Path | None = None) -> Path:
    """Validate an inline spec (:func:`parse_inline`) and write it, once, as ``<root>/inline-<sha12>/routes.yaml``
    (``root``: :func:`tasks.common.paths.specs_dir`); returns that path, which every later step reads like a user's file."""
    from tasks.common.paths import specs_dir, write_atomic

    parse_inline(raw)
    text = inline_text(raw)
    out = Path(root or specs_dir()) / inline_name(raw) / INLINE_FILE
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        write_atomic(out, text)
    return out


def is_inline(spec: Any) -> bool:
    """A flow config's ``spec`` that is the spec itself rather than the path of a file."""
    return isinstance(spec, Mapping)


def spec_label(spec: Any) -> str:
    """How messages name a flow config's ``spec``: its path, or ``inline spec <sha12>``."""
    return f"{INLINE} {inline_name(spec).removeprefix('inline-')}" if is_inline(spec) else str(spec)


def read_spec(spec: Any) -> RouteSpecFile:
    """A flow config's ``spec``, validated: the file at a path (:func:`load_spec`), or an inline one
    (:func:`parse_inline`)."""
    return parse_inline(spec) if is_inline(spec) else load_spec(spec)


def as_inline(e: InputError, path: str | Path | None) -> InputError:
    """``e`` with the problems of an inline spec's written file (``path``) named as the inline spec's, as its
    validation problems are."""
    problems = [Problem(INLINE, p.field, p.message) if path is not None and p.file == str(path) else p
                for p in e.problems]
    return InputError(problems, f"route spec {INLINE}")


def load_spec(path: str | Path) -> RouteSpecFile:
    """Read a route spec file (``.yaml``/``.yml`` or ``.json``) and validate it."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise InputError([Problem(str(p), "(file)", "no such file; expected a .yaml, .yml or .json route spec")],
                         f"route spec {p}")
    text = p.read_text(encoding="utf-8")
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise InputError([Problem(str(p), "(file)", f"does not parse ({' '.join(str(e).split())})")],
                         f"route spec {p}") from None
    return parse_spec(raw, str(p))


# ---------------------------------------------------------------------------------------------------- route data


def _format_of(data: DataSpec, local: Path) -> str:
    """By suffix; a folder is save_to_disk's; a value with neither, not written as a path, is a hub id."""
    if data.format != "auto":
        return data.format
    if local.suffix in SUFFIX_FORMATS:
        return SUFFIX_FORMATS[local.suffix]
    if local.is_dir() or data.source.startswith((".", "/", "~")) or data.source.count("/") > 1:
        return "disk"
    return "hub"


def _read(data: DataSpec, folder: Path, file: str, field: str):
    """The route's rows as one ``datasets.Dataset`` (all splits of a saved DatasetDict concatenated, with the split
    name in a ``__split__`` column when the spec reads the split from it)."""
    from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk

    if data.format == "reasoning_gym":
        return _generated(data, file, field)
    local = (folder / data.source).expanduser()
    fmt = _format_of(data, local)
    if fmt != "hub" and not local.exists():
        where = "" if Path(data.source).is_absolute() else f" (looked in {folder})"
        raise InputError([Problem(file, field, f"{data.source}: no such file or folder{where}")])
    try:
        if fmt == "disk":
            ds = load_from_disk(str(local))
        elif fmt == "hub":
            ds = load_dataset(data.source)
        else:
            ds = load_dataset("json" if fmt in ("jsonl", "json") else fmt, data_files=str(local))
    except Exception as e:  # unreadable file, hub unreachable: reported, not raised as a traceback
        raise InputError([Problem(file, field, f"{data.source}: cannot be read as {fmt} "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:200]})")]) from None
    if isinstance(ds, DatasetDict):
        parts = [d.add_column("__split__", [name] * len(d)) for name, d in ds.items()]
        ds = concatenate_datasets(parts)
    assert isinstance(ds, Dataset)
    return ds


def _generated(data: DataSpec, file: str, field: str):
    """``data.size`` rows of the reasoning-gym generator ``data.source`` (``question`` -> ``prompt``, ``answer``, the
    entry's ``metadata`` as JSON text), seeded by ``data.seed``."""
    from datasets import Dataset

    try:
        import reasoning_gym
    except ImportError:
        raise InputError([Problem(file, field, "format reasoning_gym needs the reasoning-gym package: "
                                  "pip install -e '.[real]'")]) from None
    try:
        entries = reasoning_gym.create_dataset(data.source, size=data.size, seed=data.seed, **data.generator)
        rows = [{"prompt": e["question"], "answer": str(e["answer"]), "metadata": json.dumps(e.get("metadata", {}),
                 default=str)} for e in entries]
    except Exception as e:  # an unknown generator name or config key: reported, not raised as a traceback
        raise InputError([Problem(file, field, f"reasoning-gym generator {data.source!r} with {data.generator}: "
                                  f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")]) from None
    return Dataset.from_list(rows)


def load_route_rows(route: RouteSpec, spec: RouteSpecFile):
    """``{"train": Dataset, "eval": Dataset}`` with the :data:`ROW_COLUMNS` (strings; empty where the spec names no
    column), deduplicated by (prompt, system), the held-out rows never sharing a prompt with
    the training rows. :class:`InputError` names the file, route and column on any problem."""
    from datasets import Dataset

    file, base = spec.path or "<spec>", f"routes[{route.name}].data"
    data = route.data
    ds = _read(data, spec.folder, file, f"{base}.source")
    wanted = {"prompt_column": data.prompt_column, "answer_column": data.answer_column,
              "system_column": data.system_column, "context_column": data.context_column,
              "completion_column": data.completion_column, "split_column": data.split_column}
    missing = [Problem(file, f"{base}.{key}", f"column {col!r} is not in {data.source} (columns: "
                       f"{sorted(c for c in ds.column_names if c != '__split__')})")
               for key, col in wanted.items() if col and col not in ds.column_names]
    if missing:
        raise InputError(missing, f"route spec {file}")

    def text(row: dict, col: str | None) -> str:
        return "" if not col or row[col] is None else str(row[col])

    def column_or_function(column: str | None, function: str, key: str):
        """A row -> text reader: ``function`` ('module:function' called on the row, a generator's metadata as a
        dict) where the spec names one, else the ``column``."""
        if not function:
            return lambda row: text(row, column)
        try:
            write = verifiers.import_function(function, spec.folder)
        except verifiers.VerifierError as e:
            raise InputError([Problem(file, f"{base}.{key}", str(e))], f"route spec {file}") from None

        def call(row: dict) -> str:
            if isinstance(row.get("metadata"), str):
                row = {**row, "metadata": json.loads(row["metadata"])}
            return str(write(row))
        return call

    completion = column_or_function(data.completion_column, data.completion_function, "completion_function")
    context = column_or_function(data.context_column, data.context_function, "context_function")

    rows, problems, seen, conflicts = [], [], {}, set()
    for i, row in enumerate(ds):
        prompt = text(row, data.prompt_column)
        if not prompt.strip():
            problems.append(Problem(file, f"{base}.prompt_column", f"row {i + 1}: empty prompt"))
            continue
        split = text(row, data.split_column).casefold() if data.split_column else ""
        if data.split_column and split not in HELD_OUT_VALUES | TRAIN_VALUES:
            problems.append(Problem(file, f"{base}.split_column", f"row {i + 1}: {split!r}; expected one of "
                                    f"{sorted(TRAIN_VALUES)} or {sorted(HELD_OUT_VALUES)}"))
            continue
        key = (prompt, text(row, data.system_column))
        if key in seen:  # a repeated row: dropped, unless it says the other split (a leak, refused below)
            if data.split_column and (seen[key] in HELD_OUT_VALUES) != (split in HELD_OUT_VALUES):
                conflicts.add(prompt)
            continue
        seen[key] = split
        rows.append({"prompt": prompt, "answer": text(row, data.answer_column), "system": key[1],
                     "context": context(row), "completion": completion(row),
                     "__split__": split})
    if problems:
        raise InputError(problems[:20], f"route spec {file}")
    if data.split_column:
        train = [r for r in rows if r["__split__"] in TRAIN_VALUES]
        held = [r for r in rows if r["__split__"] in HELD_OUT_VALUES]
        overlap = sorted(({r["prompt"] for r in train} & {r["prompt"] for r in held}) | conflicts)
        if overlap:
            raise InputError([Problem(file, f"{base}.split_column", f"{len(overlap)} prompt(s) are in both the "
                                      f"train and the held-out rows (e.g. {overlap[:3]}); expected disjoint splits")],
                             f"route spec {file}")
    else:
        import random

        order = list(range(len(rows)))
        random.Random(data.seed).shuffle(order)
        n_eval = data.eval_size or max(1, round(data.eval_fraction * len(rows)))
        held_idx = set(order[:n_eval])
        held = [rows[i] for i in sorted(held_idx)]
        held_prompts = {r["prompt"] for r in held}
        # A prompt held out under one system prompt is held out under every other too.
        train = [r for i, r in enumerate(rows) if i not in held_idx and r["prompt"] not in held_prompts]
    if not train or not held:
        raise InputError([Problem(file, base, f"{len(train)} training and {len(held)} held-out prompt(s) from "
                                  f"{len(rows)} distinct rows; expected at least one of each")], f"route spec {file}")
    columns = ROW_COLUMNS
    return {name: Dataset.from_dict({c: [r[c] for r in part] for c in columns})
            for name, part in (("train", train), ("eval", held))}
