"""The prompt set: the one folder every stage reads about the routes of a merge (base pre-training, the specialists,
the merge, evaluation), built from a route spec (:mod:`tasks.specs.spec`) and the tokenizer of the model that will read it.
Built once and cached on its inputs (the spec's text, its data files, the tokenizer):

    <state>/prompt_sets/<spec name>-<key>/
        spec.yaml     the spec file as its author wrote it (an MLflow artifact of every run; its hash an MLflow param)
        spec.json     the validated spec, with its folder recorded (verifiers, caps and labels are read from here)
        tokenizer/    the tokenizer the prompts were rendered with
        prompts/      datasets.DatasetDict ``train`` / ``eval``: route, prompt (the rendered text a model sees),
                      answer (the verifier's reference), completion (the reference completion: the spec's
                      completion column, else the answer), system, context, user (the row's own prompt before
                      rendering: a teacher with another chat template renders it its own way)
        DONE

Building checks everything a spec can get wrong before any model work, and raises one :class:`InputError` listing
it all: the file and its fields, columns, overlapping splits, a verifier that cannot be built or raises on the
route's own reference rows, a chat template the tokenizer lacks, a prompt plus ``max_new_tokens`` longer than the
model's context.

    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set
    ps = load_prompt_set(build_prompt_set("routes.yaml", tokenizer="path/to/base"))
    ps.routes, ps.eval_sets()["gsm8k"], ps.verifier("gsm8k")("... #### 42", "42", {})
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.common.problems import InputError, Problem
from tasks.specs.spec import RouteSpec, RouteSpecFile, load_route_rows, load_spec, parse_spec
from tasks.specs.verifiers import Verifier, VerifierError

if TYPE_CHECKING:
    from tasks.specs.render import RowText

PROMPT_SET_VERSION = 2  # 2: the ``user`` column (the row's own prompt, before rendering), for teachers' own renderings
# A folder name build_prompt_set writes (<spec stem>-<12 hex>): the only registry provenance.data the preflight opens.
PROMPT_SET_NAME_RE = re.compile(r"^\w[\w.-]*-[0-9a-f]{12}$")
COLUMNS = ["route", "prompt", "answer", "completion", "system", "context", "user"]
# Rows of each route whose reference (completion, else answer) a verifier is tried on while the set is built.
VERIFIER_PROBE_ROWS = 8
# Characters a built chat tokenizer needs beyond the data's: the role names its template spells out.
CHAT_ROLE_TEXT = "system\nuser\nassistant\n"


def spec_digest(text: str) -> str:
    """``sha256:<16 hex>`` of a spec file's text: the MLflow param two merge runs are compared on."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _source_digest(spec: RouteSpecFile) -> str:
    """What the routes' data files hold (content of files, names/sizes/mtimes inside folders; a hub id as such)."""
    h = hashlib.sha256()
    for route in spec.routes:
        local = (spec.folder / route.data.source).expanduser()
        h.update(route.data.source.encode())
        if local.is_file():
            h.update(local.read_bytes())
        elif local.is_dir():
            for f in sorted(local.rglob("*")):
                if f.is_file():
                    st = f.stat()
                    h.update(f"{f.relative_to(local)}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()


def resolve_tokenizer(spec: RouteSpecFile, rows: Mapping[str, Mapping[str, Any]], tokenizer: str = ""):
    """The tokenizer the prompts are rendered with: ``tokenizer`` (a base model's folder or hub id) when given, else
    the spec's ``tokenizer``, else a character tokenizer over the data's characters with a ChatML chat template."""
    from tasks.specs.tokenizer import CHAT_TEMPLATE, char_tokenizer, load_tokenizer

    if tokenizer:
        return load_tokenizer(tokenizer)
    if spec.tokenizer:
        local = (spec.folder / spec.tokenizer).expanduser()
        return load_tokenizer(local if local.exists() else spec.tokenizer)
    chars = sorted({c for route in spec.routes for route_rows in rows[route.name].values() for col in
                    ("prompt", "answer", "system", "completion") for text in route_rows[col] for c in text}
                   | {c for route in spec.routes for c in route.render.system + route.render.template}
                   | set(CHAT_ROLE_TEXT))
    return char_tokenizer("".join(chars), chat_template=CHAT_TEMPLATE)


def importable(folder: Path) -> None:
    """A spec's own folder goes on ``sys.path``, so that a ``module:function`` verifier kept next to the spec file
    imports (as the spec's relative data paths resolve against that folder)."""
    import sys

    if str(folder) not in sys.path:
        sys.path.append(str(folder))


def _probe_verifier(route: RouteSpec, verify: Verifier, rows, file: str) -> list[Problem]:
    """The verifier runs on the route's own references (a completion, else the answer) without raising."""
    for i, row in enumerate(list(rows)[:VERIFIER_PROBE_ROWS]):
        try:
            verify(row["completion"] or row["answer"], row["answer"], dict(row))
        except Exception as e:  # the user's function: any exception is its problem, reported with the row
            return [Problem(file, f"routes[{route.name}].verify", f"the verifier raised on training row {i + 1} "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); expected a bool or a number "
                            "in [0, 1] for any completion")]
    return []


