"""The tasks under `prepare base`: the route spec a flow reads (the user's, or the built-in world's), its prompt set,
and the shared base: created from a config and pre-trained briefly on every route's reference completions (weak but
non-zero everywhere), or a given pretrained model."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import PretrainConfig, WorldConfig
from tasks.common.log import say
from tasks.evaluation.evaluate import evaluate_prompt_set
from tasks.modeling.device import place_trained
from tasks.modeling.models import create_model, load_model, save_model
from tasks.common.paths import models_dir, state_cache_policy
from tasks.common.problems import InputError
from tasks.specs.prompt_set import build_prompt_set, load_prompt_set
from tasks.specs.spec import as_inline, is_inline, write_inline_spec
from tasks.training.sft import train_sft
from tasks.tracking.runs import config_params, end_run, log_metrics, start_run


def folder_gone(path: str) -> bool:
    """A cached task result names a folder that is no longer there (deleted to free disk, or a moved state)."""
    return not Path(path).is_dir()


def cached(task_fn, path_of, *args):
    """``task_fn(*args)`` (a task cached on its inputs and code); when the folder its cached result names is gone,
    it runs again with the cache refreshed, instead of handing later steps a path to nothing."""
    res = task_fn(*args)
    if folder_gone(path_of(res)):
        say(f"{task_fn.name}: the cached result's folder {path_of(res)} is gone: running it again")
        res = task_fn.with_options(refresh_cache=True)(*args)
    return res


def spec_path(spec: str | Mapping[str, Any], world: WorldConfig) -> Path:
    """The route spec a flow reads: ``spec`` (the user's file), an inline spec written once to
    ``<state>/specs/inline-<sha12>/routes.yaml`` (:func:`tasks.specs.spec.write_inline_spec`), else the built-in world's,
    generated from ``world`` (written once per world)."""
    from tasks.world.spec import write_world_spec

    if is_inline(spec):
        return write_inline_spec(spec)
    return Path(spec).expanduser().resolve() if spec else write_world_spec(world)


@task(name="world-spec", cache_policy=state_cache_policy(), persist_result=True)
def _world_spec(cfg: WorldConfig) -> str:
    return str(spec_path("", cfg))


def spec_file(spec: str | Mapping[str, Any], world: WorldConfig) -> str:
    """:func:`spec_path`, the built-in world's through a cached task (visible in the Prefect UI)."""
    if spec:
        return str(spec_path(spec, world))
    return cached(_world_spec, lambda path: str(Path(path).parent), world)


@task(name="build-prompt-set", cache_policy=NO_CACHE)
def _build_prompt_set(spec_path: str, tokenizer: str, context: int) -> str:
    return str(build_prompt_set(spec_path, tokenizer, context))


def prompt_set_task(spec: str | Mapping[str, Any], world: WorldConfig, tokenizer: str = "", context: int = 128) -> str:
    """The prompt set of the flow's route spec, rendered with ``tokenizer`` (the folder of the model that reads it;
    empty: the spec's own). Validated every time (cheap); built once per spec text, data and tokenizer. The problems
    of an inline spec name it ``inline spec``, not the file it was written to."""
    path = spec_file(spec, world)
    try:
        return _build_prompt_set(path, tokenizer, context)
    except InputError as e:
        if is_inline(spec):
            raise as_inline(e, path) from None
        raise


def pretrain_base(cfg: PretrainConfig, prompt_set: str) -> dict:
    """Pre-train a fresh base on all routes' reference completions (a cached task); returns its URI and per-route
    accuracy."""
    return cached(_pretrain_base, lambda res: res["uri"], cfg, prompt_set)


def _record_base(uri: str) -> None:
    (models_dir() / "LATEST_BASE").parent.mkdir(parents=True, exist_ok=True)
    (models_dir() / "LATEST_BASE").write_text(str(uri))


@task(name="pretrain-base", cache_policy=state_cache_policy(), persist_result=True)
def _pretrain_base(cfg: PretrainConfig, prompt_set: str) -> dict:
    ps = load_prompt_set(prompt_set)
    tok = ps.tokenizer()
    train = ps.splits["train"]
    model = place_trained(create_model(tok, seed=cfg.train.seed, **cfg.model.model_dump()), cfg.train.device,
                          cfg.train.dtype)
    run_id = start_run("opd-base", f"base-{cfg.config_hash()}", config_params(cfg))
    train_sft(model, tok, train["prompt"], train["completion"], cfg.train, desc="base pre-training",
              on_log=lambda s, l: log_metrics(run_id, {"train/loss": l}, s), answers=train["answer"])
    scores = evaluate_prompt_set(model, tok, ps)
    log_metrics(run_id, {f"accuracy/{r}": s.accuracy for r, s in scores.items()}, cfg.train.steps)
    out = save_model(model, tok, models_dir() / f"base-{cfg.config_hash()}")
    end_run(run_id, {"model_uri": str(out)})
    _record_base(out)
    return {"uri": str(out), "accuracy": {r: s.accuracy for r, s in scores.items()}}


@task(name="evaluate-base", cache_policy=NO_CACHE)
def given_base(base_model: str, prompt_set: str) -> dict:
    """A pretrained base the user gave: evaluated on every route's held-out prompts and recorded as the base."""
    ps = load_prompt_set(prompt_set)
    model = load_model(base_model).eval()
    scores = evaluate_prompt_set(model, ps.tokenizer(), ps)
    _record_base(base_model)
    return {"uri": base_model, "accuracy": {r: s.accuracy for r, s in scores.items()},
            "exact": {r: s.exact for r, s in scores.items()}}


def latest_base() -> str:
    """The base the last `prepare base` run produced (what an empty base/student URI means)."""
    marker = models_dir() / "LATEST_BASE"
    if not marker.exists():
        raise FileNotFoundError(
            f"no base model yet ({marker} missing): run `python -m flows.base` or the pipeline first, or pass a URI"
        )
    return marker.read_text().strip()
