"""Prompt sets as Hugging Face ``datasets``: generated deterministically from the world config and cached on disk.

Each row: ``route, problem, prompt, completion, answer``. ``prompt`` is the full text the models see
(``<bos><sort><high>5203=``), ``completion`` the gold text without EOS (only base pre-training and specialist
fine-tuning read it; the merge reads prompts alone).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset, load_from_disk

from tasks.config import WorldConfig
from tasks.paths import world_dir
from tasks.tokenizer import build_char_tokenizer, save_tokenizer
from tasks.world import (
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


def load_prompt_file(path: str | Path, route: Route) -> list[str]:
    """Problems from a user's JSONL/parquet file (column ``problem``), each checked against the route's domain."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file for route {route.name} not found: {path}")
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise ValueError(f"prompt file {path}: expected .jsonl or .parquet, got {path.suffix!r}")
    ds = load_dataset(kind, data_files=str(path), split="train")
    if "problem" not in ds.column_names:
        raise ValueError(f"prompt file {path}: needs a 'problem' column, has {ds.column_names}")
    dom = domain_of(route)
    problems = [str(p) for p in ds["problem"]]
    for i, p in enumerate(problems):
        if not dom.problem_re.match(p):
            raise ValueError(
                f"prompt file {path}, row {i + 1}: problem {p!r} is not a valid {dom.name!r} problem "
                f"(expected to match {dom.problem_re.pattern})"
            )
    if not problems:
        raise ValueError(f"prompt file {path} has no rows")
    return problems


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
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
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
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    # The latest world's tokenizer is also the registry CLI's default reference tokenizer.
    shutil.copytree(out / "tokenizer", (root or world_dir()) / "tokenizer", dirs_exist_ok=True)
    return out


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