def context_of(tokenizer_uri: str, default: int) -> int:
    """The positions of the model that will read the prompts: a given model's ``max_position_embeddings``, else
    ``default`` (the size a pre-trained-here base is created with)."""
    if not tokenizer_uri:
        return default
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(tokenizer_uri)
    except (OSError, ValueError):
        return default
    return int(getattr(config, "max_position_embeddings", None) or default)


def build_prompt_set(spec_path: str | Path, tokenizer: str = "", context: int = 128,
                     root: Path | None = None) -> Path:
    """Validate ``spec_path``, load and render every route's rows and write the prompt set (cached: the same spec
    text, data files and tokenizer return the existing folder). ``tokenizer``: the folder or hub id of the model that
    will read the prompts (empty: the spec's own, else one built from the data); ``context``: that model's positions
    when it is not a folder to read them from. Raises :class:`InputError` listing every problem found."""
    from tasks.common.paths import building, prompt_sets_dir
    from tasks.specs.render import RenderError, length_problems, render_prompts
    from tasks.specs.tokenizer import tokenizer_fingerprint

    spec = load_spec(spec_path)
    file = spec.path
    text = Path(spec_path).read_text(encoding="utf-8")
    problems: list[Problem] = []
    rows: dict[str, dict[str, Any]] = {}
    verifiers: dict[str, Verifier] = {}
    importable(spec.folder)
    for route in spec.routes:
        try:
            rows[route.name] = load_route_rows(route, spec)
        except InputError as e:
            problems += e.problems
        try:
            verifiers[route.name] = route.verify.build(spec.folder)
        except VerifierError as e:
            problems.append(Problem(file, f"routes[{route.name}].verify", str(e)))
    if problems:
        raise InputError(problems, f"route spec {file}")
    for route in spec.routes:
        problems += _probe_verifier(route, verifiers[route.name], rows[route.name]["train"], file)
    tok = resolve_tokenizer(spec, rows, tokenizer)
    context = context_of(tokenizer, context)
    rendered: dict[str, dict[str, list[str]]] = {}
    for route in spec.routes:
        try:
            rendered[route.name] = {split: render_prompts(route, ds, tok) for split, ds in rows[route.name].items()}
        except RenderError as e:
            problems.append(Problem(file, f"routes[{route.name}].render", str(e)))
            continue
        for split in ("train", "eval"):
            problems += length_problems(route, rendered[route.name][split], tok, context, file)
    if problems:
        raise InputError(problems, f"route spec {file}")

    key_src = json.dumps([PROMPT_SET_VERSION, text, _source_digest(spec), tokenizer_fingerprint(tok), context])
    stem = re.sub(r"[^\w.-]", "_", Path(spec_path).stem).lstrip(".") or "spec"
    out = (root or prompt_sets_dir()) / f"{stem}-{hashlib.sha256(key_src.encode()).hexdigest()[:12]}"
    if (out / "DONE").exists():
        return out
    with building(out) as tmp:
        _write(tmp, spec, text, rows, rendered, tok, context)
    return out


def _write(tmp: Path, spec: RouteSpecFile, text: str, rows, rendered, tok, context: int) -> None:
    from datasets import Dataset, DatasetDict

    from tasks.specs.tokenizer import save_tokenizer

    parts = {}
    for split in ("train", "eval"):
        cols: dict[str, list[str]] = {c: [] for c in COLUMNS}
        for route in spec.routes:
            ds = rows[route.name][split]
            cols["route"] += [route.name] * len(ds)
            cols["prompt"] += rendered[route.name][split]
            cols["answer"] += list(ds["answer"])
            cols["completion"] += [c or a for c, a in zip(ds["completion"], ds["answer"])]
            cols["system"] += list(ds["system"])
            cols["context"] += list(ds["context"])
            cols["user"] += [str(p) for p in ds["prompt"]]
        parts[split] = Dataset.from_dict(cols)
    DatasetDict(parts).save_to_disk(str(tmp / "prompts"))
    save_tokenizer(tok, tmp / "tokenizer")
    (tmp / "spec.yaml").write_text(text, encoding="utf-8")
    (tmp / "spec.json").write_text(json.dumps({"folder": str(spec.folder), "context": context,
                                               "spec_sha256": spec_digest(text),
                                               "spec": spec.model_dump(mode="json")}, indent=2))


