"""The merge loop: on-policy distillation of routed teachers into one student, tracked in one MLflow run."""

from __future__ import annotations

import gc
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mlflow.exceptions import MlflowException
from prefect import task
from prefect.cache_policies import NO_CACHE
from requests.exceptions import RequestException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from tasks.common.log import Progress, say
from tasks.training.checkpoint import MergeCheckpoints
from tasks.config import MergeConfig
from tasks.modeling.engines import (
    EndpointTeacher,
    EngineSettings,
    EngineTeacher,
    TeacherServer,
    VLLMRollout,
    cap_warnings,
    check_parity,
    route_parity,
    route_sequences,
    served_plan,
)
from tasks.objectives.combine import composed
from tasks.training.guided import GuidedPrefixes, GuideSchedule
from tasks.training.distill import (
    BatchProducer,
    OffPolicyData,
    PromptSampler,
    StepStats,
    combine_scores,
    extrapolate_scores,
    score_with_teachers,
    signal_coverage,
    texts_of,
    update_step,
)
from tasks.evaluation.evaluate import (
    GateResult,
    RouteScore,
    compliance_gate,
    evaluate_routes,
    evaluate_teacher,
    label_means,
    mean_retention,
    recovery_rate,
    retention,
    retention_row,
    route_mean,
    sampled_pass_at_k,
    teacher_metrics,
)
from tasks.objectives.losses import DIAGNOSTICS, Objective
from tasks.merging.merge_state import MergeState
from tasks.merging.route_mix import hold_out, route_need, route_shares, smooth_need
from tasks.modeling.models import base_problems, checkpoint_fingerprint, load_model
from tasks.modeling.rollout import compile_generation, eos_ids
from tasks.modeling.shared_base import SharedBase, TeacherModels, sharing_groups
from tasks.common.paths import models_dir
from tasks.specs.prompt_set import load_prompt_set
from tasks.training.launch import job_dir, launch
from tasks.training.sharded import (full_state_dict, rank, rows_of, shard_groups, shard_student,
                                    sum_stats)
from tasks.specs.tokenizer import compatibility_problems, load_tokenizer, tokenizer_fingerprint
from tasks.modeling.routing import (Routing, TeacherRecord, combining_refusal, guided_refusal, guided_routes,
                                    reads_own_text, registry_fingerprint)
from tasks.modeling.aligned import own_text_teacher
from tasks.modeling.alignment import aligned_problems, digit_ids
from tasks.modeling.teacher import make_teachers, teacher_kind
from tasks.modeling.teacher_pool import TeacherPool, host_parking
from tasks.modeling.device import (cpu_threads, place_frozen, place_trained, resolve_backend, resolve_device,
                                   torch_threads)
from tasks.training.sft import make_optimizer, save_trained, with_lora
from tasks.tracking.runs import (
    STUDENT_MODEL,
    config_params,
    end_run,
    log_metrics,
    log_retention,
    log_spec,
    logged_metrics,
    promote_if_best,
    register_version,
    registered_version,
    reopen_run,
    start_run,
    tracking_uri,
)


def route_metrics(scores: dict[str, RouteScore], teacher_acc: dict[str, float],
                  labels: dict[str, dict[str, str]] | None = None) -> dict[str, float]:
    """``accuracy/<route>``, ``retention/<route>``, ``response_length/<route>``, their means over routes and, with the
    spec's route ``labels``, ``retention_by/<label>/<value>`` (the mean over that label's routes, e.g.
    ``retention_by/domain/math``)."""
    m: dict[str, float] = {}
    for r, s in scores.items():
        m[f"accuracy/{r}"] = s.accuracy
        m[f"retention/{r}"] = retention(s.accuracy, teacher_acc[r])
        m[f"response_length/{r}"] = s.response_length
        if s.exact is not None:
            m[f"exact/{r}"] = s.exact
    for key in ("accuracy", "retention", "response_length"):
        m[f"{key}/mean"] = route_mean(m[f"{key}/{r}"] for r in scores)
    for group, value in label_means({r: m[f"retention/{r}"] for r in scores}, labels or {}).items():
        m[f"retention_by/{group}"] = value
    return m


def check_teacher(rec: TeacherRecord, student_tok: PreTrainedTokenizerBase,
                  messages: list[dict[str, str]] | None = None, student_fp: str | None = None) -> None:
    """What :func:`load_teacher` checks before any weight is read (ValueError naming the teacher): its tokenizer
    against the student's (a plain teacher) or the one it was registered with (an aligned one), its chat template on
    ``messages``, its adapter's named base."""
    if problems := base_problems(rec.model_uri, rec.base_model, rec.base_fingerprint):
        raise ValueError(f"teacher {rec.name!r} ({rec.model_uri}): " + "; ".join(problems))
    teacher_tok = load_tokenizer(rec.model_uri, trust_remote_code=rec.trust_remote_code, base=rec.base_model or None)
    fp, student_fp = tokenizer_fingerprint(teacher_tok), student_fp or tokenizer_fingerprint(student_tok)
    if reads_own_text(rec) and fp != rec.tokenizer_fingerprint:
        raise ValueError(f"{rec.wrapper} teacher {rec.name!r} ({rec.model_uri}) has tokenizer {fp}, registered with "
                         f"{rec.tokenizer_fingerprint}: the checkpoint changed since; re-register it")
    if not reads_own_text(rec) and fp != student_fp:
        raise ValueError(
            f"teacher {rec.name!r} ({rec.model_uri}) has tokenizer {fp}, the student has {student_fp}: "
            "OPD needs the teacher to score the student's exact tokens (a teacher of another tokenizer teaches as "
            "an aligned teacher: register it with --wrapper aligned)"
        )
    if messages:
        problems = (compatibility_problems(student_tok, teacher_tok, messages) if not reads_own_text(rec)
                    else aligned_problems(teacher_tok, messages))
        if problems:
            raise ValueError(f"teacher {rec.name!r} ({rec.model_uri}): " + "; ".join(problems))


def load_teacher(rec: TeacherRecord, student_tok: PreTrainedTokenizerBase, device: str = "auto", dtype: str = "fp32",
                  messages: list[dict[str, str]] | None = None, student_fp: str | None = None) -> torch.nn.Module:
    """A teacher's checkpoint, frozen, on ``device`` in ``dtype`` (the merge's ``opd.teacher_device`` and
    ``opd.teacher_dtype``), once its tokenizer is checked (before any weight is read): the student's for a plain
    teacher, the one it was registered with for an aligned one; with ``messages`` (a chat route it serves, its first
    row's messages) also its chat template: the student's rendering for a plain teacher, one at all for an aligned
    one (registration checked the same; the checkpoint may have changed since); a LoRA adapter's named base
    (:func:`tasks.modeling.models.base_problems`), onto which it loads. ``student_fp``: the student
    tokenizer's fingerprint, when the caller has it (the merge computes it once, not at every reload)."""
    check_teacher(rec, student_tok, messages, student_fp)
    base = rec.base_model or None
    return place_frozen(load_model(rec.model_uri, trust_remote_code=rec.trust_remote_code, base=base), device, dtype)


