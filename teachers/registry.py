"""The teacher registry: a JSON file of frozen teacher records, not a plugin system.

A teacher is one entry: name, route, checkpoint URI, tokenizer fingerprint, eval score and provenance. The file is
``{"version": 1, "teachers": [...]}`` at :func:`tasks.common.paths.registry_path` (``$OPD_REGISTRY`` overrides); a missing
file is an empty registry. Several processes may register at once: every read-modify-write holds an exclusive
``flock`` on ``<file>.lock`` and replaces the file atomically.

    from teachers.registry import TeacherRegistry
    reg = TeacherRegistry()
    reg.register_checkpoint("shift-high-v1", "shift-high", ".opd/models/specialists/shift-high-...", ".opd/world/tokenizer")
    reg.for_route("shift-high")

From a shell, ``python -m teachers --help`` (see :mod:`teachers.cli`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tasks.common.paths import registry_path
from tasks.common.problems import UserError
from tasks.specs.spec import check_context_template, check_route_name
from tasks.modeling.routing import OWN_TEXT_WRAPPERS, WRAPPERS, Wrapper, reads_own_text
from tasks.modeling.routing import registry_fingerprint  # noqa: F401  (re-exported: the registry's fingerprint)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REGISTRY_VERSION = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
ENDPOINT_RE = re.compile(r"^https?://(?P<authority>[^/\s?#]+)(/[^\s]*)?$")


class RegistryError(UserError):
    """The registry file or an operation on it is invalid. A problem in the file carries ``path`` and ``field`` (e.g.
    ``teachers[2].eval_score``) and ``detail`` (what is wrong and what was expected)."""

    def __init__(self, detail: str, path: Path | str | None = None, field: str | None = None):
        self.detail, self.path, self.field = detail, path, field
        super().__init__(f"{path}: {field}: {detail}" if path is not None and field else detail)


class TeacherNotFound(RegistryError, KeyError):
    """No teacher of that name; the message lists the names there are."""

    # KeyError.__str__ would repr() the message and wrap it in quotes.
    __str__ = Exception.__str__


class IncompatibleTeacher(RegistryError):
    """A checkpoint that cannot serve as a teacher for the student; ``problems`` lists why."""

    def __init__(self, name: str, model_uri: str, problems: list[str]):
        self.name, self.model_uri, self.problems = name, model_uri, problems
        super().__init__(f"teacher {name!r} at {model_uri} cannot be registered: " + "; ".join(problems))


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(
            f"teacher name {name!r} is not a slug: use 1-64 characters from a-z 0-9 . _ -, "
            "starting with a letter or digit (for example 'shift-high-v2')"
        )
    return name


class Provenance(BaseModel):
    """Where a teacher came from, enough to rebuild or audit it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: str | None = Field(None, description="base checkpoint URI or fingerprint the teacher was trained from")
    data: str | None = Field(None, description="training data fingerprint or description")
    config_hash: str | None = Field(None, description="hash of the training config")
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC), description="UTC creation time")
    source: str = Field("api", description="who registered it: train-specialists, cli, api, ...")

    @field_validator("created_at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        # Naive times are taken as UTC so records written by hand still sort correctly against generated ones.
        return v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)


