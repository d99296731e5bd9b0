"""The merge loop: on-policy distillation of routed teachers into one student, tracked in one MLflow run."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE
from tqdm.auto import tqdm

from tasks.log import Progress, say
from tasks.config import MergeConfig
from tasks.data import eval_sets, load_prompts, max_new_tokens_for, rows_by_route
from tasks.engines import (
    EndpointTeacher,
    EngineTeacher,
    ServedTeacher,
    VLLMRollout,
    check_parity,
    logprob_parity,
    served_logprobs_k,
)
from tasks.distill import BatchProducer, OffPolicyData, PromptSampler, StepStats, score_with_teachers, update_step
from tasks.evaluate import GateResult, RouteScore, compliance_gate, evaluate_route, evaluate_routes, retention
from tasks.losses import Objective
from tasks.models import load_model, save_model
from tasks.paths import models_dir
from tasks.sharded import full_state_dict, rank, rows_of, run_ranks, shard_groups, shard_student, sum_stats
from tasks.tokenizer import load_tokenizer, tokenizer_fingerprint
from tasks.teacher_pool import TeacherPool
from tasks.train import make_optimizer
from tasks.tracking import (
    STUDENT_MODEL,
    config_params,
    end_run,
    log_metrics,
    log_retention,
    promote_if_best,
    register_version,
    start_run,
)
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


class GateBlocked(RuntimeError):
    """The student's own samples are not yet well-formed enough for on-policy distillation to teach anything."""


@dataclass
class _Window:
    """Per-route sums between two evaluations."""

    sums: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, st: StepStats, on_policy: bool) -> None:
        for r in st.sequences:
            w = self.sums.setdefault(r, dict.fromkeys(("div", "kl", "tok", "seq", "trunc", "rew", "rew_seq"), 0.0))
            w["div"] += st.loss_sum.get(r, 0.0)
            w["kl"] += st.kl_sum.get(r, 0.0)
            w["tok"] += st.kl_tokens.get(r, 0.0)
            w["seq"] += st.sequences[r]
            w["trunc"] += st.truncated[r]
            if on_policy:  # the verifier metric that does not come from the teacher: the student's own samples
                w["rew"] += st.reward_sum[r]
                w["rew_seq"] += st.sequences[r]

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for r, w in self.sums.items():
            m[f"divergence/{r}"] = w["div"] / max(w["tok"], 1.0)
            m[f"reverse_kl/{r}"] = w["kl"] / max(w["tok"], 1.0)
            m[f"truncated/{r}"] = w["trunc"] / max(w["seq"], 1.0)
            if w["rew_seq"]:
                m[f"sample_accuracy/{r}"] = w["rew"] / w["rew_seq"]
        for key in ("divergence", "reverse_kl"):
            vals = [m[f"{key}/{r}"] for r in self.sums]
            if vals:
                m[f"{key}/mean"] = sum(vals) / len(vals)
        self.sums = {}
        return m


