"""Train one specialist per route from the shared base, evaluate it on the route's held-out prompts, register it.

Two trainers, picked by the recipe's type: a :class:`TrainConfig` fine-tunes on the route's gold completions (sft), an
:class:`RLConfig` runs GRPO from the base with the route's verifier as the reward (rl, an RLVR teacher). Both end in
the same evaluation, checkpoint and MLflow record."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import task

from tasks.common.log import say
from tasks.config import RLConfig, TrainConfig
from tasks.evaluation.evaluate import RouteScore, evaluate_route
from tasks.modeling.device import place_trained
from tasks.modeling.models import load_model
from tasks.common.paths import models_dir, state_cache_policy
from tasks.specs.prompt_set import load_prompt_set
from tasks.specs.tokenizer import load_tokenizer
from tasks.tracking.runs import config_params, end_run, log_metrics, start_run, tracking_uri


SPECIALISTS_EXPERIMENT = "opd-specialists"

Recipe = TrainConfig | RLConfig  # how a specialist is trained: sft on gold completions, or rl (GRPO)


def route_recipe(recipe: Recipe, route: str, overrides: Mapping[str, Any]) -> Recipe:
    """The recipe of one route's specialist: the flow's ``recipe`` with the route's spec ``specialist`` fields over
    it (validated again). ValueError naming the route for a field of the other trainer's recipe."""
    other = sorted(set(overrides) - set(type(recipe).model_fields))
    if other:
        raise ValueError(f"routes[{route}].specialist: {other} are not fields of the {trainer_of(recipe)} recipe "
                         f"(specialist_trainer is {trainer_of(recipe)}); expected some of "
                         f"{sorted(type(recipe).model_fields)}")
    return type(recipe).model_validate({**recipe.model_dump(), **overrides}) if overrides else recipe


def recipe_problems(spec, recipe: Recipe) -> list:
    """:func:`route_recipe` for every route of a route spec (:class:`tasks.specs.spec.RouteSpecFile`), as problems
    (the spec file, ``routes[<r>].specialist``) for the preflights: refused before anything trains."""
    from tasks.common.problems import Problem

    problems = []
    for route in spec.routes:
        try:
            route_recipe(recipe, route.name, route.specialist)
        except ValueError as e:
            problems.append(Problem(spec.path or "inline spec", f"routes[{route.name}].specialist", str(e)))
    return problems


def trainer_of(recipe: Recipe) -> str:
    """``"sft"`` or ``"rl"``: the trainer a recipe runs."""
    return "rl" if isinstance(recipe, RLConfig) else "sft"


def specialist_dir(prompt_set: str, route: str, base_fingerprint: str, recipe: Recipe) -> Path:
    # An sft specialist keeps the key it always had (finished folders stay valid); an rl one adds the trainer, so
    # the two never share a folder whatever their configs hash to.
    rl = trainer_of(recipe) == "rl"
    key_src = f"{prompt_set}|{route}|{base_fingerprint}|{'rl|' if rl else ''}{recipe.config_hash()}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:12]
    folder = route.replace(" ", "_")
    return models_dir() / "specialists" / (f"{folder}-rl-{key}" if rl else f"{folder}-{key}")


def log_eval(run_id: str, model, tok, route: str, verify, ev, cap: int, step: int, stop=(), exact=None) -> RouteScore:
    """Greedy accuracy on the route's held-out prompts (``verify``: its verifier; ``stop``: its stop strings), logged
    as ``accuracy/<route>`` at ``step``, with the exact-format figure (``exact``: the route's check) as
    ``exact/<route>``."""
    score = evaluate_route(model, tok, verify, list(ev["prompt"]), list(ev["answer"]), cap, stop=stop, exact=exact)
    log_metrics(run_id, {f"accuracy/{route}": score.accuracy, f"response_length/{route}": score.response_length,
                         **({f"exact/{route}": score.exact} if score.exact is not None else {})}, step)
    return score


def train_rl(model, tok, route: str, verify, tr, ev, cap: int, rl: RLConfig, run_id: str, stop=()) -> None:
    """GRPO from the base on the route's training prompts with its verifier as the reward. Logs the mean reward,
    loss and response tokens of every step, and the held-out accuracy at step 0 and every ``rl.eval_every`` steps
    (the caller evaluates the last step)."""
    from tasks.training.rl import run_grpo

    def on_step(st) -> None:
        log_metrics(run_id, {f"rl/reward/{route}": st.reward[route], "train/loss": st.loss,
                             "rollout/tokens": st.rollout_tokens}, st.step)
        if st.step % rl.eval_every == 0 and st.step < rl.steps:
            acc = log_eval(run_id, model, tok, route, verify, ev, cap, st.step, stop).accuracy
            say(f"specialist {route} (rl) step {st.step}/{rl.steps}: reward {st.reward[route]:.3f}, accuracy {acc:.3f}")

    log_eval(run_id, model, tok, route, verify, ev, cap, 0, stop)
    run_grpo(model, tok, {route: (list(tr["prompt"]), list(tr["answer"]))}, rl, cap, on_step,
             verifiers={route: verify})


