"""Train one specialist per route from the shared base, evaluate it on the route's held-out prompts, register it."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from tasks.log import say
from tasks.config import TrainConfig
from tasks.data import load_prompts, max_new_tokens_for
from tasks.evaluate import evaluate_route
from tasks.faults import fault
from tasks.models import load_model, save_model
from tasks.paths import models_dir
from tasks.tokenizer import load_tokenizer
from tasks.tracking import config_params, end_run, log_metrics, start_run, tracking_uri


SPECIALISTS_EXPERIMENT = "opd-specialists"


def specialist_dir(world_path: str, route: str, base_fingerprint: str, train: TrainConfig) -> Path:
    key = hashlib.sha256(f"{world_path}|{route}|{base_fingerprint}|{train.config_hash()}".encode()).hexdigest()[:12]
    return models_dir() / "specialists" / f"{route}-{key}"


# Cached on every input (the base is identified by its weights' fingerprint, not its path) and on this code:
# a rerun with the same inputs returns the finished specialist without training it again.
@task(
    name="train-specialist",
    task_run_name="train-specialist-{route}",
    cache_policy=INPUTS + TASK_SOURCE,
    persist_result=True,
    retries=0,
)
def train_specialist(world_path: str, route: str, base_uri: str, base_fingerprint: str, train: TrainConfig) -> dict:
    """Fine-tune a copy of the base on one route; returns the checkpoint URI and held-out accuracy."""
    from tasks.train import train_sft

    tok = load_tokenizer(base_uri)
    prompts = load_prompts(world_path)
    tr = prompts["train"].filter(lambda x: x["route"] == route)
    ev = prompts["eval"].filter(lambda x: x["route"] == route)
    if len(tr) == 0:
        raise ValueError(f"route {route}: no training prompts in {world_path}")
    model = load_model(base_uri)
    run_id = start_run(SPECIALISTS_EXPERIMENT, f"specialist-{route}",
                       {**config_params(train), "route": route, "base_uri": base_uri, "base_fingerprint": base_fingerprint})
    try:
        train_sft(model, tok, tr["prompt"], tr["completion"], train, desc=f"specialist {route}",
                  on_log=lambda s, l: log_metrics(run_id, {"train/loss": l}, s))
        fault(f"specialist/{route}")  # test-only (tasks/faults.py): a failure after the work, before the save
        cap = max_new_tokens_for(tok, tr["completion"])
        score = evaluate_route(model, tok, route, ev["prompt"], ev["problem"], cap)
        log_metrics(run_id, {f"accuracy/{route}": score.accuracy, f"response_length/{route}": score.response_length},
                    train.steps)
        out = save_model(model, tok, specialist_dir(world_path, route, base_fingerprint, train))
        MlflowClient(tracking_uri()).log_artifacts(run_id, str(out), "checkpoint")  # what the model registry points at
    except BaseException:
        end_run(run_id, status="FAILED")  # a failed attempt must not look in progress; a retry starts a new run
        raise
    end_run(run_id, {"model_uri": str(out), "process": f"{socket.gethostname()}:{os.getpid()}"})
    say(f"specialist {route}: accuracy {score.accuracy:.3f} on {score.n} held-out prompts -> {out}")
    return {"route": route, "uri": str(out), "accuracy": score.accuracy, "mlflow_run_id": run_id}
