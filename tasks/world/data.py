"""Prompt sets as Hugging Face ``datasets``: generated deterministically from the world config and cached on disk.

Each row: ``route, problem, prompt, completion, answer``. ``prompt`` is the full text the models see
(``<bos><sort><high>5203=``), ``completion`` the gold text without EOS (only base pre-training and specialist
fine-tuning read it; the merge reads prompts alone).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from datasets import Dataset, DatasetDict, concatenate_datasets, load_from_disk

from tasks.world.config import WorldConfig
from tasks.common.paths import building, world_dir
from tasks.specs.tokenizer import save_tokenizer
from tasks.world.tokenizer import build_char_tokenizer
from tasks.world.domains import (
    DEFAULT_TEMPLATE,
    WORLD_VERSION,
    Route,
    domain_of,
    format_prompt,
    gold_completion,
    sample_problems,
)

COLUMNS = ["route", "problem", "prompt", "completion", "answer"]


def _rows(route: Route, problems: list[str], template: str = DEFAULT_TEMPLATE) -> dict[str, list[str]]:
    dom = domain_of(route)
    return {
        "route": [route.name] * len(problems),
        "problem": problems,
        "prompt": [format_prompt(route, p, template=template) for p in problems],
        "completion": [gold_completion(route, p) for p in problems],
        "answer": [dom.answer(p) for p in problems],
    }


# A prompt-file row is too long when its prompt (default template), gold completion and EOS exceed this many tokens:
# the positions of the models the project creates (tasks.modeling.models.create_model's max_positions).
MAX_ROW_TOKENS = 128
MAX_LISTED = 20  # bad rows listed per file; the rest are counted


def load_prompt_file(path: str | Path, route: Route) -> list[str]:
    """Problems from a user's prompt file, checked row by row: JSON Lines (``.jsonl``/``.json``, one object per line,
    blank lines skipped) or ``.parquet``, each row with a string field ``problem`` that is a valid problem of the
    route's domain and whose prompt + gold completion + EOS fits :data:`MAX_ROW_TOKENS` tokens. The file must hold at
    least two distinct problems (one to train on, one to evaluate). Raises :class:`tasks.preflight.InputError` listing
    every bad row by line number (JSONL; row number for parquet), not only the first."""
    from tasks.common.problems import InputError, Problem

    path = Path(path)
    file, field = str(path), f"world.prompt_files[{route.name}]"
    if not path.is_file():
        raise InputError([Problem(file, field, "no such file; expected a .jsonl (one JSON object per line) or .parquet "
                                  "file with a 'problem' field")])
    if path.suffix in (".jsonl", ".json"):
        rows, problems = _jsonl_rows(path, field)
    elif path.suffix == ".parquet":
        rows, problems = _parquet_rows(path, field)
    else:
        raise InputError([Problem(file, field, f"suffix {path.suffix!r}; expected .jsonl, .json (JSON Lines) or .parquet")])
    problems = [Problem(file, where, message) for where, message in problems]
    dom = domain_of(route)
    valid: list[tuple[str, str]] = []
    for where, value in rows:
        if not isinstance(value, str):
            problems.append(Problem(file, where, f"'problem' is {type(value).__name__} {_shown(value)}; expected a "
                                    "string"))
        elif not dom.problem_re.match(value):
            problems.append(Problem(file, where, f"problem {_shown(value)} is not a valid {dom.name!r} problem "
                                    f"(expected to match {dom.problem_re.pattern})"))
        else:
            valid.append((where, value))
    texts = [format_prompt(route, p) + gold_completion(route, p) for _, p in valid]
    ids = build_char_tokenizer()(texts, add_special_tokens=False)["input_ids"] if texts else []
    for (where, p), row_ids in zip(valid, ids):
        if len(row_ids) + 1 > MAX_ROW_TOKENS:
            problems.append(Problem(file, where, f"problem {_shown(p)} makes a {len(row_ids) + 1}-token row (prompt, "
                                    f"gold completion, EOS); expected at most {MAX_ROW_TOKENS} tokens"))
    if not rows and not problems:
        problems.append(Problem(file, field, "no rows; expected at least one JSON object with a 'problem' field"))
    elif not problems and len(set(p for _, p in valid)) < 2:
        problems.append(Problem(file, field, f"{len(set(p for _, p in valid))} distinct problem(s); expected at least "
                                "2 (one to train on, one to evaluate)"))
    if len(problems) > MAX_LISTED:
        problems = problems[:MAX_LISTED] + [Problem(file, field, f"... and {len(problems) - MAX_LISTED} more bad rows")]
    if problems:
        raise InputError(problems, f"prompt file {file}")
    return [p for _, p in valid]


def _shown(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _jsonl_rows(path: Path, field: str) -> tuple[list[tuple[str, object]], list[tuple[str, str]]]:
    """``("line N, row R", problem value)`` per JSON object with a ``problem``, ``(where, message)`` per other line."""
    rows: list[tuple[str, object]] = []
    problems: list[tuple[str, str]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return [], [(field, f"unreadable ({type(e).__name__}: {e}); expected UTF-8 JSON Lines")]
    row = 0
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        row += 1
        where = f"line {n}, row {row}"  # the row number counts non-blank lines
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append((where, f"malformed JSON ({e.msg} at column {e.colno}); expected one JSON object "
                             "per line"))
            continue
        if not isinstance(doc, dict):
            problems.append((where, f"a JSON {type(doc).__name__}; expected an object with a 'problem' field"))
        elif "problem" not in doc:
            problems.append((where, f"no 'problem' field (fields: {sorted(doc)}); expected a 'problem' field"))
        else:
            rows.append((where, doc["problem"]))
    return rows, problems


def _parquet_rows(path: Path, field: str) -> tuple[list[tuple[str, object]], list[tuple[str, str]]]:
    """``("row R", problem value)`` per row of a parquet file with a ``problem`` column."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # not parquet, truncated, unreadable
        return [], [(field, f"unreadable parquet ({type(e).__name__}: {e}); expected a parquet file")]
    if "problem" not in table.column_names:
        return [], [(field, f"columns {table.column_names} has no 'problem'; expected a 'problem' column")]
    return [(f"row {i + 1}", v) for i, v in enumerate(table.column("problem").to_pylist())], []


