"""Flow `prepare base`: build the prompt set of a route spec (the built-in world's by default) and pre-train a small
base on it, or take a pretrained one (``--base_model``).

Run:  python -m flows.base [--profile quick] [--train.steps 500] [--model.hidden_size 128] ...
      python -m flows.base --spec my_routes.yaml [--base_model path/to/pretrained] ...
"""

from __future__ import annotations

import sys

from prefect import flow

from tasks.common.log import say
from tasks.config import PretrainConfig, pipeline_config
from tasks.modeling.convert import resolve_base
from tasks.training.pretrain import given_base, pretrain_base, prompt_set_task


@flow(name="prepare-base")
def prepare_base(cfg: PretrainConfig = PretrainConfig()) -> dict:
    """Route spec -> prompt set (tokenizer + rendered prompts) -> fresh base, pre-trained briefly (or the given base)
    -> checkpoint URI."""
    base_model = resolve_base(cfg.base_model)  # a known name (the real profile's SmolLM2) converted once
    prompt_set = prompt_set_task(cfg.spec, cfg.world, base_model, cfg.model.max_positions)
    say(f"prompt set: {prompt_set}")
    base = given_base(base_model, prompt_set) if base_model else pretrain_base(cfg, prompt_set)
    say("base accuracy per route: " + ", ".join(f"{r} {a:.2f}" for r, a in base["accuracy"].items()))
    return {"prompt_set": prompt_set, **base}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config

    cfg = parse_config(argv, lambda profile="default": pipeline_config(profile).pretrain(), __doc__, with_profile=True)
    return prepare_base(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