class MergeLoop:
    """State shared by the merge's stages: the student, its teachers, the prompt sampler, the global step (MLflow's
    x-axis across the cold start and the on-policy stage) and the student version (optimizer steps taken).

    With ``opd.nproc > 1`` each rank of the process group holds one (every rank runs the same calls on a sharded
    student, :mod:`tasks.sharded`) and only rank 0, the ``lead``, logs."""

    def __init__(self, cfg: MergeConfig, world_path: str, router: Router, run_id: str):
        opd = self.opd = cfg.opd
        torch.manual_seed(opd.seed)
        self.run_id, self.router, self.routes = run_id, router, cfg.world.routes
        self.tok = load_tokenizer(cfg.student_uri)
        student_fp = tokenizer_fingerprint(self.tok)
        self.student = load_model(cfg.student_uri).eval()
        self.lead = rank() == 0
        if opd.nproc > 1:
            shard_student(self.student)
        records = {rec.name: rec for rec in router.teachers()}
        self.teachers = TeacherPool(list(records), lambda name: _load_teacher(records[name], student_fp),
                                    opd.max_resident_teachers)
        self.teacher_of = {r: router.teacher_for(r).name for r in self.routes}
        prompts = load_prompts(world_path)
        default_cap = opd.max_new_tokens or max_new_tokens_for(self.tok, prompts["train"]["completion"])
        self.caps = {r: opd.route_max_new_tokens.get(r, default_cap) for r in self.routes}
        by_route = rows_by_route(prompts["train"])
        self.sampler = PromptSampler({r: (by_route[r]["prompt"], by_route[r]["problem"]) for r in self.routes}, opd.seed)
        gold = dict(zip(prompts["train"]["prompt"], prompts["train"]["completion"]))
        self.offpolicy = OffPolicyData(opd.off_policy_source, self.tok, self.teachers, self.teacher_of, gold,
                                       opd.sample_temperature)
        self.eval_sets = {r: s for r, s in eval_sets(world_path).items() if r in self.routes}
        self.step = 0
        self.engine, self.served = self._vllm_engines(cfg, records, gold)
        self.version = 0
        self.window = _Window()
        self.teacher_acc: dict[str, float] = {}
        self.scores: dict[str, RouteScore] = {}
        self.planned = opd.cold_start_steps + opd.steps
        self.progress = Progress("merge-progress", f"merge {run_id}: optimizer steps done")

    def _vllm_engines(self, cfg: MergeConfig, records: dict[str, TeacherRecord], gold: dict[str, str]):
        """The student's vLLM rollout engine and the served teachers (each loaded on first use, at most
        ``max_resident_teachers`` at once), as the backends ask; each is checked against its transformers forward
        on a few gold sequences before any rollout (``parity/<engine>`` in MLflow), a gap over ``opd.parity_tol``
        stops the merge."""
        opd = self.opd
        prompts = list(gold)[:4]
        seqs = [ids + [self.tok.eos_token_id] for ids in
                self.tok([p + gold[p] for p in prompts], add_special_tokens=False)["input_ids"]]
        engine = served = None
        if opd.rollout_backend == "vllm":
            t0 = time.perf_counter()
            engine = VLLMRollout(cfg.student_uri, self.tok, opd.seed, opd.vllm_kv_cache_mb)
            gap = logprob_parity(engine, self.student, seqs)
            check_parity("the student's rollout engine", cfg.student_uri, gap, opd.parity_tol)
            log_metrics(self.run_id, {"parity/rollout_engine": gap, "time/engine_start": time.perf_counter() - t0}, 0)
            say(f"vLLM rollout engine up in {time.perf_counter() - t0:.1f}s; parity with transformers {gap:.2g}")
        if opd.teacher_backend == "vllm":
            def load_served(name: str) -> ServedTeacher:
                rec = records[name]
                teacher = (EndpointTeacher(name, rec.endpoint) if rec.endpoint
                           else EngineTeacher(name, rec.model_uri, opd.seed, opd.vllm_kv_cache_mb))
                gap = logprob_parity(teacher, self.teachers[name], seqs)
                check_parity(f"teacher {name!r}", teacher.where, gap, opd.parity_tol)
                log_metrics(self.run_id, {f"parity/{name}": gap}, self.step)
                return teacher

            served = TeacherPool(list(records), load_served, opd.max_resident_teachers)
            for name in records:  # preflight: every served teacher answers and agrees before any rollout
                served[name]
        return engine, served

    def evaluate(self, model) -> dict[str, RouteScore]:
        return evaluate_routes(model, self.tok, self.eval_sets, self.caps)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.lead:
            log_metrics(self.run_id, metrics, step)

    def say(self, message: str) -> None:
        if self.lead:
            say(message)

    def baseline(self) -> dict[str, RouteScore]:
        n_eval = sum(len(v[0]) for v in self.eval_sets.values())
        self.say(f"evaluating {len(self.teachers)} teachers and the initial student on {n_eval} held-out prompts")
        self.teacher_acc = {
            r: evaluate_route(self.teachers[self.teacher_of[r]], self.tok, r, *self.eval_sets[r], self.caps[r]).accuracy
            for r in self.routes
        }
        base = self.scores = self.evaluate(self.student)
        self.log({**{f"teacher_accuracy/{r}": a for r, a in self.teacher_acc.items()},
                  **{f"base_accuracy/{r}": s.accuracy for r, s in base.items()},
                  **route_metrics(base, self.teacher_acc)}, 0)
        return base

    def stage(self, name: str, steps: int, lr: float, lmbda: float, objectives: dict[str, Objective]) -> None:
        """``steps`` optimizer steps with their own warmup + cosine schedule; each batch is on-policy with
        probability ``lmbda``; each batch serves ``updates_per_batch`` steps."""
        opd = self.opd
        optimizer, scheduler = make_optimizer(self.student, lr, 0.0, min(opd.warmup_steps, steps // 2), steps)
        needs_logprobs = lmbda > 0 and (opd.reward_weight > 0 or any(o.policy_gradient for o in objectives.values()))
        producer = BatchProducer(self.student, self.tok, self.sampler, self.offpolicy, self.caps, opd.batch_size,
                                 opd.sample_temperature, opd.divergence_temperature, needs_logprobs,
                                 opd.overlap_generation, self.engine)
        served_k = {name: served_logprobs_k([objectives[r] for r in self.routes if self.teacher_of[r] == name])
                    for name in self.teachers}
        stage_id = {"cold_start": 1, "on_policy": 2}[name]
        bar = tqdm(range(steps), desc=f"merge {name}", mininterval=2.0, disable=not self.lead)
        batch, hidden, uses, rows = None, {}, opd.updates_per_batch, None
        try:
            for _ in bar:
                t0 = time.perf_counter()
                if uses == opd.updates_per_batch:
                    batch = producer.next(lmbda, self.version)
                    t_batch = time.perf_counter() - t0
                    groups = self.router.group(batch.routes)
                    if opd.nproc > 1:  # every rank made the whole batch; it scores and learns on its rows
                        rows = rows_of(len(batch.routes))
                        groups = shard_groups(groups, rows)
                    hidden = score_with_teachers(self.teachers, self.teachers.resident_first(groups), batch.rollout,
                                                 self.served, served_k, len(self.tok))
                    uses = 0
                    t_teacher = time.perf_counter() - t0 - t_batch
                else:
                    t_batch = t_teacher = 0.0
                staleness = self.version - batch.version if batch.on_policy else 0
                st = update_step(self.student, batch, hidden, objectives, optimizer, scheduler,
                                 opd.chunk_size, opd.grad_clip, opd.route_weights, opd.reward_weight, rows)
                if rows is not None:
                    st = sum_stats(st, self.routes)
                uses += 1
                self.version += 1
                self.step += 1
                self.window.add(st, batch.on_policy)
                m = {"train/loss": st.loss, "stage": stage_id, "rollout/on_policy": float(batch.on_policy),
                     "rollout/staleness": float(staleness), "time/update": st.seconds["update"],
                     "teachers/loads": float(self.teachers.loads), "teachers/evictions": float(self.teachers.evictions),
                     "teachers/resident": float(len(self.teachers.resident))}
                if uses == 1:
                    # Time the update waited for its batch (with overlap: only what the background did not hide).
                    m.update({"time/generate": t_batch, "time/teacher": t_teacher,
                              "rollout/generated": float(batch.generated)})
                    if opd.overlap_generation or self.engine is not None:
                        m["time/sync"] = producer.sync_seconds
                if self.step % opd.eval_every == 0:
                    m.update(self._eval_metrics())
                self.log(m, self.step)
                bar.set_postfix(loss=f"{st.loss:.4f}", refresh=False)
        finally:
            producer.close()

    def _eval_metrics(self) -> dict[str, float]:
        self.scores = self.evaluate(self.student)
        m = {**self.window.metrics(), **route_metrics(self.scores, self.teacher_acc)}
        self.say(f"step {self.step}: mean retention {m['retention/mean']:.3f}, "
                 + ", ".join(f"{r} {m[f'retention/{r}']:.2f}" for r in self.routes))
        self.progress.update(100.0 * self.step / max(self.planned, self.step),
                             f"step {self.step}/{self.planned}: mean retention {m['retention/mean']:.3f}")
        return m

    def gate(self) -> GateResult:
        prompts = {r: self.eval_sets[r][0][: self.opd.gate_samples] for r in self.routes}
        res = compliance_gate(self.student, self.tok, prompts, self.caps, self.opd.gate_threshold,
                              self.opd.sample_temperature)
        self.log({"gate/passed": float(res.passed),
                  **{f"gate/eos_rate/{r}": v for r, v in res.eos_rate.items()},
                  **{f"gate/format_rate/{r}": v for r, v in res.format_rate.items()}}, self.step)
        self.say(f"cold-start gate {'passed' if res.passed else 'FAILED'} at step {self.step}: {res.describe()}")
        return res

    def finish(self) -> None:
        """Evaluate at the last step unless that just happened, and log the window."""
        if self.step % self.opd.eval_every:
            self.log(self._eval_metrics(), self.step)


@task(name="distill", cache_policy=NO_CACHE)
def run_merge(cfg: MergeConfig, world_path: str, router: Router, run_id: str) -> dict:
    """Merge the routed teachers into ``cfg.student_uri``: an optional off-policy cold start (supervised KD on
    teacher samples or gold completions), the compliance gate, then on-policy distillation with each route's
    objective; per-route metrics go to MLflow run ``run_id``.

    Returns references only: the MLflow run id, the student checkpoint URI and the retention table rows.

    With ``opd.nproc`` > 1 the student update runs on that many processes, this one being rank 0 (FSDP over
    ``opd.dist_backend``, :mod:`tasks.sharded`).
    """
    if cfg.opd.nproc > 1:
        return run_ranks(merge_rank, cfg.opd.nproc, cfg.opd.dist_backend, cfg, world_path, router, run_id)
    return merge_rank(cfg, world_path, router, run_id)


def merge_rank(cfg: MergeConfig, world_path: str, router: Router, run_id: str) -> dict:
    """The body of :func:`run_merge` on one rank; rank 0 saves, registers and returns the references."""
    opd = cfg.opd
    loop = MergeLoop(cfg, world_path, router, run_id)
    base_scores = loop.baseline()
    routes = loop.routes
    cold_start = {r: opd.cold_start_objective() for r in routes}
    if opd.cold_start_steps:
        loop.say(f"cold start: {opd.cold_start_steps} steps of {opd.cold_start_loss} on {opd.off_policy_source} "
                 "completions")
        loop.stage("cold_start", opd.cold_start_steps, opd.cold_start_lr, 0.0, cold_start)
    if opd.gate_threshold > 0:
        result = loop.gate()
        for _ in range(opd.gate_retries if opd.cold_start_steps else 0):
            if result.passed:
                break
            loop.stage("cold_start", opd.cold_start_steps, opd.cold_start_lr, 0.0, cold_start)
            result = loop.gate()
        if not result.passed:
            hint = ("more opd.cold_start_steps or opd.gate_retries" if opd.cold_start_steps
                    else "an off-policy cold start (opd.cold_start_steps > 0)")
            raise GateBlocked(
                f"the student's own samples fail the compliance gate on {result.failing}: {result.describe()}. "
                f"On-policy distillation cannot teach what the student never samples; try {hint}, or lower "
                "opd.gate_threshold"
            )
    loop.stage("on_policy", opd.steps, opd.lr, opd.lmbda, {r: opd.objective(r) for r in routes})
    loop.finish()
    state_dict = full_state_dict(loop.student) if opd.nproc > 1 else None  # collective: every rank takes part
    if not loop.lead:
        return {}

    scores = loop.scores
    rows = [
        {"route": r, "teacher": loop.teacher_of[r], "base_accuracy": base_scores[r].accuracy,
         "teacher_accuracy": loop.teacher_acc[r], "student_accuracy": scores[r].accuracy,
         "retention": retention(scores[r].accuracy, loop.teacher_acc[r])}
        for r in routes
    ]
    out = save_model(loop.student, loop.tok, models_dir() / "merged" / run_id, state_dict)
    (out / "retention.json").write_text(json.dumps(rows, indent=2))
    log_retention(run_id, rows, out)
    mean = sum(r["retention"] for r in rows) / len(rows)
    version = register_version(STUDENT_MODEL, run_id, "student", {
        "teachers": ",".join(sorted(set(loop.teacher_of.values()))), "loss": opd.loss, "label": cfg.label,
        "mean_retention": f"{mean:.4f}"}, "Merged students of OPD runs; @champion has the best mean retention.")
    champion = promote_if_best(STUDENT_MODEL, version)
    say(f"registered {STUDENT_MODEL} version {version}" + (" as @champion" if champion else ""))
    end_run(run_id, {"merged_student_uri": str(out), "registered_model": f"{STUDENT_MODEL}/{version}",
                     "champion": str(champion)})
    return {"run_id": run_id, "student_uri": str(out), "rows": rows, "model_version": version, "champion": champion}


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
