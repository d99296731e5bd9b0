"""The built-in world as one provider of route specs: it writes the spec file a user would write (``routes.yaml``)
and one JSON Lines file per route (prompt, answer, gold completion, split), so that what the pipeline reads about the
built-in world is the same kind of data as a user's. Nothing in the spec is special to the world: prompts are
already rendered (``render: {kind: format}`` over the world's own tag template; its character tokenizer, which the
spec names, has no chat template), the verifier is ``exact`` on the text after the last ``|`` with the route's shape
as ``verify.format``, and the length cap comes from the gold completions.

    from tasks.config import pipeline_config
    from tasks.world.spec import write_world_spec
    path = write_world_spec(pipeline_config("quick").world)   # .opd/world/v4-<hash>/route-spec/routes.yaml
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.world.config import WorldConfig
from tasks.world.data import build_world, load_prompts, max_new_tokens_for, rows_by_route
from tasks.specs.tokenizer import load_tokenizer
from tasks.world.domains import ANSWER_SEP, Route, format_pattern

SPEC_FOLDER = "route-spec"
# Every route's verifier: the final answer after the last separator, compared exactly (tasks.world.domains.verify's rule).
WORLD_VERIFY = {"kind": "exact", "answer_after": ANSWER_SEP}


def world_verifiers(routes: list[str]) -> dict:
    """route -> the verifier its spec gets, for code that draws world prompts without a prompt set (benchmarks)."""
    from tasks.specs.spec import VerifySpec

    verify = VerifySpec(**WORLD_VERIFY).build()
    return {r: verify for r in routes}


def write_world_spec(cfg: WorldConfig, world_path: str | Path | None = None) -> Path:
    """Write (once per world) ``<world>/route-spec/routes.yaml`` and ``<world>/route-spec/<route>.jsonl``; returns
    the spec. Every route gets the same cap, the world's longest training completion + EOS + a margin
    (:func:`tasks.world.data.max_new_tokens_for`): the cap the pipeline has always used, kept so retention stays comparable
    across versions."""
    import yaml

    world = Path(world_path) if world_path else build_world(cfg)
    out = world / SPEC_FOLDER
    spec_path = out / "routes.yaml"
    if spec_path.exists():
        return spec_path
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(world)
    splits = {name: rows_by_route(prompts[name]) for name in ("train", "eval")}
    cap = max_new_tokens_for(load_tokenizer(world / "tokenizer"), prompts["train"]["completion"])
    routes = []
    for name in cfg.routes:
        route = Route.parse(name)
        lines = []
        for split in ("train", "eval"):
            d = splits[split][name]
            lines += [json.dumps({"prompt": p, "answer": a, "completion": c, "split": split})
                      for p, a, c in zip(d["prompt"], d["answer"], d["completion"])]
        (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        routes.append({
            "name": name,
            "labels": {"domain": route.domain, "budget": route.budget},
            "data": {"source": f"{name}.jsonl", "prompt_column": "prompt", "answer_column": "answer",
                     "completion_column": "completion", "split_column": "split"},
            "render": {"kind": "format", "template": "{prompt}"},
            "generate": {"max_new_tokens": cap, "temperature": 1.0},
            "verify": {**WORLD_VERIFY, "format": format_pattern(route)},
            "teacher": "newest",
        })
    (tmp / "routes.yaml").write_text(
        f"# Written by tasks/world/spec.py from the built-in world {world.name}: an example of a route spec.\n"
        + yaml.safe_dump({"version": 1, "tokenizer": "../tokenizer", "routes": routes}, sort_keys=False))
    tmp.rename(out)
    return spec_path