class TeacherRecord(BaseModel):
    """One teacher: a checkpoint that answers prompts of one route."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="unique slug, e.g. 'shift-high-v2'")
    route: str = Field(description="route served, '<domain>-<budget>'")
    model_uri: str = Field(min_length=1, description="local checkpoint path or hub id")
    tokenizer_fingerprint: str = Field(min_length=1, description="tokenizer_fingerprint() of its tokenizer")
    eval_score: float | None = Field(None, ge=0.0, le=1.0, description="accuracy on its route, if measured")
    provenance: Provenance = Field(default_factory=Provenance)
    trust_remote_code: bool = False
    endpoint: str = Field(
        "", description="vLLM OpenAI-compatible server serving model_uri (http://host:port), used by "
        "opd.teacher_backend=vllm; empty = an in-process engine"
    )
    transport: Literal["auto", "checkpoint", "engine", "endpoint"] = Field(
        "auto", description="how its scores are computed: its checkpoint, an in-process vLLM engine, or its endpoint; "
        "auto = as the merge's opd.teacher_backend says (an aligned teacher: its checkpoint)"
    )
    wrapper: Wrapper = Field(
        "plain", description="plain: scores the student's tokens as they are (same tokenizer); aligned: a model of "
        "another tokenizer and chat template, which renders each row its own way and is aligned to the student's "
        "tokens by their bytes; context: privileged context, a teacher that reads each row with the row's context "
        "column (a worked solution, a hint) in its prompt, which the student never sees; guided: scores as plain, and its "
        "route's on-policy rollouts start from a prefix of its own solution, withdrawn over guide_steps (guided OPD)"
    )
    context_template: str = Field(
        "", description="wrapper context: how the row's context joins its user turn, a format string over "
        "{context} and {prompt}; empty = the default (tasks/specs/spec.py: CONTEXT_TEMPLATE)"
    )
    guide_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="wrapper guided: share of its own sample of a prompt (tokens before its end) "
        "that its route's on-policy rollouts start from at the first on-policy step; 0 for other wrappers"
    )
    guide_steps: int = Field(
        0, ge=0, le=1_000_000, description="wrapper guided: on-policy steps over which the prefix is withdrawn "
        "linearly to none, after which the student generates alone; 0 for other wrappers"
    )
    base_model: str = Field(
        "", description="for a LoRA adapter folder (peft's format) as model_uri: the base it applies to, a local "
        "folder or hub id (registration fills in the one its adapter_config.json names); checked at every load: a "
        "local base must still have the weights it had at registration. Empty for a full checkpoint"
    )
    base_fingerprint: str = Field("", description="checkpoint fingerprint of a local base_model at registration")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        return check_name(v)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        return check_endpoint(v)

    @field_validator("route")
    @classmethod
    def _route(cls, v: str) -> str:
        return check_route_name(v)

    @model_validator(mode="after")
    def _aligned_transport(self) -> "TeacherRecord":
        if reads_own_text(self) and self.transport not in ("auto", "checkpoint"):
            raise ValueError(f"an {self.wrapper} teacher reads its own text through its checkpoint; transport "
                             f"{self.transport!r} is not supported for it (expected auto or checkpoint)")
        if self.context_template and self.wrapper != "context":
            raise ValueError(f"context_template is for a context teacher (wrapper context), not {self.wrapper!r}")
        if self.context_template:
            check_context_template(self.context_template)
        guided = self.wrapper == "guided"
        if guided and not (self.guide_fraction > 0 and self.guide_steps >= 1):
            raise ValueError(f"a guided teacher needs guide_fraction > 0 and guide_steps >= 1, got "
                             f"{self.guide_fraction} and {self.guide_steps}")
        if not guided and (self.guide_fraction or self.guide_steps):
            raise ValueError(f"guide_fraction and guide_steps are for a guided teacher (wrapper guided), not "
                             f"{self.wrapper!r}")
        return self


# A guided teacher registered without guide_fraction / guide_steps: half its solution at first, withdrawn over 100
# on-policy steps.
GUIDE_DEFAULTS = (0.5, 100)
GUIDE_DEFAULT_HELP = (f" (0 = {GUIDE_DEFAULTS[0]} for a guided teacher)", f" (0 = {GUIDE_DEFAULTS[1]} for a guided "
                      "teacher)")  # what the register flags add to the fields' help


def check_endpoint(url: str) -> str:
    """An endpoint is empty or ``http(s)://host[:port][/path]`` without credentials (the registry file is not a
    secret store, and its records are logged)."""
    if not url:
        return url
    m = ENDPOINT_RE.match(url)
    if m is None:
        raise ValueError(f"endpoint {url!r} is not an http(s) URL like 'http://127.0.0.1:8000'")
    if "@" in m["authority"]:
        raise ValueError("endpoint must not carry credentials (user:password@): keep secrets out of the registry")
    return url.rstrip("/")


def route_name(route) -> str:
    """A route's name from a string (checked: ValueError on a malformed one) or anything with a ``name``."""
    return check_route_name(route if isinstance(route, str) else route.name)


