"""The built-in world as one provider of route specs: it writes the spec file a user would write (``routes.yaml``)
and one JSON Lines file per route (prompt, answer, gold completion, split), so that what the pipeline reads about the
built-in world is the same kind of data as a user's. Nothing in the spec is special to the world: prompts are
already rendered (``render: {kind: format}`` over the world's own tag template; its character tokenizer has no chat
template), the verifier is ``exact`` on the text after the last ``|``, lengths come from the gold completions.

    from tasks.config import pipeline_config
    from tasks.world_spec import write_world_spec
    path = write_world_spec(pipeline_config("quick").world)   # .opd/world/v4-<hash>/spec/routes.yaml
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.config import WorldConfig
from tasks.data import build_world, load_prompts, rows_by_route
from tasks.world import ANSWER_SEP, Route

SPEC_FOLDER = "spec"
# Rollout cap margin over the longest gold completion in characters (= tokens for the character tokenizer): EOS and
# one spare, as tasks.data.max_new_tokens_for allows.
CAP_MARGIN = 2


def write_world_spec(cfg: WorldConfig, world_path: str | Path | None = None) -> Path:
    """Write (once per world) ``<world>/spec/routes.yaml`` and ``<world>/spec/<route>.jsonl``; returns the spec."""
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
    routes = []
    for name in cfg.routes:
        route = Route.parse(name)
        lines = []
        for split in ("train", "eval"):
            d = splits[split][name]
            lines += [json.dumps({"prompt": p, "answer": a, "completion": c, "split": split})
                      for p, a, c in zip(d["prompt"], d["answer"], d["completion"])]
        (tmp / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        longest = max(len(c) for s in splits.values() for c in s[name]["completion"])
        routes.append({
            "name": name,
            "labels": {"domain": route.domain, "budget": route.budget},
            "data": {"source": f"{name}.jsonl", "prompt_column": "prompt", "answer_column": "answer",
                     "completion_column": "completion", "split_column": "split"},
            "render": {"kind": "format", "template": "{prompt}"},
            "generate": {"max_new_tokens": longest + CAP_MARGIN, "temperature": 1.0},
            "verify": {"kind": "exact", "answer_after": ANSWER_SEP},
            "teacher": "newest",
        })
    (tmp / "routes.yaml").write_text(
        f"# Written by tasks/world_spec.py from the built-in world {world.name}: an example of a route spec.\n"
        + yaml.safe_dump({"version": 1, "routes": routes}, sort_keys=False))
    tmp.rename(out)
    return spec_path
