"""Preflight: every bad input is refused before any model is loaded or trained, all problems at once.

The merge and pipeline flows call :func:`teachers.preflight.preflight_merge` /
:func:`teachers.preflight.preflight_pipeline` as their first step (they read the teacher registry, so they live with it). Each check below is a plain function that returns :class:`Problem` s (the file, the field, what is there and what was expected);
the entry points collect them all and raise one :class:`InputError` listing every one, or return a :class:`Report`
with the warnings (odd but allowed, e.g. a named teacher whose route no prompt uses). The checks are cheap: JSON
configs, safetensors headers (``safe_open``), tokenizers and prompt sets; no weights are read into a model.

    from tasks.config import pipeline_config
    from teachers.preflight import preflight_merge
    report = preflight_merge(pipeline_config("quick").merge("", []))   # raises InputError listing every problem

What is checked, and the rule behind each:

* config: pydantic ranges at construction (``--opd.lr -1`` never gets here); no URI with credentials in it.
* prompts: every ``world.prompt_files`` file parses row by row (:func:`tasks.world.data.load_prompt_file`, line numbers),
  every route's train/eval split can be drawn, and eval never overlaps train.
* registry: the file reads (JSON, schema, unique names); every route has a teacher; named teachers exist.
* checkpoints (student and every routed teacher): the folder exists, ``config.json`` loads and is a causal LM, it asks
  for no custom code unless the teacher's registry entry grants ``trust_remote_code``, every ``*.safetensors`` header
  reads (pickle-only weights are refused), the tokenizer loads and matches the student's (vocab, special tokens, EOS;
  a differing vocabulary named by its first differing ids) and the fingerprint recorded at registration, and the
  model's vocab covers the tokenizer (``config.vocab_size`` may exceed ``len(tok)``: a head padded to a multiple of 64
  or 128, its padding cut off wherever logits are compared; one short of the tokenizer is refused). A teacher stops
  only on tokens the student can produce (every id of its tokenizer's EOS and ``generation_config.eos_token_id``
  below the student's ``len(tok)``), and a teacher whose tokenizer carries a chat template of its own renders each
  chat route's first prompt as the student's does.
* architecture: a teacher whose registry provenance names the student's own checkpoint as its base (``provenance.base``
  is the student's checkpoint fingerprint, as `train specialists` records it, or the student's folder) is a fine-tune
  of it and must have its architecture (:data:`ARCH_FIELDS`); otherwise the checkpoint at ``model_uri`` is not the
  one the registry describes. Teachers without such provenance may be any causal LM: OPD needs only the tokenizer.
* leakage: a teacher whose ``provenance.data`` names another world of this project must not have trained on this
  world's eval problems of its route (its accuracy, the retention denominator, would be memorised).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from tasks.common.problems import CONFIG, InputError, Problem  # noqa: F401  (re-exported: the checks' vocabulary)
from tasks.modeling.routing import reads_own_text

# The architecture a fine-tune keeps from its base (transformers config attributes; gpt2-style names are aliased).
ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "vocab_size")
# Pickle formats: loading one can run arbitrary code, so weights must come as safetensors.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass
class Report:
    """What a passed preflight found: the student checkpoint, the routed teachers and the warnings."""

    student_uri: str = ""
    routes: list[str] = field(default_factory=list)  # the routes of the spec (the built-in world's by default)
    teachers: dict[str, str] = field(default_factory=dict)  # route -> teacher name
    warnings: list[str] = field(default_factory=list)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


# ---------------------------------------------------------------------------------------------------- config values


def credential_problems(values: dict[str, str]) -> list[Problem]:
    """Config fields (``{"student_uri": ...}``) must not carry ``user:password@`` or token query parameters: flow
    parameters are stored by Prefect and logged to MLflow."""
    from tasks.common.log import redact

    return [
        Problem(CONFIG, name, f"{redact(value)!r} carries credentials; expected a URI without them (pass secrets "
                "through the environment, e.g. HF_TOKEN)")
        for name, value in values.items() if value and redact(value) != value
    ]


# ---------------------------------------------------------------------------------------------------------- prompts


def split_overlap_problems(train: dict[str, list[str]], eval_: dict[str, list[str]], file: str) -> list[Problem]:
    """Per route, no eval problem may also be a training problem (held-out accuracy would be memorised)."""
    out = []
    for route in sorted(set(train) & set(eval_)):
        shared = sorted(set(train[route]) & set(eval_[route]))
        if shared:
            out.append(Problem(file, f"world.routes[{route}]", f"{len(shared)} of {len(set(eval_[route]))} eval "
                               f"problems are also training problems (e.g. {shared[:3]}); expected disjoint splits"))
    return out


def world_problems(world) -> tuple[dict[str, tuple[list[str], list[str]]], list[Problem]]:
    """Draw every route's (train, eval) problems as build_world will (prompt files checked row by row); returns the
    splits of the routes that could be drawn and the problems."""
    from tasks.world.data import route_splits

    splits: dict[str, tuple[list[str], list[str]]] = {}
    problems: list[Problem] = []
    for route in world.route_objs():
        try:
            splits[route.name] = route_splits(world, route)
        except InputError as e:  # a prompt file: its own problems name the file and the line
            problems += e.problems
        except ValueError as e:  # e.g. fewer distinct problems than train_size + eval_size
            problems.append(Problem(CONFIG, f"world (route {route.name})", f"{e}; expected a world whose prompt "
                                    "sets can be drawn (lower world.train_size / world.eval_size or widen the lengths)"))
    problems += split_overlap_problems({r: s[0] for r, s in splits.items()}, {r: s[1] for r, s in splits.items()},
                                       CONFIG)
    return splits, problems


def device_problems(cfg) -> list[Problem]:
    """Every ``*device`` field of a flow's config (``opd.device``, ``opd.teacher_device``, ``base_train.device``,
    ...) names a device this machine has: ``cuda`` where torch sees no GPU is refused before any model work."""
    from tasks.config import flatten
    from tasks.modeling.device import resolve_device

    problems = []
    for name, value in flatten(cfg).items():
        if name.split(".")[-1].endswith("device"):
            try:
                resolve_device(value)
            except ValueError as e:
                problems.append(Problem(CONFIG, name, str(e)))
    return problems


def spec_problems(cfg, tokenizer: str = "", context: int = 128):
    """The prompt set a flow with ``cfg.spec`` / ``cfg.world`` will read, built here (cached) with ``tokenizer`` (the
    folder of the model that reads it), and the problems that keep it from being built: for the built-in world its
    prompt files and splits, for a user's spec everything :func:`tasks.specs.prompt_set.build_prompt_set` checks (file,
    fields, columns, splits, verifiers, template, lengths). Returns (PromptSet or None, problems)."""
    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set
    from tasks.specs.spec import as_inline, is_inline, spec_label

    from tasks.training.pretrain import spec_path

    if not cfg.spec:
        _, problems = world_problems(cfg.world)
        if problems:
            return None, problems
    path = None
    try:
        path = spec_path(cfg.spec, cfg.world)  # an inline spec: validated, then written once as a file
        ps = load_prompt_set(build_prompt_set(path, tokenizer, context))
    except InputError as e:
        return None, (as_inline(e, path) if is_inline(cfg.spec) else e).problems
    if cfg.spec:  # the config's per-route settings, checked against the spec's routes (world.routes: at construction)
        try:
            cfg.opd.check_routes(ps.routes, f"the routes of {spec_label(cfg.spec)}")
        except ValueError as e:
            return ps, [Problem(CONFIG, "opd", str(e))]
    return ps, []


def context_problems(ps, rec, registry_file: str) -> list[Problem]:
    """A context teacher (``wrapper: context``) reads its route's privileged context on every row: rows of the
    prompt set ``ps`` without one are refused (counted per split), naming the spec fields that give it."""
    if getattr(rec, "wrapper", "plain") != "context" or ps is None or rec.route not in ps.routes:
        return []
    render = ps.route(rec.route).render
    if render.kind == "format" and "{context}" in render.template:
        return [Problem(ps.spec.path or "<spec>", f"routes[{rec.route}].render.template", f"writes {{context}} into "
                        f"the student's prompt, and teacher {rec.name!r} (wrapper context) reads it as privileged "
                        "context the student must not see; expected a template without {context}")]
    empty = {split: sum(not str(c).strip() for c in ps.rows(split)[rec.route]["context"]) for split in ("train", "eval")}
    if not any(empty.values()):
        return []
    return [Problem(registry_file, f"teacher {rec.name!r}.wrapper", f"context: it reads route {rec.route}'s "
                    f"privileged context, and {empty['train']} training / {empty['eval']} held-out row(s) have none; "
                    f"expected routes[{rec.route}].data.context_column or data.context_function in the spec")]


def first_prompt_messages(ps, route: str) -> list[dict[str, str]] | None:
    """The chat messages of ``route``'s first training row in prompt set ``ps`` (read back from the spec's data: the
    prompt set keeps the rendered text only), or None when the route renders no chat or its rows do not read."""
    from tasks.specs.render import messages
    from tasks.specs.spec import load_route_rows

    if ps is None or route not in ps.routes or ps.route(route).render.kind != "chat":
        return None
    try:
        rows = load_route_rows(ps.route(route), ps.spec)["train"]
    except InputError:
        return None
    return messages(ps.route(route), rows[0]) if len(rows) else None


# ------------------------------------------------------------------------------------------------------ checkpoints


@dataclass
class Checkpoint:
    """What the cheap checks of one checkpoint found: its config and tokenizer (None when they did not load)."""

    uri: str
    config: Any = None
    tokenizer: Any = None
    problems: list[Problem] = field(default_factory=list)


def _is_local(uri: str) -> bool:
    """A path (it exists, or is written like one) rather than a hub id such as ``org/name``."""
    return Path(uri).expanduser().exists() or uri.startswith(("/", ".", "~"))


def weights_problems(folder: Path, field_name: str) -> list[Problem]:
    """Every ``*.safetensors`` file (and every shard a ``*.safetensors.index.json`` names) has a readable header with
    tensors; a folder with pickle weights only is refused (loading them can run code)."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    problems = []
    for index in sorted(folder.glob("*.safetensors.index.json")):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            problems.append(Problem(str(index), field_name, f"unreadable shard index ({_first_line(e)}); expected "
                                    'JSON with a "weight_map"'))
            continue
        for shard in sorted(s for s in shards if not (folder / s).is_file()):
            problems.append(Problem(str(folder / shard), field_name, f"missing, named by {index.name}; expected the "
                                    "shard next to its index"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        found = f"only pickle weights {pickles}" if pickles else "no *.safetensors weights"
        return problems + [Problem(str(folder), field_name, f"{found}; expected safetensors weights "
                                   "(model.safetensors): pickle weights are never loaded, they can run code")]
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                empty = not list(sf.keys())
        except Exception as e:  # a truncated download, a file that is not safetensors, no permission
            problems.append(Problem(str(f), field_name, f"unreadable ({_first_line(e)}); expected a complete "
                                    "safetensors file (re-save or re-download it)"))
            continue
        if empty:
            problems.append(Problem(str(f), field_name, "holds no tensors; expected the model's weights"))
    return problems


def check_checkpoint(uri: str, field_name: str, trust_remote_code: bool = False,
                     grant: str = ", or trust_remote_code: true in its registry entry", base: str = "") -> Checkpoint:
    """The cheap checks of one checkpoint (local folder or hub id); ``grant`` ends the expectation when the config asks
    for custom code (how it could be allowed, if at all); ``base``: the base a LoRA adapter folder loads onto, where
    its registry record names one (else the one its adapter_config.json names)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    from tasks.common.adapters import ADAPTER_CONFIG, base_of
    from tasks.specs.tokenizer import load_tokenizer

    ck = Checkpoint(uri)
    config_file = uri
    if _is_local(uri):
        folder = Path(uri).expanduser()
        if not folder.is_dir():
            ck.problems.append(Problem(uri, field_name, "no checkpoint folder there; expected a folder with "
                                       "config.json, *.safetensors weights and the tokenizer files"))
            return ck
        try:
            base = base_of(folder, base)
        except ValueError as e:
            if not base:
                ck.problems.append(Problem(str(folder / ADAPTER_CONFIG), field_name, str(e)))
                return ck
        if base is not None:  # a LoRA adapter folder: its base is the checkpoint, its own weights the adapter's
            inner = check_checkpoint(base, f"{field_name} (the adapter's base)", trust_remote_code, grant)
            ck.config, ck.problems = inner.config, inner.problems + weights_problems(folder, field_name)
            try:
                ck.tokenizer = load_tokenizer(uri, trust_remote_code=trust_remote_code, base=base)
            except Exception as e:
                ck.problems.append(Problem(uri, f"{field_name} (tokenizer)", f"tokenizer does not load "
                                           f"({_first_line(e)}); expected tokenizer files with the adapter or its base"))
            return ck
        config_file = str(folder / "config.json")
        try:
            doc = json.loads((folder / "config.json").read_text())
        except FileNotFoundError:
            ck.problems.append(Problem(config_file, field_name, "missing; expected the model's Hugging Face config"))
            doc = None
        except (OSError, ValueError) as e:
            ck.problems.append(Problem(config_file, field_name, f"unreadable ({_first_line(e)}); expected a JSON "
                                       "model config"))
            doc = None
        if isinstance(doc, dict) and doc.get("auto_map") and not trust_remote_code:
            ck.problems.append(Problem(config_file, "auto_map", f"asks for the checkpoint's own Python code "
                                       f"({sorted(doc['auto_map'])}); expected a built-in transformers "
                                       f"architecture{grant}"))
            doc = None
        ck.problems += weights_problems(folder, field_name)
        load_config = doc is not None
    else:
        load_config = True
    if load_config:
        try:
            ck.config = AutoConfig.from_pretrained(uri, trust_remote_code=trust_remote_code)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for "not loadable"
            ck.problems.append(Problem(config_file, field_name, f"config does not load ({_first_line(e)}); "
                                       "expected a transformers model config"))
    if ck.config is not None and type(ck.config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not (
            trust_remote_code and "AutoModelForCausalLM" in (getattr(ck.config, "auto_map", None) or {})):
        ck.problems.append(Problem(config_file, "model_type", f"{ck.config.model_type!r} has no causal-LM class in "
                                   "transformers; expected a decoder-only causal LM (llama, qwen2, gpt2, ...)"))
    try:
        ck.tokenizer = load_tokenizer(uri, trust_remote_code=trust_remote_code)
    except Exception as e:
        ck.problems.append(Problem(uri, f"{field_name} (tokenizer)", f"tokenizer does not load ({_first_line(e)}); "
                                   "expected tokenizer files saved with the checkpoint"))
    vocab = getattr(ck.config, "vocab_size", None)
    if ck.tokenizer is not None and isinstance(vocab, int) and vocab < len(ck.tokenizer):
        ck.problems.append(Problem(config_file, "vocab_size", f"{vocab} < {len(ck.tokenizer)} tokens of its "
                                   "tokenizer; expected an embedding row for every token (a vocab_size padded "
                                   "past the tokenizer is fine, one short of it is not)"))
    return ck


def tokenizer_problems(student, teacher, teacher_uri: str, field_name: str,
                       messages: list[dict[str, str]] | None = None) -> list[Problem]:
    """The teacher must score the student's exact tokens (:func:`tasks.specs.tokenizer.compatibility_problems`;
    ``messages``: a route's first prompt, which a teacher's own chat template must render as the student's)."""
    from tasks.specs.tokenizer import compatibility_problems

    problems = compatibility_problems(student, teacher, messages)
    other = student.get_vocab() != teacher.get_vocab()
    return [Problem(teacher_uri, f"{field_name} (tokenizer)", f"{p}; expected the student's tokenizer" +
                    (" (a teacher of another tokenizer teaches as an aligned teacher: register it with --wrapper "
                     "aligned)" if other else "")) for p in problems]


def stop_token_problems(uri: str, teacher_tok, config, student_tok, field_name: str) -> list[Problem]:
    """Every id a teacher stops on (its tokenizer's EOS and its ``generation_config.eos_token_id``, one or a list)
    must be a token of the student's vocabulary (below ``len(student_tok)``): teacher samples end on them, and the
    student must be able to produce what it learns from."""
    from transformers import GenerationConfig

    from tasks.modeling.rollout import eos_ids

    try:
        generation = GenerationConfig.from_pretrained(uri)
    except Exception:  # no generation_config.json: the model config's eos_token_id is what generation reads
        generation = getattr(config, "eos_token_id", None)
        generation = GenerationConfig(eos_token_id=generation) if generation is not None else None
    ids = eos_ids(teacher_tok, generation)
    bad = [i for i in ids if not 0 <= i < len(student_tok)]
    if not bad:
        return []
    where = str(Path(uri) / "generation_config.json") if _is_local(uri) else uri
    return [Problem(where, f"{field_name} eos_token_id", f"stop token ids {bad} (of {list(ids)}) lie outside the "
                    f"student's {len(student_tok)} tokens; expected stop tokens the student can produce")]


def architecture(config) -> dict[str, Any]:
    return {k: getattr(config, k, None) for k in ARCH_FIELDS}


def architecture_problems(rec, teacher_config, student: Checkpoint, student_fingerprint: Callable[[], str | None],
                          field_name: str) -> list[Problem]:
    """A teacher whose registry provenance says it was fine-tuned from the student's checkpoint must have its
    architecture (see the module docstring); nothing to check otherwise."""
    base = rec.provenance.base
    if not base or teacher_config is None or student.config is None:
        return []
    if base.startswith("sha256:"):
        from_student = base == student_fingerprint()
    else:
        from_student = _is_local(base) and _is_local(student.uri) and \
            Path(base).expanduser().resolve() == Path(student.uri).expanduser().resolve()
    if not from_student:
        return []
    mine, theirs = architecture(teacher_config), architecture(student.config)
    diff = {k: (mine[k], theirs[k]) for k in ARCH_FIELDS if mine[k] != theirs[k]}
    if not diff:
        return []
    shown = ", ".join(f"{k} {a!r} (base {b!r})" for k, (a, b) in diff.items())
    return [Problem(str(Path(rec.model_uri) / "config.json") if _is_local(rec.model_uri) else rec.model_uri,
                    f"{field_name} architecture",
                    f"{shown}: its provenance.base {base} is the student's checkpoint {student.uri}, so it should be a "
                    "fine-tune of it; expected the base's architecture (the checkpoint at model_uri was replaced or "
                    "registered with the wrong provenance: re-register it)")]


def leakage_problems(rec, eval_prompts: list[str], current: str, field_name: str) -> list[Problem]:
    """A teacher trained on another prompt set of this project (``provenance.data``, a folder name) must not have
    seen this merge's held-out prompts of its route."""
    from tasks.common.paths import prompt_sets_dir
    from tasks.specs.prompt_set import PROMPT_SET_NAME_RE, load_prompt_set

    data = rec.provenance.data
    if not data or not PROMPT_SET_NAME_RE.match(data) or data == current:
        return []  # not a prompt set folder name (so never opened as a path), or this very prompt set
    folder = prompt_sets_dir() / data
    if not (folder / "DONE").exists():
        return []
    seen = set(load_prompt_set(folder).sets("train").get(rec.route, ([], []))[0])
    leaked = sorted(seen & set(eval_prompts))
    if not leaked:
        return []
    return [Problem(str(folder / "prompts"), f"{field_name} provenance.data",
                    f"the teacher trained on prompt set {data}, whose train split holds {len(leaked)} of the "
                    f"{len(set(eval_prompts))} held-out prompts of route {rec.route} in this merge's {current} "
                    f"(e.g. {leaked[:3]}); expected held-out prompts it never saw: build the merge's prompts with "
                    "the specialists' settings, or retrain them on these")]


def checkpoint_fingerprint_of(uri: str) -> str | None:
    from tasks.modeling.models import checkpoint_fingerprint

    try:
        return checkpoint_fingerprint(uri)
    except OSError:
        return None


def teacher_problems(rec, student: Checkpoint, registry_file: str, eval_prompts: list[str] | None,
                     current: str, student_fingerprint: Callable[[], str | None] | None = None,
                     first_prompt: Callable[[], list[dict[str, str]] | None] | None = None) -> list[Problem]:
    """Every check of one routed teacher against the student (``student_fingerprint``: computed on first need;
    ``first_prompt``: the chat messages of its route's first prompt, asked for only when the teacher's tokenizer
    carries a chat template other than the student's)."""
    from tasks.specs.tokenizer import tokenizer_fingerprint

    name = f"teacher {rec.name!r}"
    grant = f", or trust_remote_code: true granted in its registry entry ({registry_file})"
    from tasks.modeling.models import base_problems

    base = getattr(rec, "base_model", "")
    ck = check_checkpoint(rec.model_uri, f"{name}.model_uri", rec.trust_remote_code, grant, base)
    problems = list(ck.problems) + [Problem(registry_file, f"{name}.base_model", p)
                                    for p in base_problems(rec.model_uri, base, getattr(rec, "base_fingerprint", ""))]
    aligned = reads_own_text(rec)
    if ck.tokenizer is not None:
        own = getattr(ck.tokenizer, "chat_template", None)
        if aligned:  # another tokenizer and template: it renders its own input, so it must be able to
            from tasks.modeling.alignment import aligned_problems

            messages = first_prompt() if first_prompt is not None else None
            problems += [Problem(rec.model_uri, f"{name}.model_uri (tokenizer)", p)
                         for p in aligned_problems(ck.tokenizer, messages)]
        elif student.tokenizer is not None:
            messages = (first_prompt() if first_prompt is not None
                        and own != getattr(student.tokenizer, "chat_template", None) else None)
            problems += tokenizer_problems(student.tokenizer, ck.tokenizer, rec.model_uri, f"{name}.model_uri",
                                           messages)
            problems += stop_token_problems(rec.model_uri, ck.tokenizer, ck.config, student.tokenizer,
                                            f"{name}.model_uri")
        fp = tokenizer_fingerprint(ck.tokenizer)
        if fp != rec.tokenizer_fingerprint:
            problems.append(Problem(registry_file, f"{name}.tokenizer_fingerprint", f"{rec.tokenizer_fingerprint} "
                                    f"recorded, but the tokenizer at {rec.model_uri} is {fp}; expected the tokenizer "
                                    "it was registered with (re-register the checkpoint)"))
    problems += architecture_problems(
        rec, ck.config, student, student_fingerprint or cache(lambda: checkpoint_fingerprint_of(student.uri)), name)
    if eval_prompts is not None:
        problems += leakage_problems(rec, eval_prompts, current, name)
    return problems


# ---------------------------------------------------------------------------------------------------- entry points


def finish(problems: list[Problem], report: Report, say_warnings: bool) -> Report:
    """Raise :class:`InputError` listing ``problems``, or say the report's warnings and return it."""
    if problems:
        raise InputError(problems)
    if say_warnings:
        from tasks.common.log import say

        for w in report.warnings:
            say(f"warning: {w}")
    return report