def _endpoint_parity_problems(name, uri, endpoint, tok, tol, trust_remote_code) -> list[str]:
    """Ask the server to score a few fixed sequences and compare with the checkpoint's own forward."""
    from tasks.modeling.engines import EndpointTeacher, check_parity, logprob_parity, parity_sequences
    from tasks.modeling.models import load_model

    try:
        served = EndpointTeacher(name, endpoint)
        seqs = parity_sequences(len(tok), tok.all_special_ids)
        check_parity(f"teacher {name!r}", served.where, logprob_parity(served, load_model(uri, trust_remote_code), seqs), tol)
    except Exception as e:  # an unreachable server, a refusal and a mismatch all mean: do not register it
        return [f"endpoint {endpoint}: {type(e).__name__}: {_first_line(e)}"]
    return []


def _adapter_base(uri: str, base_model: str, problems: list[str]) -> tuple[str | None, str]:
    """The base a checkpoint being registered loads onto and its weights' fingerprint: (None, "") for a full
    checkpoint; for a LoRA adapter folder ``base_model`` (a local path made absolute) or the one its config names.
    Appends to ``problems`` what makes it unusable: a base named for a full checkpoint, a local base that is not
    there, a named base that is not the adapter's own (both local, other weights)."""
    from tasks.common.adapters import adapter_base
    from tasks.modeling.models import base_problems, checkpoint_fingerprint

    try:
        named = adapter_base(uri)
    except ValueError as e:  # an adapter config naming no base: only an explicit base_model makes it loadable
        if not base_model:
            problems.append(str(e) + " (or name it: base_model)")
            return None, ""
        named = None
    if named is None and not base_model:
        return None, ""
    problems += base_problems(uri, base_model)
    base = base_model or named
    local = Path(base).expanduser()
    if not local.is_dir():
        return base, ""
    base, fp = str(local.resolve()), checkpoint_fingerprint(local)
    theirs = Path(named).expanduser() if named else None
    if base_model and theirs is not None and theirs.is_dir() and theirs.resolve() != local.resolve() \
            and checkpoint_fingerprint(theirs) != fp:
        problems.append(f"base_model {base_model} is not the base the adapter names ({named}, other weights): an "
                        "adapter applies only to the weights it was trained on; expected that base or a copy of it")
    return base, fp


def _validation_parts(err: ValidationError, where: str) -> tuple[str, str]:
    """(field, detail) of a pydantic error: the one field that failed and why, or ``where`` and every failure."""
    errs = err.errors()
    if len(errs) == 1:
        e = errs[0]
        got = f" (got {e['input']!r})" if e.get("loc") and not isinstance(e.get("input"), (dict, list)) else ""
        return ".".join([where, *map(str, e["loc"])]), e["msg"] + got
    return where, "; ".join(".".join(map(str, e["loc"])) + f": {e['msg']}" for e in errs)


