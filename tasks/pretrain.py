"""Create the base model from a config and pre-train it briefly on the mixed world (weak but non-zero everywhere)."""

from __future__ import annotations

from pathlib import Path

from prefect import task

from tasks.config import PretrainConfig
from tasks.log import say
from tasks.data import build_world, eval_sets, load_prompts, max_new_tokens_for
from tasks.evaluate import evaluate_routes
from tasks.models import create_model, save_model
from tasks.paths import models_dir, state_cache_policy
from tasks.tokenizer import load_tokenizer
from tasks.train import train_sft
from tasks.tracking import config_params, end_run, log_metrics, start_run


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


@task(name="build-world", cache_policy=state_cache_policy(), persist_result=True)
def _build_world(cfg) -> str:
    return str(build_world(cfg))


def build_world_task(cfg) -> str:
    """Tokenizer and prompt sets on disk (a cached task); returns the world folder."""
    return cached(_build_world, lambda path: path, cfg)


def pretrain_base(cfg: PretrainConfig, world_path: str) -> dict:
    """Pre-train a fresh base on all routes' gold completions (a cached task); returns its URI and per-route
    accuracy."""
    return cached(_pretrain_base, lambda res: res["uri"], cfg, world_path)


@task(name="pretrain-base", cache_policy=state_cache_policy(), persist_result=True)
def _pretrain_base(cfg: PretrainConfig, world_path: str) -> dict:
    tok = load_tokenizer(Path(world_path) / "tokenizer")
    train = load_prompts(world_path)["train"]
    model = create_model(tok, seed=cfg.train.seed, **cfg.model.model_dump())
    run_id = start_run("opd-base", f"base-{cfg.config_hash()}", config_params(cfg))
    train_sft(model, tok, train["prompt"], train["completion"], cfg.train, desc="base pre-training",
              on_log=lambda s, l: log_metrics(run_id, {"train/loss": l}, s))
    cap = max_new_tokens_for(tok, train["completion"])
    scores = evaluate_routes(model, tok, eval_sets(world_path), cap)
    log_metrics(run_id, {f"accuracy/{r}": s.accuracy for r, s in scores.items()}, cfg.train.steps)
    out = save_model(model, tok, models_dir() / f"base-{cfg.config_hash()}")
    end_run(run_id, {"model_uri": str(out)})
    (models_dir() / "LATEST_BASE").write_text(str(out))
    return {"uri": str(out), "accuracy": {r: s.accuracy for r, s in scores.items()}}


def latest_base() -> str:
    """The base the last `prepare base` run produced (what an empty base/student URI means)."""
    marker = models_dir() / "LATEST_BASE"
    if not marker.exists():
        raise FileNotFoundError(
            f"no base model yet ({marker} missing): run `python -m flows.base` or the pipeline first, or pass a URI"
        )
    return marker.read_text().strip()