def route_splits(cfg: WorldConfig, route: Route) -> tuple[list[str], list[str]]:
    """(train, eval) problems of a route; eval never overlaps train."""
    if route.name in cfg.prompt_files:
        problems = sorted(set(load_prompt_file(cfg.prompt_files[route.name], route)))
        split = Dataset.from_dict({"problem": problems}).train_test_split(
            test_size=min(cfg.eval_size, max(1, len(problems) // 10)), seed=cfg.seed
        )
        return list(split["train"]["problem"]), list(split["test"]["problem"])
    lo, hi = cfg.lengths(route.name)
    # Eval problems come from their own stream (seed offset) and training excludes them.
    eval_problems = sample_problems(route, cfg.eval_size, cfg.seed + 1_000_003, lo, hi)
    train = sample_problems(route, cfg.train_size, cfg.seed, lo, hi, exclude=set(eval_problems))
    return train, eval_problems


def build_world(cfg: WorldConfig, root: Path | None = None) -> Path:
    """Write the tokenizer and the prompt DatasetDict (train/eval over all routes) under ``world/<config hash>``.

    Cached: a second call with the same config returns the existing folder without regenerating.
    """
    out = (root or world_dir()) / f"v{WORLD_VERSION}-{cfg.config_hash()}"
    if (out / "DONE").exists():
        return out
    with building(out) as tmp:
        _write_world(cfg, tmp)
    # The latest world's tokenizer is also the registry CLI's default reference tokenizer.
    shutil.copytree(out / "tokenizer", (root or world_dir()) / "tokenizer", dirs_exist_ok=True)
    return out


def _write_world(cfg: WorldConfig, tmp: Path) -> None:
    save_tokenizer(build_char_tokenizer(), tmp / "tokenizer")
    train_parts, eval_parts = [], []
    for route in cfg.route_objs():
        tr, ev = route_splits(cfg, route)
        template = cfg.budget_templates.get(route.budget, DEFAULT_TEMPLATE)
        train_parts.append(Dataset.from_dict(_rows(route, tr, template)))
        eval_parts.append(Dataset.from_dict(_rows(route, ev, template)))
    DatasetDict(train=concatenate_datasets(train_parts), eval=concatenate_datasets(eval_parts)).save_to_disk(
        str(tmp / "prompts")
    )
    (tmp / "config.json").write_text(cfg.model_dump_json(indent=2))


def load_prompts(world_path: str | Path) -> DatasetDict:
    return load_from_disk(str(Path(world_path) / "prompts"))


def max_new_tokens_for(tok, completions: list[str], margin: int = 2) -> int:
    """Longest gold completion in tokens, plus its EOS and a margin: the rollout cap that never cuts a right answer."""
    return max(len(ids) for ids in tok(list(completions), add_special_tokens=False)["input_ids"]) + margin


def eval_sets(world_path: str | Path, split: str = "eval") -> dict[str, tuple[list[str], list[str]]]:
    """route -> (prompts, problems) of a split: what evaluation and retention are measured on."""
    return {r: (d["prompt"], d["problem"]) for r, d in rows_by_route(load_prompts(world_path)[split]).items()}


def rows_by_route(ds: Dataset) -> dict[str, Dataset]:
    """Split a prompt set per route (routes in first-seen order)."""
    routes = list(dict.fromkeys(ds["route"]))
    return {r: ds.filter(lambda x, r=r: x["route"] == r) for r in routes}