class TeacherRegistry:
    """The registry file at ``path`` (default :func:`tasks.common.paths.registry_path`), a ``.json`` file. It writes that file,
    ``<file>.lock`` and a temp file beside it, nothing else: teacher names are slugs (:func:`check_name`) and routes
    are parsed, so no name in it ever becomes a path."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path).expanduser().resolve() if path is not None else registry_path()
        # The file, its lock and its temp files are the only paths written, all in this folder: a .json file.
        if self.path.suffix != ".json" or self.path.is_dir():
            raise RegistryError(f"{'a folder' if self.path.is_dir() else 'not a .json file'}; expected a .json file "
                                "(e.g. .opd/registry.json)", self.path, "registry path")
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def __repr__(self) -> str:
        return f"TeacherRegistry({str(self.path)!r})"

    # -- reading -------------------------------------------------------------------------------------------------

    def list(self) -> list[TeacherRecord]:
        return sorted(self._read(), key=lambda r: r.name)

    def names(self) -> list[str]:
        return [r.name for r in self.list()]

    def get(self, name: str) -> TeacherRecord:
        records = self.list()
        for r in records:
            if r.name == name:
                return r
        raise self._not_found(name, records)

    def for_route(self, route: str) -> list[TeacherRecord]:
        key = route_name(route)
        return [r for r in self.list() if r.route == key]

    # -- writing -------------------------------------------------------------------------------------------------

    def add(self, record: TeacherRecord, replace: bool = False) -> TeacherRecord:
        with self._locked():
            records = self._read()
            if not replace and any(r.name == record.name for r in records):
                raise RegistryError(
                    f"teacher {record.name!r} is already in {self.path}; expected a new name, or replace=True "
                    "(CLI: --replace) to overwrite it"
                )
            self._write([r for r in records if r.name != record.name] + [record])
        return record

    def remove(self, name: str) -> TeacherRecord:
        with self._locked():
            records = self._read()
            gone = [r for r in records if r.name == name]
            if not gone:
                raise self._not_found(name, records)
            self._write([r for r in records if r.name != name])
        return gone[0]

    def register_checkpoint(
        self,
        name: str,
        route: str,
        model_uri: str | Path,
        reference_tokenizer: PreTrainedTokenizerBase | str | Path,
        *,
        eval_score: float | None = None,
        provenance: Provenance | None = None,
        replace: bool = False,
        trust_remote_code: bool = False,
        endpoint: str = "",
        parity_tol: float = 1e-3,
        wrapper: str = "plain",
        messages: list[dict[str, str]] | None = None,
        base_model: str = "",
        context_template: str = "",
        guide_fraction: float = 0.0,
        guide_steps: int = 0,
    ) -> TeacherRecord:
        """Check that any HF checkpoint can teach the student, then add it; nothing is written unless it can.

        Raises :class:`IncompatibleTeacher` listing every problem: a bad name or route, a config or tokenizer that
        does not load, a tokenizer that differs from ``reference_tokenizer`` (object or path), too small a vocab.
        With an ``endpoint`` (a vLLM server) the server's prompt log-probs must also match the checkpoint's
        transformers forward within ``parity_tol`` on a few fixed sequences. ``messages`` (the route's first prompt
        as chat messages, when the route renders chat): the teacher's chat template must render them as the
        student's does, or, for an ``aligned`` teacher (``wrapper``: another tokenizer and template, read through
        :mod:`tasks.modeling.alignment`), it must have a chat template at all. An aligned teacher needs a fast
        tokenizer and none of the same-tokenizer checks; so does a ``context`` teacher (privileged context: it reads
        each row with the row's context column written in by ``context_template``, whatever its tokenizer). A ``guided`` teacher is checked as a plain one and
        keeps ``guide_fraction`` / ``guide_steps`` (0: :data:`GUIDE_DEFAULTS`). A plain teacher's stop tokens (its EOS and its generation
        config's) must be tokens the student can produce, as the merge's preflight checks. A LoRA adapter folder
        loads onto ``base_model`` where given (else the base its adapter_config.json names), which is recorded with
        its weights' fingerprint; a named base that disagrees with the adapter's own (both local, other weights) is
        refused.
        """
        # Imported here so that list/show/remove (and the CLI) do not pay for importing transformers.
        from tasks.modeling.models import model_config
        from tasks.modeling.alignment import aligned_problems
        from tasks.preflight import stop_token_problems
        from tasks.specs.tokenizer import compatibility_problems, load_tokenizer, tokenizer_fingerprint

        uri = str(model_uri)
        local = Path(uri).expanduser()
        if local.exists():
            # Absolute, so the record still resolves from another working directory.
            uri = str(local.resolve())
        route_text = route if isinstance(route, str) else route.name

        problems: list[str] = []
        for check, value in ((check_name, name), (check_route_name, route_text)):
            try:
                check(value)
            except ValueError as e:
                problems.append(str(e))
        base, base_fp = _adapter_base(uri, base_model, problems)
        # transformers raises OSError, ValueError, KeyError, ... depending on what is missing; all mean "not loadable".
        config = teacher_tok = None
        try:
            config = model_config(uri, trust_remote_code=trust_remote_code, base=base)  # an adapter: its base's
        except Exception as e:
            problems.append(f"config does not load: {type(e).__name__}: {_first_line(e)}")
        try:
            teacher_tok = load_tokenizer(uri, trust_remote_code=trust_remote_code, base=base)
        except Exception as e:
            problems.append(f"tokenizer does not load: {type(e).__name__}: {_first_line(e)}")
        if not isinstance(reference_tokenizer, (str, Path)):
            ref_tok = reference_tokenizer
        else:
            try:
                ref_tok = load_tokenizer(reference_tokenizer)
            except Exception as e:
                raise RegistryError(
                    f"student tokenizer {str(reference_tokenizer)!r} does not load: "
                    f"{type(e).__name__}: {_first_line(e)}"
                ) from e
        if wrapper not in WRAPPERS:
            problems.append(f"wrapper {wrapper!r} is not one of {list(WRAPPERS)}")
        elif teacher_tok is not None and wrapper in OWN_TEXT_WRAPPERS:
            problems += aligned_problems(teacher_tok, messages)
        elif teacher_tok is not None:
            same = compatibility_problems(ref_tok, teacher_tok, messages)
            if same and ref_tok.get_vocab() != teacher_tok.get_vocab():
                # Another family's tokenizer: how it can teach comes first, the differences after.
                problems.append(
                    f"its tokenizer is not the student's ({len(teacher_tok)} tokens against {len(ref_tok)}) and a "
                    "plain teacher scores the student's exact tokens; a teacher of another tokenizer teaches through "
                    "its own tokenizer and chat template: register it with --wrapper aligned")
            problems += same
            vocab_size = getattr(config, "vocab_size", None)
            if isinstance(vocab_size, int) and vocab_size < len(ref_tok):
                problems.append(f"model vocab_size {vocab_size} < {len(ref_tok)} tokens of the student tokenizer")
            problems += [f"{p.file}: {p.message}" for p in stop_token_problems(uri, teacher_tok, config, ref_tok,
                                                                                  "model_uri")]
        try:
            check_endpoint(endpoint)
        except ValueError as e:
            problems.append(str(e))
        if endpoint and not problems:
            problems += _endpoint_parity_problems(name, uri, endpoint, ref_tok, parity_tol, trust_remote_code)
        if problems:
            raise IncompatibleTeacher(name, uri, problems)

        try:
            record = TeacherRecord(
                name=name,
                route=route_text,
                model_uri=uri,
                tokenizer_fingerprint=tokenizer_fingerprint(teacher_tok),
                eval_score=eval_score,
                provenance=provenance or Provenance(source="api"),
                trust_remote_code=trust_remote_code,
                endpoint=endpoint,
                wrapper=wrapper,
                context_template=context_template,
                guide_fraction=guide_fraction or (GUIDE_DEFAULTS[0] if wrapper == "guided" else 0.0),
                guide_steps=guide_steps or (GUIDE_DEFAULTS[1] if wrapper == "guided" else 0),
                base_model=base or "",
                base_fingerprint=base_fp,
            )
        except ValidationError as e:
            raise RegistryError(": ".join(_validation_parts(e, f"teacher {name!r}"))) from e
        return self.add(record, replace=replace)

    def _not_found(self, name: str, records: list[TeacherRecord]) -> TeacherNotFound:
        return TeacherNotFound(f"no teacher {name!r} in {self.path}; available: {sorted(r.name for r in records)}")

    # -- file format ---------------------------------------------------------------------------------------------

    def _read(self) -> list[TeacherRecord]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        shape = f'a JSON document {{"version": {REGISTRY_VERSION}, "teachers": [...]}}'
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise RegistryError(f"not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; expected {shape}",
                                self.path, "document") from e
        if not isinstance(doc, dict) or not isinstance(doc.get("teachers"), list):
            raise RegistryError(f"a JSON {type(doc).__name__} without a 'teachers' list; expected {shape}",
                                self.path, "document")
        if doc.get("version") != REGISTRY_VERSION:
            raise RegistryError(f"version {doc.get('version')!r} is not supported; expected {REGISTRY_VERSION}",
                                self.path, "version")
        records: list[TeacherRecord] = []
        for i, entry in enumerate(doc["teachers"]):
            try:
                records.append(TeacherRecord.model_validate(entry))
            except ValidationError as e:
                field, detail = _validation_parts(e, f"teachers[{i}]")
                raise RegistryError(detail, self.path, field) from e
        first: dict[str, int] = {}
        for i, r in enumerate(records):
            if r.name in first:
                raise RegistryError(f"teacher name {r.name!r} appears more than once (teachers[{first[r.name]}] and "
                                    f"teachers[{i}]); expected unique names", self.path, f"teachers[{i}].name")
            first[r.name] = i
        return records

    def _write(self, records: list[TeacherRecord]) -> None:
        doc: dict[str, Any] = {
            "version": REGISTRY_VERSION,
            "teachers": [r.model_dump(mode="json") for r in sorted(records, key=lambda r: r.name)],
        }
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=2)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        # The rename itself must reach the disk too, or a crash can bring back the old file.
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
