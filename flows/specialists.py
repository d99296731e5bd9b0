"""Flow `train specialists`: one fine-tune of the base per route of the route spec (fanned out on Prefect's task
runner), each evaluated on its route's held-out prompts and registered as a teacher of that route. ``--trainer sft`` (default) fine-tunes on the
gold completions (``--train.*``); ``--trainer rl`` runs GRPO from the base with the route's verifier as the reward
(``--rl.*``), an RLVR teacher. Cached: a rerun skips finished specialists.
A specialist that fails (after its --retries) does not stop the others: they are registered and cached, the flow then
fails naming it, and the same command again trains only what is missing.

Run:  python -m flows.specialists [--profile quick] [--base_uri PATH] [--train.steps 600] [--workers 2] ...
      python -m flows.specialists --spec my_routes.yaml --base_uri PATH ...
      python -m flows.specialists --profile quick --trainer rl [--rl.steps 60] [--name_prefix rlspec] ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from prefect import flow
from prefect.task_runners import ThreadPoolTaskRunner

from flows.names import from_parameters, specialists_name
from tasks.common.log import say
from tasks.common.problems import UserError
from tasks.config import SpecialistsConfig, pipeline_config
from tasks.modeling.models import checkpoint_fingerprint
from tasks.preflight import CONFIG, Problem
from tasks.training.pretrain import folder_gone, latest_base, prompt_set_task
from tasks.specs.prompt_set import load_prompt_set
from tasks.tracking.runs import publish_teacher, setup_mlflow, teacher_model_name
from tasks.training.specialist import SPECIALISTS_EXPERIMENT, recipe_problems, route_recipe, train_specialist
from teachers.registry import Provenance, TeacherRegistry


# What a Ray worker process needs to find the same state, tracking store and Prefect API as this process.
_RAY_ENV = ("OPD_HOME", "OPD_REGISTRY", "PREFECT_HOME", "PREFECT_API_URL", "PREFECT_RESULTS_LOCAL_STORAGE_PATH",
            "PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS",
            "MLFLOW_TRACKING_URI", "OMP_NUM_THREADS", "GOMP_SPINCOUNT", "TOKENIZERS_PARALLELISM")


def task_runner(cfg: SpecialistsConfig):
    """Threads by default; a Ray cluster (local, or ``cfg.ray_address``) through prefect-ray when asked."""
    if cfg.runner == "threads":
        return ThreadPoolTaskRunner(max_workers=cfg.workers)
    try:
        from prefect_ray import RayTaskRunner
    except ImportError as e:
        raise RuntimeError("runner 'ray' needs the ray extra: pip install -e '.[ray]'") from e
    env = {k: os.environ[k] for k in _RAY_ENV if k in os.environ}
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():  # the server this flow reports to (also a test harness's), not a new ephemeral one
        env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    init = {"runtime_env": {"env_vars": env}}
    if not cfg.ray_address:
        init.update(num_cpus=cfg.workers, include_dashboard=False, log_to_driver=False)
    return RayTaskRunner(address=cfg.ray_address or None, init_kwargs=init)


@flow(name="train-specialists", flow_run_name=from_parameters(SpecialistsConfig, specialists_name))
def train_specialists(cfg: SpecialistsConfig = SpecialistsConfig()) -> list[str]:
    """Train, evaluate and register one specialist per route; returns the registered teacher names."""
    base_uri = cfg.base_uri or latest_base()
    prompt_set = prompt_set_task(cfg.spec, cfg.world, base_uri)
    ps = load_prompt_set(prompt_set)
    routes = ps.routes
    base_fp = checkpoint_fingerprint(base_uri) if Path(base_uri).exists() else base_uri
    # Create the tracking store and experiment here, once: worker processes (Ray) racing to create a fresh sqlite
    # store's tables fail.
    setup_mlflow(SPECIALISTS_EXPERIMENT)
    # Each route's recipe: the flow's, with the fields its spec's `specialist` sets (e.g. more steps for a hard route).
    recipes = {r: route_recipe(cfg.rl if cfg.trainer == "rl" else cfg.train, r, ps.route(r).specialist)
               for r in routes}
    train = train_specialist.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_seconds)
    params = [dict(prompt_set=prompt_set, route=r, base_uri=base_uri, base_fingerprint=base_fp, train=recipes[r])
              for r in routes]
    with task_runner(cfg) as runner:
        results = [f.result(raise_on_failure=False) for f in [runner.submit(train, parameters=p) for p in params]]
        # A cached specialist whose folder is gone (deleted to free disk) is trained again, not registered.
        gone = [i for i, res in enumerate(results) if isinstance(res, dict) and folder_gone(res["uri"])]
        if gone:
            say("cached specialists whose folders are gone, trained again: "
                + ", ".join(f"{routes[i]} ({results[i]['uri']})" for i in gone))
            again = train.with_options(refresh_cache=True)
            for i, f in [(i, runner.submit(again, parameters=params[i])) for i in gone]:
                results[i] = f.result(raise_on_failure=False)
    registry = TeacherRegistry()
    names, failed, below = [], [], {}
    for route, res in zip(routes, results):
        if isinstance(res, BaseException):
            failed.append(f"{route}: {type(res).__name__}: {res}")
            continue
        if res["accuracy"] < cfg.min_accuracy:
            below[route] = res["accuracy"]
            continue
        name = cfg.teacher_name(route)
        record = registry.register_checkpoint(
            name, route, res["uri"], Path(prompt_set) / "tokenizer", eval_score=res["accuracy"], replace=True,
            provenance=Provenance(base=base_fp, data=Path(prompt_set).name, config_hash=recipes[route].config_hash(),
                                  source="train-specialists-rl" if cfg.trainer == "rl" else "train-specialists"),
        )
        version = publish_teacher(record, res["mlflow_run_id"])
        names.append(name)
        say(f"registered teacher {name} ({route}, accuracy {res['accuracy']:.3f}); MLflow model "
            f"{teacher_model_name(route)} version {version}")
    if failed:  # training raised: a bug or the machine, with its traceback
        failed += [f"{r}: accuracy {a:.3f} < min_accuracy {cfg.min_accuracy}" for r, a in below.items()]
        raise RuntimeError(f"{len(failed)} specialist(s) failed (the {len(names)} others are registered): " + "; ".join(failed))
    if below:  # an expected outcome, said in a few lines
        refusal = SpecialistsBelowThreshold(below, cfg.min_accuracy, {r: recipes[r].steps for r in below}, names)
        if cfg.below_min_accuracy == "fail" or not names:
            raise refusal
        say("going on without them (below_min_accuracy skip):\n" + "\n".join(f"  {line}" for line in refusal.lines))
    return names


class SpecialistsBelowThreshold(UserError):
    """Specialists that trained and ended below ``min_accuracy``: not registered; the ones that passed are."""

    def __init__(self, below: dict[str, float], threshold: float, steps: dict[str, int], registered: list[str]):
        self.below, self.registered = below, registered
        self.lines = [f"specialist {r}: accuracy {a:.3f} on its held-out prompts after {steps[r]} steps, below "
                      f"min_accuracy {threshold}; not registered" for r, a in below.items()]
        self.lines.append(f"registered and kept: {', '.join(registered)}" if registered else "no specialist registered")
        self.lines.append("to change: more steps (--train.steps, or the route's `specialist: {steps: N}` in its spec), "
                          "a larger base (--base_model), or a lower --min_accuracy")
        super().__init__("\n".join(self.lines))


def _problems(cfg: SpecialistsConfig) -> list[Problem]:
    """An empty ``base_uri`` means the last `prepare base` run's, which must exist; a spec's per-route
    ``specialist`` fields must belong to the recipe of ``trainer``."""
    problems = []
    if cfg.spec:
        from tasks.specs.spec import read_spec

        problems += recipe_problems(read_spec(cfg.spec), cfg.rl if cfg.trainer == "rl" else cfg.train)
    if not cfg.base_uri:
        try:
            latest_base()
        except FileNotFoundError as e:
            problems.append(Problem(CONFIG, "base_uri", f"empty, and {e}"))
    return problems


def main(argv: list[str] | None = None) -> list[str]:
    from tasks.cli import parse_config

    cfg = parse_config(argv, lambda profile="default": pipeline_config(profile).specialists(""), __doc__,
                       with_profile=True, check=_problems)  # refused before Prefect starts
    return train_specialists(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