# Cached on every input (the base is identified by its weights' fingerprint, not its path; the recipe by its type and
# fields, so sft and rl never share an entry), on this code and on the state folder: a rerun with the same inputs
# returns the finished specialist without training it again.
@task(
    name="train-specialist",
    task_run_name="train-specialist-{route}",
    cache_policy=state_cache_policy(),
    persist_result=True,
    retries=0,
)
def train_specialist(prompt_set: str, route: str, base_uri: str, base_fingerprint: str, train: Recipe) -> dict:
    """Train a copy of the base on one route (``train``: the sft or rl recipe); returns the checkpoint URI and
    held-out accuracy."""
    from tasks.training.sft import save_trained, train_sft, with_lora

    trainer = trainer_of(train)
    tok = load_tokenizer(base_uri)
    ps = load_prompt_set(prompt_set)
    tr, ev = ps.rows("train")[route], ps.rows("eval")[route]
    if len(tr) == 0:
        raise ValueError(f"route {route}: no training prompts in {prompt_set}")
    verify = ps.verifier(route)
    base = load_model(base_uri)
    model = place_trained(with_lora(base, train) if trainer == "sft" else base, train.device, train.dtype)
    cap = ps.cap(route)
    run_id = start_run(SPECIALISTS_EXPERIMENT, f"specialist-{route}" if trainer == "sft" else f"specialist-rl-{route}",
                       {**config_params(train), "trainer": trainer, "route": route, "base_uri": base_uri,
                        "base_fingerprint": base_fingerprint})
    try:
        if trainer == "sft":
            train_sft(model, tok, tr["prompt"], tr["completion"], train, desc=f"specialist {route}",
                      on_log=lambda s, l: log_metrics(run_id, {"train/loss": l}, s), answers=tr["answer"])
        else:
            train_rl(model, tok, route, verify, tr, ev, cap, train, run_id, ps.stops()[route])
        # A LoRA specialist is saved, and evaluated as it teaches, merged into its base (its adapter beside it).
        model, out = save_trained(model, tok, specialist_dir(prompt_set, route, base_fingerprint, train))
        score = log_eval(run_id, model, tok, route, verify, ev, cap, train.steps, ps.stops()[route],
                         ps.exact_verifiers[route])
        MlflowClient(tracking_uri()).log_artifacts(run_id, str(out), "checkpoint")  # what the model registry points at
    except BaseException:
        end_run(run_id, status="FAILED")  # a failed attempt must not look in progress; a retry starts a new run
        raise
    end_run(run_id, {"model_uri": str(out), "process": f"{socket.gethostname()}:{os.getpid()}"})
    fmt = f" (exact format {score.exact:.3f})" if score.exact is not None and score.exact != score.accuracy else ""
    say(f"specialist {route}{' (rl)' if trainer == 'rl' else ''}: accuracy {score.accuracy:.3f}{fmt} on {score.n} "
        f"held-out prompts -> {out}")
    return {"route": route, "uri": str(out), "accuracy": score.accuracy, "exact": score.exact, "mlflow_run_id": run_id}


def train_own_template_specialist(prompt_set: str, route: str, base_uri: str, student_tok, train: TrainConfig,
                                  out_dir: str | Path) -> dict:
    """A specialist of another model family on one route: the base at ``base_uri`` (its own tokenizer and chat
    template) fine-tuned (LoRA with ``train.lora_rank``) on the route's training rows rendered through its own
    template (:meth:`tasks.specs.render.RowText.render`), each completion ended with its own end-of-turn text; saved
    merged into its base (adapter beside it) and evaluated on the held-out rows as it will teach: an aligned teacher
    answering in its own template (:func:`tasks.evaluation.evaluate.evaluate_teacher`). Returns its URI, accuracy
    and the minutes it took. A finished folder (its ``accuracy.json``) is returned as it is."""
    import json
    import time

    from tasks.common.paths import write_atomic
    from tasks.evaluation.evaluate import evaluate_teacher
    from tasks.modeling.aligned import AlignedTeacher
    from tasks.modeling.alignment import turn_end_text
    from tasks.training.sft import save_trained, train_sft, with_lora

    out = Path(out_dir)
    if (out / "accuracy.json").is_file():
        return json.loads((out / "accuracy.json").read_text())
    t0 = time.perf_counter()
    tok = load_tokenizer(base_uri)
    ps = load_prompt_set(prompt_set)
    texts = ps.row_texts("train")
    tr, ev = ps.rows("train")[route], ps.rows("eval")[route]
    prompts = [texts[(route, p)].render(tok) for p in tr["prompt"]]
    end = turn_end_text(tok)
    model = place_trained(with_lora(load_model(base_uri), train), train.device, train.dtype)
    train_sft(model, tok, prompts, [c + end for c in tr["completion"]], train, desc=f"specialist {route} ({out.name})")
    model, out = save_trained(model, tok, out)
    eval_texts = ps.row_texts("eval")
    teacher = AlignedTeacher(out.name, {out.name: model}, tok, student_tok)
    score = evaluate_teacher(teacher, student_tok, ps.verifier(route), [eval_texts[(route, p)] for p in ev["prompt"]],
                             list(ev["answer"]), ps.cap(route))
    result = {"route": route, "uri": str(out), "accuracy": score.accuracy, "n": score.n,
              "minutes": (time.perf_counter() - t0) / 60}
    write_atomic(out / "accuracy.json", json.dumps(result) + "\n")
    say(f"specialist {route} of {base_uri}: accuracy {score.accuracy:.3f} on {score.n} held-out prompts in its own "
        f"template -> {out}")
    return result