@dataclass(frozen=True)
class PromptSet:
    """A built prompt set, read back: its routes in spec order, their splits, verifiers, caps and labels."""

    path: Path
    only: tuple[str, ...] = ()  # a merge of some of the spec's routes (MergeConfig.routes); empty = all of them

    def restricted(self, routes: list[str] | tuple[str, ...]) -> "PromptSet":
        """The same prompt set seen through ``routes`` only (spec order kept); empty = every route. Raises KeyError
        naming a route the spec does not have."""
        if unknown := [r for r in routes if r not in {x.name for x in self.spec.routes}]:
            raise KeyError(f"no route(s) {unknown} in {self.spec.path or 'the spec'}; routes: {self.routes}")
        return PromptSet(self.path, tuple(routes))

    @cached_property
    def _meta(self) -> dict[str, Any]:
        return json.loads((self.path / "spec.json").read_text())

    @cached_property
    def spec(self) -> RouteSpecFile:
        meta = self._meta
        return parse_spec(meta["spec"], meta["spec"].get("path") or str(self.path / "spec.yaml"))

    @property
    def routes(self) -> list[str]:
        return [r.name for r in self.spec.routes if not self.only or r.name in self.only]

    @property
    def spec_sha256(self) -> str:
        return self._meta["spec_sha256"]

    @property
    def context(self) -> int:
        return int(self._meta["context"])

    def route(self, name: str) -> RouteSpec:
        return self.spec.route(name)

    @cached_property
    def splits(self):
        from datasets import load_from_disk

        return load_from_disk(str(self.path / "prompts"))

    def rows(self, split: str) -> dict[str, Any]:
        """route -> its rows of ``split`` (a ``datasets.Dataset``), in spec order."""
        ds = self.splits[split]
        by_route: dict[str, list[int]] = {}
        for i, r in enumerate(ds["route"]):
            by_route.setdefault(r, []).append(i)
        return {r: ds.select(by_route.get(r, [])) for r in self.routes}

    def sets(self, split: str = "eval") -> dict[str, tuple[list[str], list[str]]]:
        """route -> (prompts, answers) of a split: what evaluation and retention are measured on (``eval``) or
        what the merge samples (``train``)."""
        return {r: (list(d["prompt"]), list(d["answer"])) for r, d in self.rows(split).items()}

    def eval_sets(self) -> dict[str, tuple[list[str], list[str]]]:
        return self.sets("eval")

    def train_sets(self) -> dict[str, tuple[list[str], list[str]]]:
        return self.sets("train")

    def row_texts(self, split: str) -> dict[tuple[str, str], "RowText"]:
        """(route, rendered prompt) -> what the route rendered for that row of ``split``
        (:class:`tasks.specs.render.RowText`): what a teacher that renders its own input reads."""
        from tasks.specs.render import row_texts

        out = {}
        for r, d in self.rows(split).items():
            rows = [{"prompt": u, "system": s, "context": c} for u, s, c in zip(d["user"], d["system"], d["context"])]
            out.update({(r, t.prompt): t for t in row_texts(self.route(r), rows, list(d["prompt"]))})
        return out

    @cached_property
    def verifiers(self) -> dict[str, Verifier]:
        """route -> its verifier, built from the spec (``module:function`` verifiers imported here)."""
        folder = Path(self._meta["folder"])
        importable(folder)
        return {r.name: r.verify.build(folder) for r in self.spec.routes}

    def verifier(self, route: str) -> Verifier:
        return self.verifiers[route]

    @cached_property
    def exact_verifiers(self) -> dict[str, Verifier]:
        """route -> its exact-format check (:meth:`tasks.specs.spec.VerifySpec.build_exact`), the figure reported
        beside the verifier's accuracy (the same as it on a route whose verifier is ``exact``)."""
        return {r.name: r.verify.build_exact() for r in self.spec.routes}

    def well_formed(self, route: str, completion: str) -> bool:
        return self.route(route).verify.well_formed(completion)

    def cap(self, route: str) -> int:
        """The route's rollout and evaluation length cap (``generate.max_new_tokens``)."""
        return self.route(route).generate.max_new_tokens

    def caps(self) -> dict[str, int]:
        """route -> :meth:`cap`, every route."""
        return {r: self.cap(r) for r in self.routes}

    def stops(self) -> dict[str, tuple[str, ...]]:
        """route -> its ``generate.stop`` strings (each ends a response as EOS does, in rollouts and evaluation)."""
        return {r: tuple(self.route(r).generate.stop) for r in self.routes}

    def labels(self, route: str) -> dict[str, str]:
        return dict(self.route(route).labels)

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer"

    def tokenizer(self):
        from tasks.specs.tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer_path)


def load_prompt_set(path: str | Path, routes: list[str] | tuple[str, ...] = ()) -> PromptSet:
    """A built prompt set; ``routes`` restricts it to some of its routes (:meth:`PromptSet.restricted`)."""
    p = Path(path)
    if not (p / "DONE").exists():
        raise FileNotFoundError(f"{p} is not a finished prompt set (no DONE): build it with build_prompt_set")
    return PromptSet(p).restricted(routes) if routes else PromptSet(p)
