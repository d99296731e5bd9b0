"""The merge loop: on-policy distillation of routed teachers into one student, tracked in one MLflow run."""

from __future__ import annotations

import json
import random

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from tasks.log import say
from tasks.config import MergeConfig
from tasks.data import eval_sets, load_prompts, max_new_tokens_for, rows_by_route
from tasks.distill import opd_step
from tasks.evaluate import RouteScore, evaluate_route, evaluate_routes, retention
from tasks.models import load_model, save_model
from tasks.paths import models_dir
from tasks.tokenizer import load_tokenizer, tokenizer_fingerprint
from tasks.train import make_optimizer
from tasks.tracking import config_params, end_run, log_metrics, log_retention, start_run
from teachers.registry import TeacherRecord, registry_fingerprint
from teachers.router import Router


def route_metrics(scores: dict[str, RouteScore], teacher_acc: dict[str, float]) -> dict[str, float]:
    """``accuracy/<route>``, ``retention/<route>``, ``response_length/<route>`` and their means over routes."""
    m: dict[str, float] = {}
    for r, s in scores.items():
        m[f"accuracy/{r}"] = s.accuracy
        m[f"retention/{r}"] = retention(s.accuracy, teacher_acc[r])
        m[f"response_length/{r}"] = s.response_length
    for key in ("accuracy", "retention", "response_length"):
        vals = [m[f"{key}/{r}"] for r in scores]
        m[f"{key}/mean"] = sum(vals) / len(vals)
    return m


def _load_teacher(rec: TeacherRecord, student_fp: str) -> torch.nn.Module:
    model = load_model(rec.model_uri, trust_remote_code=rec.trust_remote_code)
    fp = tokenizer_fingerprint(load_tokenizer(rec.model_uri, trust_remote_code=rec.trust_remote_code))
    if fp != student_fp:
        raise ValueError(
            f"teacher {rec.name!r} ({rec.model_uri}) has tokenizer {fp}, the student has {student_fp}: "
            "OPD needs the teacher to score the student's exact tokens"
        )
    model.requires_grad_(False)
    return model.eval()


@task(name="distill", cache_policy=NO_CACHE)
def run_merge(cfg: MergeConfig, world_path: str, router: Router, run_id: str) -> dict:
    """OPD from ``cfg.student_uri`` with ``router``'s teachers; logs per-route metrics to MLflow run ``run_id``.

    Returns references only: the MLflow run id, the student checkpoint URI and the retention table rows.
    """
    opd = cfg.opd
    torch.manual_seed(opd.seed)
    rng = random.Random(opd.seed)

    tok = load_tokenizer(cfg.student_uri)
    student_fp = tokenizer_fingerprint(tok)
    student = load_model(cfg.student_uri).eval()
    records = router.teachers()
    teachers = {rec.name: _load_teacher(rec, student_fp) for rec in records}
    teacher_of = {r: router.teacher_for(r).name for r in cfg.world.routes}

    prompts = load_prompts(world_path)
    train_by_route = {r: d["prompt"] for r, d in rows_by_route(prompts["train"]).items()}
    eval_by_route = eval_sets(world_path)
    routes = cfg.world.routes
    cap = opd.max_new_tokens or max_new_tokens_for(tok, prompts["train"]["completion"])

    def evaluate(model) -> dict[str, RouteScore]:
        return evaluate_routes(model, tok, {r: eval_by_route[r] for r in routes}, cap)

    n_eval = sum(len(v[0]) for v in eval_by_route.values())
    say(f"evaluating {len(teachers)} teachers and the initial student on {n_eval} held-out prompts")
    teacher_scores = {r: evaluate_route(teachers[teacher_of[r]], tok, r, *eval_by_route[r], cap) for r in routes}
    teacher_acc = {r: s.accuracy for r, s in teacher_scores.items()}
    base_scores = evaluate(student)
    log_metrics(run_id, {**{f"teacher_accuracy/{r}": a for r, a in teacher_acc.items()},
                         **{f"base_accuracy/{r}": s.accuracy for r, s in base_scores.items()}}, 0)
    log_metrics(run_id, route_metrics(base_scores, teacher_acc), 0)

    optimizer, scheduler = make_optimizer(student, opd.lr, 0.0, opd.warmup_steps, opd.steps)
    window: dict[str, dict[str, float]] = {}
    scores = base_scores
    bar = tqdm(range(1, opd.steps + 1), desc="OPD merge", mininterval=2.0)
    for step in bar:
        batch_routes = [routes[rng.randrange(len(routes))] for _ in range(opd.batch_size)]
        batch_prompts = [train_by_route[r][rng.randrange(len(train_by_route[r]))] for r in batch_routes]
        st = opd_step(student, teachers, tok, batch_prompts, batch_routes, router.group(batch_routes), optimizer,
                      scheduler, cap, opd.sample_temperature, opd.chunk_size, opd.grad_clip)
        for r in st.kl_sum:
            w = window.setdefault(r, {"kl": 0.0, "tok": 0.0, "seq": 0.0, "trunc": 0.0})
            w["kl"] += st.kl_sum[r]
            w["tok"] += st.kl_tokens[r]
            w["seq"] += st.sequences[r]
            w["trunc"] += st.truncated[r]
        step_metrics = {"train/loss": st.loss, **{f"time/{k}": v for k, v in st.seconds.items()}}
        if step % opd.eval_every == 0 or step == opd.steps:
            scores = evaluate(student)
            for r, w in window.items():
                step_metrics[f"reverse_kl/{r}"] = w["kl"] / max(w["tok"], 1.0)
                step_metrics[f"truncated/{r}"] = w["trunc"] / max(w["seq"], 1.0)
            step_metrics["reverse_kl/mean"] = sum(step_metrics[f"reverse_kl/{r}"] for r in window) / len(window)
            window = {}
            step_metrics.update(route_metrics(scores, teacher_acc))
            say(f"step {step}: mean retention {step_metrics['retention/mean']:.3f}, "
                + ", ".join(f"{r} {step_metrics[f'retention/{r}']:.2f}" for r in routes))
        log_metrics(run_id, step_metrics, step)
        bar.set_postfix(loss=f"{st.loss:.4f}", refresh=False)

    rows = [
        {"route": r, "teacher": teacher_of[r], "base_accuracy": base_scores[r].accuracy,
         "teacher_accuracy": teacher_acc[r], "student_accuracy": scores[r].accuracy,
         "retention": retention(scores[r].accuracy, teacher_acc[r])}
        for r in routes
    ]
    out = save_model(student, tok, models_dir() / "merged" / run_id)
    (out / "retention.json").write_text(json.dumps(rows, indent=2))
    log_retention(run_id, rows, out)
    end_run(run_id, {"merged_student_uri": str(out)})
    return {"run_id": run_id, "student_uri": str(out), "rows": rows}


def start_merge_run(cfg: MergeConfig, router: Router, run_name: str) -> str:
    """Create the merge's MLflow run: every config field as a param, teachers and fingerprints as tags."""
    records = router.teachers()
    tags = {
        "teachers": ",".join(r.name for r in records),
        "registry_fingerprint": registry_fingerprint(records),
        "student_uri": cfg.student_uri,
        **{f"teacher.{r.name}": f"{r.route} {r.tokenizer_fingerprint} {r.model_uri}" for r in records},
    }
    return start_run(cfg.experiment, run_name, config_params(cfg), tags)
