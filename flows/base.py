"""Flow `prepare base`: build the built-in world and pre-train a small base on it.

Run:  python -m flows.base [--profile quick] [--train.steps 500] [--model.hidden_size 128] ...
"""

from __future__ import annotations

import sys

from prefect import flow

from tasks.log import say
from tasks.config import PretrainConfig, pipeline_config
from tasks.pretrain import build_world_task, pretrain_base


@flow(name="prepare-base")
def prepare_base(cfg: PretrainConfig = PretrainConfig()) -> dict:
    """World (tokenizer + prompt sets) -> fresh base from a config -> brief pre-training -> checkpoint URI."""
    world_path = build_world_task(cfg.world)
    say(f"world: {world_path}")
    base = pretrain_base(cfg, world_path)
    say("base accuracy per route: " + ", ".join(f"{r} {a:.2f}" for r, a in base["accuracy"].items()))
    return {"world_path": world_path, **base}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config

    cfg = parse_config(argv, lambda profile="default": pipeline_config(profile).pretrain(), __doc__, with_profile=True)
    return prepare_base(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