class GateBlocked(RuntimeError):
    """The student's own samples are not yet well-formed enough for on-policy distillation to teach anything."""


class TrackingUnavailable(RuntimeError):
    """MLflow did not take a step's metrics (after MLflow's own HTTP retries, ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``,
    ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``, ``MLFLOW_HTTP_REQUEST_TIMEOUT``): the merge stops there rather than go on
    without its metrics; its last checkpoint holds everything to resume once MLflow is back."""


class TooManyBadSteps(FloatingPointError):
    """More than ``opd.max_bad_steps`` steps had a non-finite loss or gradient norm."""


# What a Prefect retry of the merge task may cure (a retry resumes from the last checkpoint): I/O and MLflow outages,
# not a config the gate rejects or a run that keeps producing NaN.
TRANSIENT = (OSError, TimeoutError, TrackingUnavailable)


def is_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry only failures in :data:`TRANSIENT`."""
    return isinstance(state.result(raise_on_failure=False), TRANSIENT)


@dataclass
class _Window:
    """Per-route sums between two evaluations."""

    sums: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, st: StepStats, on_policy: bool) -> None:
        keys = ("div", "kl", "tok", "seq", "trunc", "rew", "rew_seq", "own_tok", *DIAGNOSTICS, "repetition", "length")
        for r in st.sequences:
            w = self.sums.setdefault(r, dict.fromkeys(keys, 0.0))
            w["div"] += st.loss_sum.get(r, 0.0)
            w["kl"] += st.kl_sum.get(r, 0.0)
            w["tok"] += st.kl_tokens.get(r, 0.0)
            w["seq"] += st.sequences[r]
            w["trunc"] += st.truncated[r]
            if on_policy:  # the verifier metric that does not come from the teacher: the student's own samples
                w["rew"] += st.reward_sum[r]
                w["rew_seq"] += st.sequences[r]
                # Health of the student's own samples: entropies, teacher NLL, overlap, repetition, length.
                w["own_tok"] += st.kl_tokens.get(r, 0.0)
                for d in (*DIAGNOSTICS, "repetition", "length"):
                    w[d] += getattr(st, d).get(r, 0.0)

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for r, w in self.sums.items():
            m[f"divergence/{r}"] = w["div"] / max(w["tok"], 1.0)
            m[f"reverse_kl/{r}"] = w["kl"] / max(w["tok"], 1.0)
            m[f"truncated/{r}"] = w["trunc"] / max(w["seq"], 1.0)
            if w["rew_seq"]:
                m[f"sample_accuracy/{r}"] = w["rew"] / w["rew_seq"]
                tok = max(w["own_tok"], 1.0)
                m[f"entropy/student/{r}"] = w["student_entropy"] / tok
                m[f"entropy/teacher/{r}"] = w["teacher_entropy"] / tok
                m[f"entropy_gap/{r}"] = (w["student_entropy"] - w["teacher_entropy"]) / tok
                m[f"teacher_nll/{r}"] = w["teacher_nll"] / tok
                m[f"topk_overlap/{r}"] = w["topk_overlap"] / tok
                m[f"repetition/{r}"] = w["repetition"] / w["rew_seq"]
                m[f"rollout_length/{r}"] = w["length"] / w["rew_seq"]
        for key in ("divergence", "reverse_kl"):
            if self.sums:
                m[f"{key}/mean"] = route_mean(m[f"{key}/{r}"] for r in self.sums)
        self.sums.clear()  # in place: the merge's state holds this dict
        return m


class MergeLoop:
    """One merge, in three parts in the manner of torchtune's recipes. Setup (the constructor): the prompt set, the
    student, the teachers behind :mod:`tasks.modeling.teacher`'s interface, the vLLM engines (started and checked for
    parity here, never in the loop) and the merge's :class:`tasks.merging.merge_state.MergeState` (fresh, or the newest
    checkpoint's). :meth:`train`: the baseline, the cold start and its gate, the on-policy stage and the last
    evaluation; each :meth:`stage` is the training loop, which calls :meth:`log` (MLflow, and what an outage means)
    and :meth:`_eval_metrics` (evaluation) rather than doing either itself. :meth:`cleanup`: engines, clients and
    resident teachers released, whether training finished or failed.

    With ``opd.nproc > 1`` each rank of the process group holds one (every rank runs the same calls on a sharded
    student, :mod:`tasks.training.sharded`) and only rank 0, the ``lead``, logs.

    With ``checkpoints`` the loop writes a checkpoint every ``opd.checkpoint_every`` steps and starts from the newest
    one there: the stages and gates that finished before it are skipped (the gates' recorded results replayed), the
    stage it was taken in continues from its step with the optimizer, schedule, RNG and sampler states it had, and
    metrics MLflow already holds from a killed attempt are not logged twice."""

    def __init__(self, cfg: MergeConfig, prompt_set: str, router: Routing, run_id: str,
                 checkpoints: MergeCheckpoints | None = None):
        opd = self.opd = cfg.opd
        torch.manual_seed(opd.seed)
        self.ps = load_prompt_set(prompt_set, cfg.routes)
        self.run_id, self.router, self.routes = run_id, router, self.ps.routes
        self.verifiers, self.exact = self.ps.verifiers, self.ps.exact_verifiers
        # Each route's rollout sampling (its spec's generate.temperature, else opd.sample_temperature; top_p; stop).
        self.sampling = {r: self.ps.route(r).generate.sampling(opd.sample_temperature) for r in self.routes}
        self.stops = self.ps.stops()
        self.labels = {r: self.ps.labels(r) for r in self.routes}
        self.tok = load_tokenizer(cfg.student_uri)
        student_fp = tokenizer_fingerprint(self.tok)
        # A LoRA student (opd.lora_rank > 0) trains a fresh peft adapter on the frozen initialisation.
        # On opd.device with fp32 master weights, computing under opd.dtype (tasks/modeling/device.py).
        self.student = place_trained(with_lora(load_model(cfg.student_uri), opd), opd.device, opd.dtype).eval()
        compile_generation(self.student, opd.compile_generation)  # the overlap's copy of the student inherits it
        # What ends a response in this merge (rollouts, teacher samples, truncation flags): the tokenizer's EOS and
        # every stop id of the student's generation config. The vocabulary is len(self.tok), whatever the heads' width.
        self.eos = eos_ids(self.tok, self.student)
        # ExOPD's reference (reward_scale != 1): frozen, loaded before the student's resumed weights replace its init.
        self.reference = (place_frozen(load_model(opd.reference_uri or cfg.student_uri), opd.reference_device,
                                       opd.reference_dtype)
                          if opd.reward_scale != 1.0 else None)
        self.checkpoints = checkpoints
        self.resumed_from = checkpoints.latest() if checkpoints is not None else None
        # The merge's state, whole (tasks/merging/merge_state.py): a fresh one, or the newest checkpoint's.
        self.state = (MergeState.from_checkpoint(checkpoints.load(self.resumed_from))
                      if self.resumed_from is not None else MergeState(run_id))
        if self.state.run_id != run_id:
            raise ValueError(f"checkpoint {self.resumed_from} belongs to MLflow run {self.state.run_id}, not {run_id}")
        if self.state.weights is not None:  # before sharding: every rank loads the full weights, then keeps its shard
            self.student.load_state_dict(self.state.weights)
            self.state.weights = None
        self.lead = rank() == 0
        if opd.nproc > 1:
            shard_student(self.student)
        records = {rec.name: rec for rec in router.teachers()}
        # What each row's route rendered (its chat messages, context): what a teacher rendering its own input reads.
        self.row_texts = {**self.ps.row_texts("train"), **self.ps.row_texts("eval")}
        # The teachers' checkpoints, loaded on first use (at most max_resident_teachers on their device at once; on a
        # GPU the evicted ones wait in host memory with teacher_offload 'cpu').
        # Each teacher's chat template is checked at load on the first chat route it serves (None: format routes).
        first_chat: dict[str, list[dict[str, str]] | None] = {}
        for t in self.row_texts.values():
            first_chat.setdefault(t.route, t.chat)
        served: dict[str, list[dict[str, str]]] = {}
        for r in self.routes:
            for rec in router.teachers_for(r):
                if first_chat.get(r):
                    served.setdefault(rec.name, first_chat[r])
        self.pool = TeacherPool(list(records), lambda name: load_teacher(records[name], self.tok, opd.teacher_device,
                                                                opd.teacher_dtype, served.get(name), student_fp),
                                opd.max_resident_teachers,
                                **host_parking(resolve_device(opd.teacher_device), opd.teacher_offload))
        self.kinds = {name: teacher_kind(rec, opd.teacher_backend) for name, rec in records.items()}
        # opd.teacher_sharing adapters: the teachers that are LoRA adapters of one base share one copy of it, each
        # teacher's adapter switched on to score or sample (tasks/modeling/shared_base.py); the rest stay in the pool.
        self.shared = [SharedBase(base, adapters, self._shared_loader(base, [records[n] for n in adapters], served,
                                                                      student_fp))
                       for base, adapters in sharing_groups({n: rec for n, rec in records.items()
                                                             if self.kinds[n] == "checkpoint"}).items()
                       ] if opd.teacher_sharing == "adapters" else []
        self.teacher_models = TeacherModels(self.pool, self.shared) if self.shared else self.pool
        if self.shared:
            say("teachers sharing a base: " + "; ".join(f"{sorted(s)} on {s.base}" for s in self.shared))
        self.teacher_of = {r: router.teacher_for(r).name for r in self.routes}  # the primary
        # Every teacher of each route (the primary first); a route with several combines them (the spec's combine).
        self.teachers_of = {r: [rec.name for rec in router.teachers_for(r)] for r in self.routes}
        self.combinations = {r: (names, *router.combine_for(r)) for r, names in self.teachers_of.items()
                             if len(names) > 1}
        refusal = combining_refusal(router, self.routes, opd.teacher_backend)
        if refusal:
            raise ValueError(f"opd.teacher_backend {refusal}")
        mixed = sorted(r for r, names in self.teachers_of.items()
                       if len(names) > 1 and any(reads_own_text(records[n]) for n in names))
        if mixed:
            raise ValueError(f"route(s) {mixed} combine several teachers, one of them reading its own text (an "
                             "aligned or context wrapper): combining needs every teacher's distribution on the "
                             "student's exact sequence; expected one teacher on such a route")
        # Guided OPD: a route whose teacher is a guided one starts its on-policy rollouts from a prefix of that
        # teacher's own solution, withdrawn over its schedule (tasks/training/guided.py).
        self.guides = {r: GuideSchedule(rec.guide_fraction, rec.guide_steps)
                       for r, rec in guided_routes(router, self.routes).items()}
        if refusal := guided_refusal(router, self.routes, opd.rollout_backend):
            raise ValueError(f"opd.rollout_backend {refusal}")
        # The route's own cap (its spec's generate.max_new_tokens) unless the merge config sets one.
        # opd.route_normalization: each route's group (itself, or its value of a spec label; unlabelled: itself).
        key = opd.route_normalization.removeprefix("label:")
        if opd.route_normalization.startswith("label:") and not any(key in self.labels[r] for r in self.routes):
            known = sorted({k for r in self.routes for k in self.labels[r]})
            raise ValueError(f"opd.route_normalization {opd.route_normalization!r}: no route of the spec has label "
                             f"{key!r}; its labels: {known or 'none'}")
        self.norm_groups = (None if opd.route_normalization == "none" else
                            {r: r if opd.route_normalization == "route" else f"{key}={self.labels[r].get(key, r)}"
                             for r in self.routes})
        self.caps = {r: opd.route_max_new_tokens.get(r, opd.max_new_tokens or self.ps.cap(r)) for r in self.routes}
        train_sets, self.mix_slice = self.ps.train_sets(), None
        if opd.route_sampling == "retention":  # a slice of each route's training prompts, never trained on
            train_sets, self.mix_slice = hold_out(train_sets, opd.route_sampling_prompts)
        self.sampler = PromptSampler(train_sets, opd.seed)
        train = self.ps.splits["train"]
        gold = dict(zip(train["prompt"], train["completion"]))
        self.eval_sets = self.ps.eval_sets()
        # The recovery diagnostic's gold traces: each route's held-out completions, read once.
        self.eval_completions = {r: list(d["completion"][:opd.recovery_prompts])
                                 for r, d in self.ps.rows("eval").items()} if opd.recovery_prompts else {}
        self.engine, self.servers = self._vllm_engines(cfg, records, gold)
        # What the merge calls: each teacher's score / sample / model (tasks/modeling/teacher.py), whatever its kind;
        # an aligned or context teacher wraps its checkpoint to read the student's text its own way.
        own_text = {name: own_text_teacher(rec, self.pool, self.tok, self.eos)
                    for name, rec in records.items() if reads_own_text(rec)}
        self.teachers = make_teachers(self.kinds, self.teacher_models, self.servers, len(self.tok), own_text)
        self.digit_ids = digit_ids(self.tok)
        # A route with several teachers takes each prompt's off-policy sample from one of them, by its weight.
        self.offpolicy = OffPolicyData(opd.off_policy_source, self.tok, self.teachers, self.teacher_of, gold,
                                       opd.sample_temperature, verifiers=self.verifiers, eos=self.eos,
                                       sample_from={r: (names, weights) for r, (names, _, weights)
                                                    in self.combinations.items() if not composed(weights)})
        self.window = _Window(self.state.window)
        self.planned = opd.cold_start_steps + opd.steps
        self.progress = Progress("merge-progress", f"merge {run_id}: optimizer steps done")
        self.stage_no = 0  # stages begun (cold-start rounds and the on-policy stage, in order)
        self.gate_calls = 0
        self.last_checkpoint, self.resume_at = 0, None
        if self.resumed_from is not None:
            self._resume_components()
        # (key, step) -> value MLflow already holds from an attempt killed after this point: not logged again.
        self.logged = logged_metrics(run_id, self.state.step) if checkpoints is not None and self.lead else {}

    def _vllm_engines(self, cfg: MergeConfig, records: dict[str, TeacherRecord], gold: dict[str, str]):
        """The student's vLLM rollout engine and the served teachers (each loaded on first use, at most
        ``max_resident_teachers`` at once), as the backends ask, run as ``opd.vllm_*`` say (:class:`EngineSettings`).
        Each is checked against its transformers forward on a few real prompts of each of its routes with their gold
        completions before any rollout (``parity/<engine>`` in MLflow: the worst route; ``parity/<engine>/<route>``
        each), a gap over ``opd.parity_tol`` stops the merge. A served teacher that caps its log-probs per position
        (:attr:`EndpointTeacher.max_logprobs`, kept in ``self.logprob_caps``) gets its routes' objectives cut to its
        top K with a tail bucket (:func:`served_plan`), said here in a warning line."""
        opd = self.opd
        settings = EngineSettings.of(opd)
        seqs = route_sequences(self.tok, {r: prompts for r, (prompts, _) in self.ps.train_sets().items()}, gold)
        self.logprob_caps: dict[str, int | None] = {}

        def parity(engine, model, name: str, key: str, routes: list[str], t0: float) -> None:
            gaps = route_parity(engine, model, {r: seqs[r] for r in routes if seqs[r]})
            worst = max(gaps.values(), default=0.0)
            check_parity(name, engine.where, worst, opd.parity_tol, getattr(engine, "dtype", None))
            log_metrics(self.run_id, {f"parity/{key}": worst, **{f"parity/{key}/{r}": g for r, g in gaps.items()}},
                        self.state.step)
            say(f"{name} ({engine.where}) up in {time.perf_counter() - t0:.1f}s; parity with transformers "
                f"{worst:.2g} (worst route; " + ", ".join(f"{r} {g:.2g}" for r, g in gaps.items()) + ")")

        engine = servers = None
        if opd.rollout_backend == "vllm":
            t0 = time.perf_counter()
            engine = VLLMRollout(cfg.student_uri, self.tok, opd.seed, settings, self.eos)
            parity(engine, self.student, "the student's rollout engine", "rollout_engine", self.routes, t0)
            engine.sleep()  # (sleep mode only) until the first rollout: the baseline evaluation runs first
            log_metrics(self.run_id, {"time/engine_start": time.perf_counter() - t0}, 0)
        if opd.teacher_backend == "vllm":
            def load_served(name: str) -> TeacherServer:
                t0, rec = time.perf_counter(), records[name]
                teacher = (EndpointTeacher(name, rec.endpoint) if self.kinds[name] == "endpoint"
                           else EngineTeacher(name, rec.model_uri, opd.seed, settings))
                routes = [r for r in self.routes if self.teacher_of[r] == name] or self.routes
                parity(teacher, self.pool[name], f"teacher {name!r}", name, routes, t0)
                self.logprob_caps[name] = teacher.max_logprobs
                return teacher

            servers = TeacherPool(list(records), load_served, opd.max_resident_teachers)
            for name in records:  # preflight: every served teacher answers and agrees before any rollout
                servers[name]
            stages = [{r: opd.objective(r) for r in self.routes}]
            stages += [{r: opd.cold_start_objective() for r in self.routes}] if opd.cold_start_steps else []
            warnings = []
            for objectives in stages:  # refuses what a capped teacher cannot serve, before any rollout
                planned, _ = served_plan(objectives, self.teacher_of, self.logprob_caps)
                warnings += cap_warnings(objectives, planned, self.teacher_of, self.logprob_caps)
            for line in dict.fromkeys(warnings):
                say(line)
        return engine, servers

    def evaluate(self, model) -> dict[str, RouteScore]:
        return evaluate_routes(model, self.tok, self.eval_sets, self.caps, self.verifiers, self.stops, self.exact)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log on the lead; a value MLflow already holds for this key and step (from a killed attempt) is skipped.
        Raises :class:`TrackingUnavailable` when MLflow does not take them."""
        if not self.lead:
            return
        metrics = {k: v for k, v in metrics.items() if self.logged.get((k, step)) != float(v)}
        if not metrics:
            return
        try:
            log_metrics(self.run_id, metrics, step)
        except (MlflowException, RequestException, OSError) as e:
            if getattr(e, "error_code", "") == "INVALID_PARAMETER_VALUE":
                raise  # MLflow answered and refused what we sent: a bug to see as it is, not an outage to wait out
            raise TrackingUnavailable(
                f"MLflow at {tracking_uri()} did not take the metrics of step {step} ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}). The merge stopped there; {self.describe_checkpoint()}: "
                "run the same command again once MLflow is reachable to resume into the same run"
            ) from e

    def describe_checkpoint(self) -> str:
        if self.checkpoints is None:
            return "it has no checkpoints"
        latest = self.checkpoints.latest()
        return (f"its last checkpoint (step {self.last_checkpoint}, {latest}) is intact" if latest is not None
                else f"it had no checkpoint yet ({self.checkpoints.root})")

    def say(self, message: str) -> None:
        if self.lead:
            say(message)

    def baseline(self) -> dict[str, RouteScore]:
        if self.state.base_scores:  # resumed: measured and logged before the checkpoint
            return self.state.base_scores
        n_eval = sum(len(v[0]) for v in self.eval_sets.values())
        self.say(f"evaluating {len(self.teachers)} teachers and the initial student on {n_eval} held-out prompts")
        scored = {r: self.teacher_scores(r, self.eval_sets[r]) for r in self.routes}
        each = {r: {name: x.accuracy for name, x in per.items()} for r, per in scored.items()}
        # A route with several teachers is measured against the best of them (its exact figure is that teacher's).
        self.state.teacher_acc = {r: max(acc.values()) for r, acc in each.items()}
        self.state.teacher_exact = {r: per[max(per, key=lambda n: per[n].accuracy)].exact for r, per in scored.items()}
        base = self.state.scores = self.state.base_scores = self.evaluate(self.student)
        self.log({**teacher_metrics("teacher_accuracy", each),
                  **{f"base_accuracy/{r}": s.accuracy for r, s in base.items()},
                  **route_metrics(base, self.state.teacher_acc, self.labels)}, 0)
        base_recovery = self.recovery(self.student)
        teachers = {r: self.teacher_recoveries(r) for r in self.routes}
        # The state (and the summary) keeps the best teacher of each route, as for accuracy.
        self.state.recovery = {"base": base_recovery,
                               "teacher": {r: max(per.values()) for r, per in teachers.items() if per}}
        self.log({**{f"recovery/base/{r}": v for r, v in base_recovery.items()},
                  **teacher_metrics("recovery/teacher", teachers)}, 0)
        if self.mix_slice is not None:
            self.state.slice_teacher_acc = {r: max(self.teacher_accuracies(r, self.mix_slice[r]).values())
                                            for r in self.routes}
            self.log({f"route_sampling/teacher_accuracy/{r}": a for r, a in self.state.slice_teacher_acc.items()}, 0)
            self.log(self.reweigh(), 0)
        return base

    def teacher_scores(self, route: str, prompts_answers: tuple[list[str], list[str]]) -> dict[str, RouteScore]:
        """Greedy score of each teacher of ``route`` on ``prompts_answers`` (held-out prompts and answers), each in
        its own terms (:func:`tasks.evaluation.evaluate.evaluate_teacher`: a teacher of another tokenizer with its
        own template), with the route's exact-format figure."""
        prompts, answers = prompts_answers
        texts = texts_of(prompts, [route] * len(prompts), self.row_texts)
        return {name: evaluate_teacher(self.teachers[name], self.tok, self.verifiers[route], texts, answers,
                                       self.caps[route], self.stops[route], self.exact[route])
                for name in self.teachers_of[route]}

    def teacher_accuracies(self, route: str, prompts_answers: tuple[list[str], list[str]]) -> dict[str, float]:
        """Greedy accuracy of each teacher of ``route`` (:meth:`teacher_scores`)."""
        return {name: s.accuracy for name, s in self.teacher_scores(route, prompts_answers).items()}

    def teacher_recoveries(self, route: str) -> dict[str, float]:
        """The recovery diagnostic (:meth:`recovery`) of each teacher of ``route``; empty when it has no trace to derail
        or ``opd.recovery_prompts`` is 0 (then no teacher is loaded for it)."""
        if not self.opd.recovery_prompts:
            return {}
        # A teacher that reads its own text (model None) is left out: the injected errors are student tokens.
        return {name: v for name in self.teachers_of[route] if self.teachers[name].model is not None
                and (v := self.recovery(self.teachers[name].model, [route]).get(route)) is not None}

    def recovery(self, model, routes: list[str] | None = None) -> dict[str, float]:
        """The recovery diagnostic (:func:`tasks.evaluation.evaluate.recovery_rate`) of ``model`` on the first
        ``opd.recovery_prompts`` held-out prompts of each route (of ``routes``); routes without a trace to derail are
        left out."""
        n = self.opd.recovery_prompts
        out = {}
        for r in (routes or self.routes) if n else ():
            prompts, answers = (x[:n] for x in self.eval_sets[r])
            rate = recovery_rate(model, self.tok, self.verifiers[r], prompts, answers,
                                 self.eval_completions[r], self.caps[r], self.opd.seed)
            if rate is not None:
                out[r] = rate
        return out

    def reweigh(self) -> dict[str, float]:
        """Retention-driven route sampling: measure the student on each route's held-out slice, update the smoothed
        need and the sampler's shares (:mod:`tasks.merging.route_mix`); returns what to log."""
        opd = self.opd
        student = {r: s.accuracy for r, s in evaluate_routes(self.student, self.tok, self.mix_slice, self.caps,
                                                             self.verifiers, self.stops).items()}
        need = route_need(student, self.state.slice_teacher_acc)
        self.state.route_need = smooth_need(self.state.route_need, need, opd.route_sampling_smoothing)
        self.sampler.shares = route_shares(self.state.route_need, opd.route_sampling_floor)
        self.say(f"step {self.state.step}: route shares " + ", ".join(
            f"{r} {self.sampler.shares[r]:.2f} (slice retention "
            f"{retention(student[r], self.state.slice_teacher_acc[r]):.2f})" for r in self.routes))
        return {**{f"route_sampling/accuracy/{r}": a for r, a in student.items()},
                **{f"route_sampling/need/{r}": v for r, v in self.state.route_need.items()}}

    def stage(self, name: str, steps: int, lr: float, lmbda: float, objectives: dict[str, Objective]) -> None:
        """``steps`` optimizer steps with their own warmup + cosine schedule; each batch is on-policy with
        probability ``lmbda``; each batch serves ``updates_per_batch`` steps. A step with a non-finite loss or gradient
        is skipped and counted; more than ``opd.max_bad_steps`` of them stop the merge (:class:`TooManyBadSteps`)."""
        opd = self.opd
        no, self.stage_no = self.stage_no, self.stage_no + 1
        if self.resume_at is not None and no < self.resume_at[0]:
            return  # finished before the checkpoint this merge resumed from
        optimizer, scheduler = make_optimizer(self.student, lr, 0.0, min(opd.warmup_steps, steps // 2), steps)
        needs_logprobs = lmbda > 0 and (opd.reward_weight > 0 or any(o.policy_gradient for o in objectives.values()))
        start = self.resume_at[1] if self.resume_at is not None else 0  # where a resumed stage goes on
        # The on-policy stage's guided routes: the schedule's clock is the stage's step (the student's version less
        # the steps it had taken when the stage began).
        guide = (GuidedPrefixes(self.guides, self.offpolicy.teacher_samples, self.eos, self.state.version - start)
                 if self.guides and name == "on_policy" else None)
        producer = BatchProducer(self.student, self.tok, self.sampler, self.offpolicy, self.caps, opd.batch_size,
                                 opd.sample_temperature, opd.divergence_temperature, needs_logprobs,
                                 opd.overlap_generation, self.engine, seed=opd.seed * 1009 + no,
                                 verifiers=self.verifiers, row_texts=self.row_texts, sampling=self.sampling,
                                 guide=guide)
        # How much of each teacher's distribution is asked for; a capped served teacher's routes learn its top K.
        objectives, served_k = served_plan(objectives, self.teacher_of, self.logprob_caps, list(self.teachers))
        stage_id = {"cold_start": 1, "on_policy": 2}[name]
        if self.resume_at is not None:  # the stage the checkpoint was taken in
            self.resume_at = None
            self._resume_trainer(optimizer, scheduler, producer)
        bar = tqdm(range(start, steps), desc=f"merge {name}", mininterval=2.0, disable=not self.lead, initial=start,
                   total=steps)
        batch, hidden, uses, rows, combined, coverage = None, {}, opd.updates_per_batch, None, {}, {}
        try:
            for i in bar:
                t0 = time.perf_counter()
                if uses == opd.updates_per_batch:
                    batch = producer.next(lmbda, self.state.version)
                    t_batch = time.perf_counter() - t0
                    groups = self.router.group(batch.routes)
                    if opd.nproc > 1:  # every rank made the whole batch; it scores and learns on its rows
                        rows = rows_of(len(batch.routes))
                        groups = shard_groups(groups, rows)
                    hidden = score_with_teachers(self.teachers, self.pool.resident_first(groups), batch.rollout,
                                                 served_k, self.state.teacher_costs, self.tok, batch.texts)
                    coverage = signal_coverage(hidden, batch.rollout, batch.routes, self.digit_ids)
                    if self.combinations:  # routes with several teachers: one combined score per row
                        hidden, combined = combine_scores(hidden, self.combinations, batch.routes, batch.rollout,
                                                          opd.chunk_size, len(self.tok))
                    if self.reference is not None:
                        hidden = extrapolate_scores(hidden, self.reference, batch.rollout, opd.reward_scale,
                                                    self.state.teacher_costs, len(self.tok))
                    uses = 0
                    t_teacher = time.perf_counter() - t0 - t_batch
                else:
                    t_batch = t_teacher = 0.0
                staleness = self.state.version - batch.version if batch.on_policy else 0
                st = update_step(self.student, batch, hidden, objectives, optimizer, scheduler,
                                 opd.chunk_size, opd.grad_clip, opd.route_weights, opd.reward_weight, rows,
                                 vocab_size=len(self.tok), normalize_groups=self.norm_groups,
                                 normalize_clip=opd.route_normalization_clip)
                if rows is not None:
                    st = sum_stats(st, self.routes)
                uses += 1
                self.state.step += 1
                self.state.train_seconds += time.perf_counter() - t0
                if st.skipped:
                    self.state.bad_steps += 1
                else:
                    self.state.version += 1
                    self.window.add(st, batch.on_policy)
                m = {"train/loss": st.loss, "train/grad_norm": st.grad_norm,
                     "train/skipped_steps": float(self.state.bad_steps), "stage": stage_id,
                     "rollout/on_policy": float(batch.on_policy),
                     "rollout/staleness": float(staleness), "time/update": st.seconds["update"],
                     "teachers/loads": float(self.pool.loads), "teachers/evictions": float(self.pool.evictions),
                     "teachers/resident": float(len(self.pool.resident)),
                     "teachers/shared": float(sum(len(sb) for sb in self.shared)),
                     "time/train_total": self.state.train_seconds}
                m.update({f"signal_scale/{r}": v for r, v in st.signal_scale.items()})
                if self.pool.park is not None:  # teachers parked in host memory, moved back to the GPU
                    m["teachers/unparks"] = float(self.pool.unparks)
                if uses == 1:
                    # Time the update waited for its batch (with overlap: only what the background did not hide).
                    m.update({"time/generate": t_batch, "time/teacher": t_teacher,
                              "rollout/generated": float(batch.generated)})
                    if batch.on_policy:  # combined routes: each teacher's NLL on the student's samples, select's shares
                        m.update(combined)
                    m.update(coverage)  # teachers that read their own text: the share of tokens they gave a signal
                    # What generation cost, cumulative over the merge: the student's own rollouts, and the
                    # teachers' samples (off-policy batches; each prompt's completion is sampled once and cached).
                    key = "student_tokens" if batch.on_policy else "teacher_sampled_tokens"
                    self.state.generated[key] += batch.generated_tokens
                    if guide is not None:  # guided OPD: the teachers' samples its prefixes came from, and its share
                        self.state.generated["teacher_sampled_tokens"] += batch.teacher_tokens
                        m["rollout/guided_tokens"] = float(batch.guided_tokens)
                        m.update({f"guide_fraction/{r}": v for r, v in guide.fractions(batch.version).items()})
                    m.update({f"rollout/{k}": float(v) for k, v in self.state.generated.items()})
                    if opd.overlap_generation or self.engine is not None:
                        m["time/sync"] = producer.sync_seconds
                if self.state.step % opd.eval_every == 0:
                    m.update(self._eval_metrics())
                if self.mix_slice is not None:  # the shares this step's batch was drawn with, then the next ones
                    m.update({f"route_share/{r}": v for r, v in self.sampler.shares.items()})
                    if self.state.step % opd.route_sampling_every == 0:
                        m.update(self.reweigh())
                self.log({k: v for k, v in m.items() if v == v and abs(v) != float("inf")}, self.state.step)
                bar.set_postfix(loss=f"{st.loss:.4f}", refresh=False)
                if self.state.bad_steps > opd.max_bad_steps:
                    raise TooManyBadSteps(
                        f"{self.state.bad_steps} steps had a non-finite loss or gradient norm, more than opd.max_bad_steps "
                        f"= {opd.max_bad_steps} (the last at step {self.state.step}, loss {st.loss}, gradient norm "
                        f"{st.grad_norm}). The merge stopped; skipped steps never touch the weights, so "
                        f"{self.describe_checkpoint()}: lower opd.lr or opd.grad_clip, or raise opd.max_bad_steps, "
                        "then run the same command again to resume"
                    )
                # Checkpoints only where nothing is half done: at a batch boundary (rollout reuse) or a stage's end.
                if (self.checkpoints is not None and opd.checkpoint_every
                        and self.state.step - self.last_checkpoint >= opd.checkpoint_every
                        and (uses == opd.updates_per_batch or i + 1 == steps)):
                    self._checkpoint(no, i + 1, optimizer, scheduler, producer)
        finally:
            producer.close()

    def capture(self, stage_no: int, stage_step: int, optimizer, scheduler, producer: BatchProducer) -> MergeState:
        """:attr:`state`, completed with what the components hold now, ready to save (collective with a sharded
        student: every rank takes part, the lead's copy holds the full weights and optimizer state)."""
        s = self.state
        if self.opd.nproc > 1:
            s.weights = full_state_dict(self.student)
            s.optimizer = get_optimizer_state_dict(self.student, optimizer,
                                                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:
            s.weights, s.optimizer = self.student.state_dict(), optimizer.state_dict()
        s.pending = producer.drain()  # with overlap: the batch generated ahead, which the next step learns from
        s.scheduler, s.torch_rng, s.rollout_rng = scheduler.state_dict(), torch.get_rng_state(), producer.rng_state()
        s.sampler_rng, s.python_rng = self.sampler.rng.getstate(), random.getstate()
        s.stage_no, s.stage_step = stage_no, stage_step
        s.engine_requests = self.engine.requests if self.engine is not None else 0
        s.teachers = {"resident": list(self.pool.resident), "loads": self.pool.loads, "evictions": self.pool.evictions}
        s.offpolicy = self.offpolicy.cache
        return s

    def _checkpoint(self, stage_no: int, stage_step: int, optimizer, scheduler, producer: BatchProducer) -> None:
        """Write the merge's state at this step as a checkpoint (the lead writes)."""
        t0 = time.perf_counter()
        state = self.capture(stage_no, stage_step, optimizer, scheduler, producer)
        self.last_checkpoint = state.step
        try:
            if not self.lead:
                return
            bad = [k for k, v in state.weights.items() if not bool(torch.isfinite(v).all())]
            if bad:
                raise FloatingPointError(f"student weights {bad[:3]} are not finite at step {state.step}: not "
                                         f"checkpointed; {self.describe_checkpoint()}")
            path = self.checkpoints.save(*state.files())
        finally:
            state.release_tensors()
        self.say(f"checkpoint at step {state.step} in {time.perf_counter() - t0:.2f}s: {path}")

    def _resume_components(self) -> None:
        """Give the components what the resumed state holds for them, but the optimizer, schedule and RNGs
        (:meth:`_resume_trainer`, when the stage the checkpoint was taken in starts again)."""
        s = self.state
        self.last_checkpoint, self.resume_at = s.step, (s.stage_no, s.stage_step)
        if self.engine is not None:
            self.engine.requests = s.engine_requests
        self.offpolicy.cache = s.offpolicy
        for name in s.teachers["resident"]:  # the same residents in the same least-recently-used order
            self.pool[name]
        self.pool.loads, self.pool.evictions = s.teachers["loads"], s.teachers["evictions"]
        self.sampler.rng.setstate(s.sampler_rng)
        if self.mix_slice is not None and s.route_need:
            self.sampler.shares = route_shares(s.route_need, self.opd.route_sampling_floor)
        self.say(f"resuming from the checkpoint at step {s.step} ({self.resumed_from})")

    def _resume_trainer(self, optimizer, scheduler, producer: BatchProducer) -> None:
        """The rest of the resumed state, as the stage it was taken in starts again: last, so that nothing between
        loading and training consumes the restored RNG states."""
        s = self.state
        if self.opd.nproc > 1:
            set_optimizer_state_dict(self.student, optimizer, s.optimizer,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(s.optimizer)
        scheduler.load_state_dict(s.scheduler)
        producer.prime(s.pending)
        producer.set_rng_state(s.rollout_rng)  # absent from checkpoints older than it
        torch.set_rng_state(s.torch_rng)
        random.setstate(s.python_rng)
        s.release_tensors()

    def _eval_metrics(self) -> dict[str, float]:
        self.state.scores = self.evaluate(self.student)
        m = {**self.window.metrics(), **route_metrics(self.state.scores, self.state.teacher_acc, self.labels), **self._pass_at_k(),
             **{f"teacher_tokens/{name}": tokens for name, (tokens, _) in self.state.teacher_costs.items()},
             **{f"time/teacher_total/{name}": seconds for name, (_, seconds) in self.state.teacher_costs.items()}}
        self.say(f"step {self.state.step}: mean retention {m['retention/mean']:.3f}, "
                 + ", ".join(f"{r} {m[f'retention/{r}']:.2f}" for r in self.routes))
        self.progress.update(100.0 * self.state.step / max(self.planned, self.state.step),
                             f"step {self.state.step}/{self.planned}: mean retention {m['retention/mean']:.3f}")
        return m

    def _pass_at_k(self) -> dict[str, float]:
        """``pass_at_<k>/<route>`` on the first ``pass_k_prompts`` held-out prompts, ``pass_k_samples`` samples each at
        the sampling temperature. Drawn from its own seeded RNG so that measuring it never changes training."""
        opd = self.opd
        if not opd.pass_k:
            return {}
        out = {}
        with torch.random.fork_rng():
            torch.manual_seed(opd.seed * 1_000_003 + self.state.step)
            for r in self.routes:
                prompts, answers = (x[: opd.pass_k_prompts] for x in self.eval_sets[r])
                out[f"pass_at_{opd.pass_k}/{r}"] = sampled_pass_at_k(
                    self.student, self.tok, self.verifiers[r], prompts, answers, self.caps[r], opd.pass_k,
                    opd.pass_k_samples,
                    opd.sample_temperature)
        return out

    def gate(self) -> GateResult:
        self.gate_calls += 1
        if self.gate_calls <= len(self.state.gates):  # resumed: this gate ran (and was logged) before the checkpoint
            return self.state.gates[self.gate_calls - 1]
        prompts = {r: self.eval_sets[r][0][: self.opd.gate_samples] for r in self.routes}
        res = compliance_gate(self.student, self.tok, prompts, self.caps, self.opd.gate_threshold,
                              self.ps.well_formed, self.opd.sample_temperature)
        self.state.gates.append(res)
        self.log({"gate/passed": float(res.passed),
                  **{f"gate/eos_rate/{r}": v for r, v in res.eos_rate.items()},
                  **{f"gate/format_rate/{r}": v for r, v in res.format_rate.items()}}, self.state.step)
        self.say(f"cold-start gate {'passed' if res.passed else 'FAILED'} at step {self.state.step}: {res.describe()}")
        return res

    def train(self) -> dict[str, RouteScore]:
        """The merge's stages: the baseline evaluation, the optional off-policy cold start and its compliance gate
        (:class:`GateBlocked` when the student's own samples stay malformed), the on-policy stage with each route's
        objective, and an evaluation at the last step. Returns the baseline scores."""
        opd = self.opd
        base_scores = self.baseline()
        cold_start = {r: opd.cold_start_objective() for r in self.routes}
        if opd.cold_start_steps:
            self.say(f"cold start: {opd.cold_start_steps} steps of {opd.cold_start_loss} on {opd.off_policy_source} "
                     "completions")
            self.stage("cold_start", opd.cold_start_steps, opd.cold_start_lr, 0.0, cold_start)
        if opd.gate_threshold > 0:
            result = self.gate()
            for _ in range(opd.gate_retries if opd.cold_start_steps else 0):
                if result.passed:
                    break
                self.stage("cold_start", opd.cold_start_steps, opd.cold_start_lr, 0.0, cold_start)
                result = self.gate()
            if not result.passed:
                hint = ("more opd.cold_start_steps or opd.gate_retries" if opd.cold_start_steps
                        else "an off-policy cold start (opd.cold_start_steps > 0)")
                raise GateBlocked(
                    f"the student's own samples fail the compliance gate on {result.failing}: {result.describe()}. "
                    f"On-policy distillation cannot teach what the student never samples; try {hint}, or lower "
                    "opd.gate_threshold"
                )
        self.stage("on_policy", opd.steps, opd.lr, opd.lmbda, {r: opd.objective(r) for r in self.routes})
        self.finish()
        return base_scores

    def _shared_loader(self, base: str, recs: list, served: dict, student_fp: str):
        """What loads a shared base (:class:`SharedBase`): each of its teachers checked as a pool load checks it,
        then the base, frozen on opd.teacher_device in opd.teacher_dtype."""
        def load():
            for rec in recs:
                check_teacher(rec, self.tok, served.get(rec.name), student_fp)
            return place_frozen(load_model(base), self.opd.teacher_device, self.opd.teacher_dtype)
        return load

    def cleanup(self) -> None:
        """Release what setup took, whether training finished or failed: the served teachers' engines and clients,
        the student's rollout engine and the resident teachers."""
        for server in (self.servers.resident.values() if self.servers is not None else ()):
            client = getattr(server, "client", None)
            if client is not None:
                client.close()
        if self.servers is not None:
            self.servers.resident.clear()
        self.pool.resident.clear()
        for shared in self.shared:
            shared.release()
        self.engine = self.servers = None
        gc.collect()

    def finish(self) -> None:
        """Evaluate at the last step unless that just happened, and log the window; then the student's recovery
        diagnostic beside the base's and the teachers'."""
        if self.state.step % self.opd.eval_every:
            self.log(self._eval_metrics(), self.state.step)
        student = self.recovery(self.student)
        self.log({f"recovery/student/{r}": v for r, v in student.items()}, self.state.step)
        rec = self.state.recovery
        if student:
            self.say("recovery from one injected error (share still right; base / teacher / student): " + ", ".join(
                f"{r} {rec['base'].get(r, float('nan')):.2f} / {rec['teacher'].get(r, float('nan')):.2f} / {v:.2f}"
                for r, v in student.items()))


@task(name="distill", cache_policy=NO_CACHE, retry_condition_fn=is_transient)
def run_merge(cfg: MergeConfig, prompt_set: str, router: Routing, run_id: str,
              checkpoint_dir: str | None = None) -> dict:
    """Merge the routed teachers into ``cfg.student_uri``: an optional off-policy cold start (supervised KD on
    teacher samples or gold completions), the compliance gate, then on-policy distillation with each route's
    objective; per-route metrics go to MLflow run ``run_id``.

    Returns references only: the MLflow run id, the student checkpoint URI and the retention table rows.

    With ``opd.nproc`` > 1 the student update runs on that many processes (FSDP over ``opd.dist_backend``,
    :mod:`tasks.training.sharded`), ``opd.nproc / opd.nnodes`` on each of ``opd.nnodes`` machines: this task starts
    ``torchrun`` for this machine (:mod:`tasks.training.launch`, the job in ``<state>/jobs/<run_id>/``), prints the
    command the other machines run, waits, and returns rank 0's result or raises the error of the rank that failed.

    With ``checkpoint_dir`` (a :class:`tasks.training.checkpoint.MergeCheckpoints` folder, see :func:`open_merge_run`) the
    merge checkpoints itself there and resumes from the newest checkpoint it finds; it is marked finished at the end.
    """
    opd = cfg.opd
    if opd.nproc > 1:
        device = resolve_device(opd.device).type
        return launch(merge_rank, (cfg, prompt_set, router, run_id, checkpoint_dir), job_dir(run_id),
                      nproc_per_node=opd.nproc // opd.nnodes, nnodes=opd.nnodes, endpoint=opd.rdzv_endpoint,
                      rdzv_id=run_id, backend=resolve_backend(opd.dist_backend, device), device=device)
    return merge_rank(cfg, prompt_set, router, run_id, checkpoint_dir)


def merge_rank(cfg: MergeConfig, prompt_set: str, router: Routing, run_id: str,
               checkpoint_dir: str | None = None) -> dict:
    """The body of :func:`run_merge` on one rank; rank 0 saves, registers and returns the references."""
    opd = cfg.opd
    checkpoints = MergeCheckpoints(checkpoint_dir) if checkpoint_dir else None
    # opd.threads torch threads for the whole merge, set before any in-process vLLM engine starts.
    with torch_threads(cpu_threads(opd.threads, opd.nproc // opd.nnodes)) as threads:
        if rank() == 0:
            say(f"merge: {threads} torch thread(s) per process (opd.threads {opd.threads})")
        loop = MergeLoop(cfg, prompt_set, router, run_id, checkpoints)  # setup: models, teachers, engines, state
        try:
            base_scores = loop.train()
        finally:
            loop.cleanup()
    routes = loop.routes
    state_dict = full_state_dict(loop.student) if opd.nproc > 1 else None  # collective: every rank takes part
    if not loop.lead:
        return {}

    scores = loop.state.scores
    rows = [{**retention_row(r, "+".join(loop.teachers_of[r]), scores[r].accuracy, loop.state.teacher_acc[r],
                             base_scores[r].accuracy),
             "base_exact": base_scores[r].exact, "teacher_exact": loop.state.teacher_exact.get(r),
             "student_exact": scores[r].exact} for r in routes]
    _, out = save_trained(loop.student, loop.tok, models_dir() / "merged" / run_id, state_dict)
    (out / "retention.json").write_text(json.dumps(rows, indent=2))
    log_retention(run_id, rows, out)
    log_metrics(run_id, {f"gain_recovered/{row['route']}": row["gain_recovered"] for row in rows
                         if row["gain_recovered"] is not None}, opd.steps)
    mean = mean_retention(rows)
    # A merge killed after registering and resumed registers its student once.
    version = registered_version(STUDENT_MODEL, run_id) or register_version(STUDENT_MODEL, run_id, "student", {
        "teachers": ",".join(sorted({n for names in loop.teachers_of.values() for n in names})), "loss": opd.loss,
        "label": cfg.label,
        "mean_retention": f"{mean:.4f}"}, "Merged students of OPD runs; @champion has the best mean retention.")
    champion = promote_if_best(STUDENT_MODEL, version)
    say(f"registered {STUDENT_MODEL} version {version}" + (" as @champion" if champion else ""))
    end_run(run_id, {"merged_student_uri": str(out), "registered_model": f"{STUDENT_MODEL}/{version}",
                     "champion": str(champion)})
    result = {"run_id": run_id, "student_uri": str(out), "rows": rows, "model_version": version, "champion": champion,
              "retention_by": label_means({row["route"]: row["retention"] for row in rows}, loop.labels)}
    if checkpoints is not None:
        checkpoints.finish({"run_id": run_id, "result": result})
    return result


def open_merge_run(cfg: MergeConfig, router: Routing, run_name: str, prompt_set: str) -> tuple[str, MergeCheckpoints]:
    """This merge's MLflow run and checkpoint folder, locked for this process (:meth:`MergeCheckpoints.release`).

    The same command (same config up to :data:`tasks.training.checkpoint.RUN_POLICY`, student, teachers and MLflow store)
    after a kill or a failure reopens the run it started, to resume from its last checkpoint (``opd.resume``).
    A merge that finished, or ``opd.resume`` false, gets a new run and starts over (and says so)."""
    student_fp = checkpoint_fingerprint(cfg.student_uri) if Path(cfg.student_uri).is_dir() else cfg.student_uri
    checkpoints = MergeCheckpoints.for_merge(cfg, student_fp, registry_fingerprint(router.teachers()), tracking_uri(),
                                             Path(prompt_set).name)
    checkpoints.acquire()
    try:
        checkpoints.clean()
        previous, done = checkpoints.run_id(), checkpoints.finished()
        if previous and not done and cfg.opd.resume:
            latest = checkpoints.latest()
            reopen_run(previous, latest.name if latest is not None else "start")
            say(f"resuming this merge in its MLflow run {previous} "
                + (f"from {latest.name}" if latest else "from the start (it stopped before its first checkpoint)")
                + f" ({checkpoints.root})")
            return previous, checkpoints
        if done:
            say(f"this merge already finished as MLflow run {done['run_id']}: running it again in a new run")
        elif previous:
            say(f"opd.resume is false: starting over in a new run; the checkpoints of MLflow run {previous} are "
                "dropped")
            mark_failed(previous, "KILLED")
        run_id = start_merge_run(cfg, router, run_name, prompt_set)
        checkpoints.begin(run_id)
        return run_id, checkpoints
    except BaseException:
        checkpoints.release()
        raise


def mark_failed(run_id: str, status: str = "FAILED") -> None:
    """End a run that did not finish so that it does not look in progress; an MLflow that cannot be reached is said,
    not raised (it must not hide the error that stopped the merge)."""
    try:
        end_run(run_id, status=status)
    except (MlflowException, RequestException, OSError) as e:
        say(f"warning: MLflow run {run_id} could not be marked {status} ({type(e).__name__}); it stays RUNNING "
            "until the same command resumes it")


def start_merge_run(cfg: MergeConfig, router: Routing, run_name: str, prompt_set: str) -> str:
    """Create the merge's MLflow run: every config field as a param, teachers and fingerprints as tags, the route
    spec as an artifact with its hash as a param (:func:`tasks.tracking.runs.log_spec`)."""
    records = router.teachers()
    tags = {
        "teachers": ",".join(r.name for r in records),
        "registry_fingerprint": registry_fingerprint(records),
        "student_uri": cfg.student_uri,
        **{f"teacher.{r.name}": f"{r.route} {r.tokenizer_fingerprint} {r.model_uri}" for r in records},
        # A route with several teachers: how they combine (the spec's combine and teacher_weights).
        **{f"combine.{route}": "{} {}".format(*router.combine_for(route))
           for route in sorted({r.route for r in records}) if len(router.teachers_for(route)) > 1},
    }
    run_id = start_run(cfg.experiment, run_name, config_params(cfg), tags)
    log_spec(run_id, prompt_set)
    return run_id
