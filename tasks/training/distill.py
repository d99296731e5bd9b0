"""One distillation step, in three parts the merge loop composes: make a batch of sequences (the student's own
rollouts, or off-policy completions: teacher samples cached per teacher, or a dataset column), let each row's routed
teacher score it in one forward pass (a route with several teachers: each of them, then :func:`combine_scores` makes
one score per row), and update the student with each route's objective from the menu in
:mod:`tasks.objectives.losses`.
"""

from __future__ import annotations

import copy
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.modeling.device import autocast_for
from tasks.objectives.combine import (PER_TOKEN, CombinedHead, normalized_weights, sampling_teacher, select_teachers,
                                      sequence_nll)
from tasks.modeling.engines import ALL_VOCAB, VLLMRollout
from tasks.objectives.losses import (DIAGNOSTICS, ExtrapolatedHead, Objective, ObjectiveResult, TokenInputs,
                                     chunked_objective, spread_scales)
from tasks.modeling.rollout import (
    Rollout,
    cap_responses,
    cut_at_stops,
    decode_responses,
    eos_ids,
    forward_hidden,
    generate,
    response_ids,
    rollout_from_responses,
    token_logprobs,
)
from tasks.evaluation.evaluate import right
from tasks.modeling.teacher import Teacher, TeacherBatch, TeacherScore
from tasks.specs.render import RowText
from tasks.training.guided import GuidedPrefixes
from tasks.specs.spec import Sampling
from tasks.specs.verifiers import Verifier

OffPolicySource = Literal["teacher", "dataset"]


@dataclass
class Batch:
    """Sequences to learn on. ``version`` is the number of optimizer steps the generating policy had taken (-1 for
    off-policy data); ``tokens`` holds behaviour/old log-probs (on-policy batches whose objective needs them);
    ``answers`` are the rows' reference answers; ``rewards_B`` is the route verifier's 0/1 outcome on each response."""

    rollout: Rollout
    routes: list[str]
    answers: list[str]
    on_policy: bool
    version: int
    rewards_B: torch.Tensor
    tokens: TokenInputs | None = None
    generated: int = 0  # sequences generated for this batch (teacher-sample cache misses count too)
    generated_tokens: int = 0  # response tokens those sequences hold (what their generation cost)
    texts: list[RowText] = field(default_factory=list)  # per row: what its route rendered (teachers read it)
    teacher_tokens: int = 0  # tokens teachers sampled for an on-policy batch (guided OPD's prefixes, cache misses)
    guided_tokens: int = 0  # response tokens written by a teacher ahead of the student's (guided OPD; no loss)


@dataclass
class StepStats:
    loss: float
    tokens: int
    loss_sum: dict[str, float] = field(default_factory=dict)  # per route: summed per-token objective
    kl_sum: dict[str, float] = field(default_factory=dict)  # per route: summed full-vocab reverse KL (diagnostic)
    kl_tokens: dict[str, float] = field(default_factory=dict)  # per route: response tokens scored
    sequences: dict[str, int] = field(default_factory=dict)  # per route: sequences in the batch
    truncated: dict[str, int] = field(default_factory=dict)  # per route: sequences without EOS
    reward_sum: dict[str, float] = field(default_factory=dict)  # per route: verifier outcomes summed
    # per route, summed over response tokens (the losses module's DIAGNOSTICS, no gradient)
    student_entropy: dict[str, float] = field(default_factory=dict)
    teacher_entropy: dict[str, float] = field(default_factory=dict)
    teacher_nll: dict[str, float] = field(default_factory=dict)
    topk_overlap: dict[str, float] = field(default_factory=dict)
    repetition: dict[str, float] = field(default_factory=dict)  # per route: summed per-sequence repeated-3-gram rate
    length: dict[str, float] = field(default_factory=dict)  # per route: response tokens summed
    seconds: dict[str, float] = field(default_factory=dict)  # teacher / update
    signal_scale: dict[str, float] = field(default_factory=dict)  # per route: its group's normalisation scale
    grad_norm: float = 0.0  # before clipping
    skipped: bool = False  # non-finite loss or gradient norm: no optimizer step was taken


def repetition_rate(ids: list[int], n: int = 3) -> float:
    """Share of a response's n-grams that already occurred earlier in it: 0 for text that never repeats itself, near
    1 for a loop (a student gaming its teacher with repetition shows here)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def verifier_rewards(tok: PreTrainedTokenizerBase, rollout: Rollout, routes: list[str], answers: list[str],
                     verifiers: Mapping[str, Verifier], stops_B: Sequence[Sequence[str]] | None = None) -> torch.Tensor:
    """1.0 where the response is right by its route's verifier (a full score against its reference answer), else
    0.0: ``[B]``. ``stops_B``: each row's stop strings (the verifier reads the text before the first)."""
    texts = decode_responses(tok, rollout, stops_B)
    return torch.tensor([float(right(verifiers[r], [t], [a], [""])[0]) for r, a, t in zip(routes, answers, texts)])


def sample_batch(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: list[str],
    routes: list[str],
    answers: list[str],
    caps_B: list[int],
    version: int,
    sample_temperature: float = 1.0,
    divergence_temperature: float = 1.0,
    with_logprobs: bool = False,
    engine: VLLMRollout | None = None,
    generator: torch.Generator | None = None,
    *,
    verifiers: Mapping[str, Verifier],
    sampling: Mapping[str, Sampling] | None = None,
    prefixes: Sequence[Sequence[int]] | None = None,
) -> Batch:
    """On-policy rollouts of ``model``, each row cut at its route's cap, by transformers (drawing from ``generator``
    when given, else torch's global one) or by the vLLM ``engine`` holding ``model``'s weights. Each row samples as
    its route's ``sampling`` says (temperature, top-p, stop strings; a route without one, or no ``sampling``: at
    ``sample_temperature``, no top-p, no stop string). With ``with_logprobs`` the behaviour log-probs (each row's
    sampling temperature) and the old policy's log-probs (divergence temperature) of the sampled tokens are recorded
    for the importance ratio and the per-token advantage; the engine's own log-probs serve as the behaviour
    log-probs. Responses end at any of :func:`tasks.modeling.rollout.eos_ids` or at a stop string; log-probs are over
    the tokenizer's ``len(tok)`` ids. ``prefixes``: per row, tokens the response starts with that the student
    continues (guided OPD, :mod:`tasks.training.guided`; transformers backend only): ``external``, out of the loss,
    inside the row's cap."""
    guided = prefixes is not None and any(prefixes)
    if guided and engine is not None:
        raise ValueError("guided rollouts (a teacher's prefix the student continues) run on the transformers rollout "
                         "backend; expected opd.rollout_backend hf for a merge with a guided teacher")
    rows = [(sampling or {}).get(r, Sampling(sample_temperature)) for r in routes]
    temps_B, top_p_B, stops_B = [x.temperature for x in rows], [x.top_p for x in rows], [x.stop for x in rows]
    uniform = len(set(temps_B)) == 1 and set(top_p_B) == {1.0}
    temperature = temps_B[0] if uniform else temps_B
    tokens = None
    eos = eos_ids(tok, model) if engine is None else engine.eos
    if engine is not None:
        rollout, logq_beh_B_T = engine.generate(prompts, caps_B, temperature, top_p=top_p_B)
        rollout = cut_at_stops(rollout, tok, stops_B, eos)
        if with_logprobs:
            if uniform and temps_B[0] == divergence_temperature:
                logq_old_B_T = logq_beh_B_T
            else:
                (logq_old_B_T,) = token_logprobs(model, rollout, (divergence_temperature,), vocab_size=len(tok))
            tokens = TokenInputs(rollout.sequences_B_T[:, 1:], logq_beh_B_T, logq_old_B_T)
    else:
        new = max(c - len(x) for c, x in zip(caps_B, prefixes)) if guided else max(caps_B)
        rollout = generate(model, tok, prompts, new, greedy=False, temperature=temperature,
                           generator=generator, top_p=top_p_B if not uniform else 1.0, stop=stops_B,
                           prefixes=prefixes if guided else None)
        rollout = cap_responses(rollout, caps_B, eos)
    if with_logprobs and tokens is None:
        temps = tuple(dict.fromkeys([*temps_B, divergence_temperature]))
        lp = dict(zip(temps, token_logprobs(model, rollout, temps, vocab_size=len(tok))))
        logq_beh_B_T = torch.stack([lp[t][b] for b, t in enumerate(temps_B)])
        tokens = TokenInputs(rollout.sequences_B_T[:, 1:], logq_beh_B_T, lp[divergence_temperature])
    rewards_B = verifier_rewards(tok, rollout, routes, answers, verifiers, stops_B)
    own = rollout.response_mask_B_T if rollout.loss_tokens_B_T is None else rollout.loss_tokens_B_T
    return Batch(rollout, routes, answers, True, version, rewards_B, tokens, len(prompts), int(own.sum()),
                 guided_tokens=int(rollout.response_lengths_B.sum() - own.sum()))


def check_sampling(sampling: Mapping[str, Sampling], with_logprobs: bool, engine: bool) -> None:
    """Refuse route sampling the policy-gradient terms cannot account for, before any rollout: a route at
    temperature 0 has no behaviour distribution, and the transformers backend computes behaviour log-probs of the
    whole tempered distribution, not of a nucleus (vLLM returns the nucleus's own)."""
    if not with_logprobs:
        return
    for route, x in sampling.items():
        if x.temperature == 0:
            raise ValueError(f"route {route!r}: generate.temperature 0 (greedy rollouts) with a policy-gradient "
                             "objective, whose importance ratio needs a sampling distribution: set a temperature > 0")
        if x.top_p < 1 and not engine:
            raise ValueError(f"route {route!r}: generate.top_p {x.top_p:g} with a policy-gradient objective on the "
                             "transformers rollout backend, which records behaviour log-probs of the whole tempered "
                             "distribution, not of the nucleus: set top_p 1, or opd.rollout_backend vllm")


class OffPolicyData:
    """Off-policy completions for GKD's ``1 - lambda`` share of batches and for the cold-start stage.

    ``teacher``: each prompt's routed teacher samples a completion once (at the sampling temperature); it is cached
    per teacher and reused whenever that prompt comes back. ``dataset``: the prompt set's gold ``completion`` column.
    ``eos``: the ids that end a completion (default the tokenizer's EOS; the merge gives the student's
    :func:`tasks.modeling.rollout.eos_ids`), which the truncation flags read. ``sample_from``: route -> (its
    teachers, weights) for routes with several teachers, whose prompts are each sampled by one of them
    (:func:`tasks.objectives.combine.sampling_teacher`); other routes use ``teacher_of``.
    """

    def __init__(
        self,
        source: OffPolicySource,
        tok: PreTrainedTokenizerBase,
        teachers: Mapping[str, Teacher],
        teacher_of: dict[str, str],
        gold: dict[str, str],
        sample_temperature: float = 1.0,
        *,
        verifiers: Mapping[str, Verifier],
        eos: tuple[int, ...] = (),
        sample_from: Mapping[str, tuple[list[str], list[float]]] | None = None,
    ):
        if source not in ("teacher", "dataset"):
            raise ValueError(f"off-policy source must be 'teacher' or 'dataset', got {source!r}")
        self.source, self.tok, self.teachers, self.teacher_of = source, tok, teachers, teacher_of
        self.gold, self.sample_temperature, self.verifiers = gold, sample_temperature, verifiers
        self.eos = eos or eos_ids(tok)
        self.sample_from = {r: v for r, v in (sample_from or {}).items() if len(v[0]) > 1}
        self.cache: dict[str, dict[str, list[int]]] = {name: {} for name in teachers}  # teacher -> prompt -> ids

    def teacher(self, prompt: str, route: str) -> str:
        """The teacher whose sample of ``prompt`` is its off-policy completion."""
        if route in self.sample_from:
            return sampling_teacher(prompt, *self.sample_from[route])
        return self.teacher_of[route]

    def batch(self, prompts: list[str], routes: list[str], answers: list[str], caps_B: list[int],
              generator: torch.Generator | None = None, texts: list[RowText] | None = None) -> Batch:
        """Off-policy completions of ``prompts``; teacher samples missing from the cache are drawn from ``generator``
        when given, else from torch's global one. ``texts``: each row's :class:`RowText` (default: the prompt text
        alone), what a teacher samples from."""
        texts = texts or texts_of(prompts, routes)
        generated = generated_tokens = 0
        if self.source == "dataset":
            missing = [p for p in prompts if p not in self.gold]
            if missing:
                raise KeyError(f"no dataset completion for {len(missing)} prompts, e.g. {missing[0]!r}")
            ids = self.tok([self.gold[p] for p in prompts], add_special_tokens=False)["input_ids"]
            responses = [x + [self.tok.eos_token_id] for x in ids]
        else:
            responses, generated, generated_tokens = self.teacher_samples(texts, caps_B, generator)
        rollout = cap_responses(rollout_from_responses(self.tok, prompts, responses, self.eos), caps_B, self.eos)
        rewards_B = verifier_rewards(self.tok, rollout, routes, answers, self.verifiers)
        return Batch(rollout, routes, answers, False, -1, rewards_B, None, generated, generated_tokens, list(texts))

    def teacher_samples(self, texts: list[RowText], caps_B: list[int],
                        generator: torch.Generator | None = None) -> tuple[list[list[int]], int, int]:
        """Each row's routed teacher's own sample (student token ids; drawn once per prompt and cached), and how many
        were drawn now and their response tokens (what this call's teacher generation cost)."""
        generated, tokens = self._fill(texts, caps_B, generator)
        return [self.cache[self.teacher(t.prompt, t.route)][t.prompt] for t in texts], generated, tokens

    def _fill(self, texts: list[RowText], caps_B: list[int], generator: torch.Generator | None) -> tuple[int, int]:
        """Sample the missing (teacher, prompt) completions, one sample call per teacher. Returns how many, and
        their response tokens."""
        todo: dict[str, dict[str, tuple[RowText, int]]] = {}
        tokens = 0
        for t, cap in zip(texts, caps_B):
            name = self.teacher(t.prompt, t.route)
            if t.prompt not in self.cache[name]:
                todo.setdefault(name, {})[t.prompt] = (t, cap)
        for name, want in todo.items():
            plist = list(want)
            ro = self.teachers[name].sample(self.tok, [want[p][0] for p in plist], [want[p][1] for p in plist],
                                            self.sample_temperature, generator)
            self.cache[name].update(zip(plist, response_ids(ro)))
            tokens += int(ro.response_lengths_B.sum())
        return sum(len(c) for c in todo.values()), tokens


def texts_of(prompts: list[str], routes: list[str],
             row_texts: Mapping[tuple[str, str], RowText] | None = None) -> list[RowText]:
    """Each row's :class:`RowText` from ``row_texts`` ((route, prompt) -> what its route rendered: a prompt set's
    :meth:`tasks.specs.prompt_set.PromptSet.row_texts`), else the row known by its prompt text alone (no chat
    messages), as a caller without a prompt set gives its teachers."""
    known = row_texts or {}
    return [known.get((r, p)) or RowText(r, p) for p, r in zip(prompts, routes)]


class PromptSampler:
    """Draws batches from each route's training prompts (``route -> (prompts, answers)``), deterministic in
    ``seed``: each row's route uniformly, or by ``shares`` (route -> probability, set by the merge's retention-driven
    route sampling, :mod:`tasks.merging.route_mix`) when set; also flips GKD's lambda coin for each batch."""

    def __init__(self, train: dict[str, tuple[list[str], list[str]]], seed: int):
        self.train, self.routes = train, list(train)
        self.rng = random.Random(seed)
        self.shares: dict[str, float] | None = None

    def draw(self, n: int) -> tuple[list[str], list[str], list[str]]:
        if self.shares is None:
            routes = [self.routes[self.rng.randrange(len(self.routes))] for _ in range(n)]
        else:
            routes = self.rng.choices(self.routes, weights=[self.shares[r] for r in self.routes], k=n)
        picks = [self.rng.randrange(len(self.train[r][0])) for r in routes]
        return [self.train[r][0][i] for r, i in zip(routes, picks)], routes, [self.train[r][1][i] for r, i in zip(routes, picks)]

    def on_policy(self, lmbda: float) -> bool:
        return self.rng.random() < lmbda


class BatchProducer:
    """Makes each batch: with probability ``lmbda`` the student's own rollouts, else off-policy completions.

    With ``overlap`` the next batch is made in a background thread from a copy of the student (the rollout model)
    while the current update runs; the copy gets the student's weights each time a batch is taken, so a batch is one
    update behind (``staleness`` 1, more with rollout reuse) and the importance ratio corrects for it. The thread
    samples from a generator of its own, seeded with ``seed`` (:meth:`rng_state` for checkpoints), never torch's
    global one: whatever the update draws meanwhile (a student's dropout) cannot change the batches.

    With a vLLM ``engine`` the engine is the rollout model: the student's weights are pushed into it before it
    generates a batch for a newer student (after every optimizer step when each batch serves one update), and
    ``sync_seconds`` is that push's cost. With the engine's sleep mode (GPUs, ``opd.vllm_enable_sleep_mode``) the
    engine sleeps once a batch is made, while the update runs, and wakes to sync and sample the next one.
    """

    def __init__(
        self,
        student: PreTrainedModel,
        tok: PreTrainedTokenizerBase,
        sampler: PromptSampler,
        offpolicy: OffPolicyData,
        caps: dict[str, int],
        batch_size: int,
        sample_temperature: float = 1.0,
        divergence_temperature: float = 1.0,
        with_logprobs: bool = False,
        overlap: bool = False,
        engine: VLLMRollout | None = None,
        seed: int = 0,
        *,
        verifiers: Mapping[str, Verifier],
        row_texts: Mapping[tuple[str, str], RowText] | None = None,
        sampling: Mapping[str, Sampling] | None = None,
        guide: GuidedPrefixes | None = None,
    ):
        self.student, self.tok, self.sampler, self.offpolicy, self.caps = student, tok, sampler, offpolicy, caps
        self.guide = guide
        self.verifiers, self.row_texts, self.sampling = verifiers, row_texts or {}, dict(sampling or {})
        check_sampling(self.sampling, with_logprobs, engine is not None)
        self.batch_size, self.with_logprobs, self.overlap, self.engine = batch_size, with_logprobs, overlap, engine
        self.temps = (sample_temperature, divergence_temperature)
        self.rollout_model = None
        if overlap and engine is None:
            self.rollout_model = copy.deepcopy(student).eval().requires_grad_(False)
        # The cores are shared out, not oversubscribed: with n >= 2 torch threads the background generation gets
        # n // 2 of them and the update the rest (a thread's OpenMP team size is its own), restored at close().
        self.threads_before = torch.get_num_threads()
        split = overlap and engine is None and self.threads_before >= 2
        rollout_threads = self.threads_before // 2
        if split:
            torch.set_num_threads(self.threads_before - rollout_threads)
        self.executor = (ThreadPoolExecutor(1, thread_name_prefix="rollout", initializer=torch.set_num_threads,
                                            initargs=(rollout_threads if split else self.threads_before,))
                         if overlap else None)
        self.generator = torch.Generator().manual_seed(seed) if overlap else None
        self.pending: Future | None = None
        self.sync_seconds = 0.0  # time of the last weight sync into the rollout model

    def _make(self, model: PreTrainedModel, on_policy: bool, version: int, drawn) -> Batch:
        prompts, routes, answers = drawn
        caps_B = [self.caps[r] for r in routes]
        texts = texts_of(prompts, routes, self.row_texts)
        if on_policy:
            prefixes, teacher_tokens = None, 0
            if self.guide is not None and self.guide.active(routes, version):
                prefixes, teacher_tokens = self.guide.prefixes(texts, caps_B, version, self.generator)
            batch = sample_batch(model, self.tok, prompts, routes, answers, caps_B, version, *self.temps,
                                 with_logprobs=self.with_logprobs, engine=self.engine, generator=self.generator,
                                 verifiers=self.verifiers, sampling=self.sampling, prefixes=prefixes)
            batch.texts, batch.teacher_tokens = texts, teacher_tokens
            return batch
        return self.offpolicy.batch(prompts, routes, answers, caps_B, self.generator, texts)

    def next(self, lmbda: float, version: int) -> Batch:
        """The next batch; ``version`` is the number of optimizer steps the student has taken so far."""
        if not self.overlap:
            on_policy = self.sampler.on_policy(lmbda)
            if on_policy and self.engine is not None and self.engine.version != version:
                self.engine.sync(self.student, version)
                self.sync_seconds = self.engine.sync_seconds
            batch = self._make(self.student, on_policy, version, self.sampler.draw(self.batch_size))
            if self.engine is not None:  # the update comes next: with sleep mode it gets the engine's GPU memory
                self.engine.sleep()  # (the engine wakes itself to sync and sample: VLLMRollout.wake_up)
            return batch
        if self.pending is None:
            self._sync(version)
            self.pending = self._submit(lmbda, version)
        batch = self.pending.result()
        self._sync(version)
        self.pending = self._submit(lmbda, version)
        return batch

    def _submit(self, lmbda: float, version: int) -> Future:
        on_policy, drawn = self.sampler.on_policy(lmbda), self.sampler.draw(self.batch_size)
        model = self.student if self.rollout_model is None else self.rollout_model  # the engine copies the student
        return self.executor.submit(self._make, model, on_policy, version, drawn)

    def _sync(self, version: int) -> None:
        if self.engine is not None:
            self.sync_seconds = self.engine.sync(self.student, version)
            return
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(self.rollout_model.parameters(), self.student.parameters()):
                dst.copy_(src)
        self.sync_seconds = time.perf_counter() - t0

    def drain(self) -> Batch | None:
        """The batch generated ahead (with ``overlap``), waited for and kept pending: what a checkpoint must hold
        so that a resumed merge learns from the same batches. None without overlap or before the first batch."""
        return None if self.pending is None else self.pending.result()

    def prime(self, batch: Batch | None) -> None:
        """Make ``batch`` (a checkpoint's :meth:`drain`) the batch generated ahead."""
        if batch is not None:
            self.pending = Future()
            self.pending.set_result(batch)

    def rng_state(self) -> torch.Tensor | None:
        """The background thread's generator state (None without overlap); take it after :meth:`drain`."""
        return None if self.generator is None else self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor | None) -> None:
        if self.generator is not None and state is not None:
            self.generator.set_state(state)

    def close(self) -> None:
        if self.executor is not None:
            if self.pending is not None:
                self.pending.cancel()
                try:
                    self.pending.result()
                except Exception:  # noqa: BLE001 - the batch is discarded either way
                    pass
            self.executor.shutdown(wait=True)
            self.pending = None
            torch.set_num_threads(self.threads_before)


TeacherScores = dict[str, TeacherScore]


def score_with_teachers(
    teachers: Mapping[str, Teacher],
    groups: dict[str, list[int]],
    rollout: Rollout,
    logprobs: Mapping[str, int] | None = None,
    costs: dict[str, list[float]] | None = None,
    tok: PreTrainedTokenizerBase | None = None,
    texts: list[RowText] | None = None,
) -> TeacherScores:
    """Each teacher's :meth:`tasks.modeling.teacher.Teacher.score` of its rows of ``rollout`` (the student's exact sequences),
    one call per teacher (``groups``: teacher -> row indices, as :meth:`teachers.router.Router.group` makes them; a
    pool's :meth:`tasks.modeling.teacher_pool.TeacherPool.resident_first` orders them). ``logprobs`` (teacher -> -1 / k / 1,
    :func:`tasks.modeling.engines.served_logprobs_k`) says how much of the distribution its rows' objectives read; default the
    whole vocabulary.

    ``costs`` (teacher -> [tokens scored, seconds], added to) accounts what each teacher cost, loading included: the
    tokens it read, in its own tokenizer when it reads its own text. ``tok`` and ``texts`` (the student's tokenizer,
    each row's :class:`RowText`) are what a teacher that renders its own input reads."""
    out = {}
    for name, rows in groups.items():
        t0 = time.perf_counter()
        out[name] = score = teachers[name].score(
            TeacherBatch(rollout, rows, (logprobs or {}).get(name, ALL_VOCAB), tok, texts))
        if costs is not None:
            cost = costs.setdefault(name, [0.0, 0.0])
            cost[0] += float(score.tokens or rollout.attention_mask_B_T[torch.tensor(rows)].sum())
            cost[1] += time.perf_counter() - t0
    return out


def signal_coverage(scores: TeacherScores, rollout: Rollout, routes: list[str],
                    digit_ids: list[int] | None = None) -> dict[str, float]:
    """The share of each route's loss tokens that got a teacher signal: ``teacher_signal/<route>`` (1 for a teacher
    that scores every token, ``signal_b_T`` None; less for a teacher of another tokenizer where it could not align),
    and over the tokens holding a digit (``digit_ids``) ``teacher_signal_digits/<route>``."""
    mask_B_T, targets_B_T = rollout.loss_mask_B_T(), rollout.sequences_B_T[:, 1:]
    digits = torch.tensor(digit_ids or [], dtype=targets_B_T.dtype)
    sums: dict[str, list[float]] = {}
    for rows, _, _, signal_b_T, _ in (TeacherScore(*score) for score in scores.values()):
        idx = torch.tensor(rows)
        m_b_T = mask_B_T[idx].float()
        got_b_T = torch.ones_like(m_b_T) if signal_b_T is None else signal_b_T[:, :-1].cpu().float()
        d_b_T = torch.isin(targets_B_T[idx], digits).float() * m_b_T
        for k, row in enumerate(rows):
            acc = sums.setdefault(routes[row], [0.0, 0.0, 0.0, 0.0])
            for j, v in enumerate((m_b_T[k].sum(), (m_b_T[k] * got_b_T[k]).sum(), d_b_T[k].sum(),
                                   (d_b_T[k] * got_b_T[k]).sum())):
                acc[j] += float(v)
    out = {}
    for r, (n, got, nd, gotd) in sums.items():
        out[f"teacher_signal/{r}"] = got / n if n else 0.0
        if nd:
            out[f"teacher_signal_digits/{r}"] = gotd / nd
    return out


def combine_scores(
    scores: TeacherScores,
    combinations: Mapping[str, tuple[list[str], str, list[float]]],
    routes: list[str],
    rollout: Rollout,
    chunk_size: int = 64,
    vocab_size: int | None = None,
) -> tuple[TeacherScores, dict[str, float]]:
    """The scores of routes with several teachers made one per row (:mod:`tasks.objectives.combine`).
    ``combinations``: route -> (its teachers' names, primary first; combine mode; weights, empty = uniform), each
    teacher having scored exactly that route's rows of the batch (``routes``: each row's route). ``select``: each row
    stays with the teacher of lowest mean NLL on its response tokens (its entry keeps only the rows it won);
    ``mixture`` / ``average_logits``: one entry named ``'+'.join(names)`` whose features are the teachers'
    concatenated (fp32, on the primary's device) under a :class:`tasks.objectives.combine.CombinedHead`. Other
    entries pass through untouched.

    Returns the scores and, per combined route, ``teacher_nll/<route>/<teacher>`` (each teacher's mean NLL on the
    rows' response tokens, temperature 1) and with ``select`` ``teacher_share/<route>/<teacher>`` (the share of rows
    it won)."""
    out, metrics = dict(scores), {}
    mask_B_T, targets_B_T = rollout.loss_mask_B_T(), rollout.sequences_B_T[:, 1:]
    for route, (names, mode, weights) in combinations.items():
        if not any(name in out for name in names):
            continue  # the route has no rows in this batch (or this rank's shard)
        parts = [out.pop(name) for name in names]
        rows = parts[0].rows
        if any(p.rows != rows for p in parts) or any(routes[row] != route for row in rows):
            raise ValueError(f"the teachers {names} of route {route!r} must each score exactly its rows "
                             f"(rows {[p.rows for p in parts]})")
        idx = torch.tensor(rows)
        tokens_b = mask_B_T[idx].sum(-1)
        nll_K_b = torch.stack([sequence_nll(p.head, p.features_b_T_F[:, :-1], targets_B_T[idx], mask_B_T[idx],
                                            chunk_size, vocab_size) for p in parts])
        n_tokens = max(float(tokens_b.sum()), 1.0)
        metrics.update({f"teacher_nll/{route}/{name}": float(nll_K_b[k].sum()) / n_tokens
                        for k, name in enumerate(names)})
        if mode == "select":
            winner_b = select_teachers(nll_K_b, tokens_b)
            for k, (name, part) in enumerate(zip(names, parts)):
                js = (winner_b == k).nonzero().flatten()
                metrics[f"teacher_share/{route}/{name}"] = len(js) / len(rows)
                if len(js):
                    out[name] = TeacherScore([rows[j] for j in js.tolist()],
                                             part.features_b_T_F[js.to(part.features_b_T_F.device)], part.head)
        elif mode in PER_TOKEN:
            device = parts[0].features_b_T_F.device
            features_b_T_F = torch.cat([p.features_b_T_F.to(device, torch.float32) for p in parts], dim=-1)
            head = CombinedHead([p.head for p in parts], [p.features_b_T_F.shape[-1] for p in parts],
                                PER_TOKEN[mode], normalized_weights(weights, len(parts), mode == "average_logits"),
                                vocab_size)
            out["+".join(names)] = TeacherScore(rows, features_b_T_F, head)
        else:
            raise ValueError(f"route {route!r}: unknown combine mode {mode!r}; known: {['select', *PER_TOKEN]}")
    return out, metrics


def extrapolate_scores(
    scores: TeacherScores,
    reference: PreTrainedModel,
    rollout: Rollout,
    scale: float,
    costs: dict[str, list[float]] | None = None,
    vocab_size: int | None = None,
) -> TeacherScores:
    """Reward extrapolation (ExOPD): each teacher's scores become those of the target ``p_ref * (p_T / p_ref) **
    scale`` (:class:`tasks.objectives.losses.ExtrapolatedHead`), with the reference model's hidden states on the same sequences
    appended to the teacher's (one reference forward over the whole batch). ``costs["reference"]`` accounts it.
    ``vocab_size`` (``len(tok)``) cuts each head, padded or not, to the real vocabulary."""
    t0 = time.perf_counter()
    with torch.no_grad():
        ref_B_T_H = forward_hidden(reference, rollout.sequences_B_T, rollout.attention_mask_B_T)
    ref_head = reference.get_output_embeddings()
    out = {}
    for name, score in scores.items():
        rows, hidden_b_T_Ht, head, signal_b_T, tokens = TeacherScore(*score)
        # Side by side in fp32 on the teacher's device: the head casts each part back (losses.head_input).
        ref_b_T_Hr = ref_B_T_H[torch.tensor(rows, device=ref_B_T_H.device)].to(hidden_b_T_Ht.device, torch.float32)
        out[name] = TeacherScore(rows, torch.cat([hidden_b_T_Ht.float(), ref_b_T_Hr], dim=-1),
                                 ExtrapolatedHead(head, ref_head, hidden_b_T_Ht.shape[-1], scale, vocab_size),
                                 signal_b_T, tokens)
    if costs is not None:
        cost = costs.setdefault("reference", [0.0, 0.0])
        cost[0] += float(rollout.attention_mask_B_T.sum())
        cost[1] += time.perf_counter() - t0
    return out


def sequence_advantages(rewards_B: torch.Tensor, routes: list[str], reward_weight: float) -> torch.Tensor:
    """``reward_weight * (R_b - mean of R over the batch's rows of the same route)``: the verifier's outcome as a
    sequence advantage with a per-route group baseline (GKD+RL). ``[B]``."""
    adv_B = torch.zeros_like(rewards_B)
    for r in set(routes):
        idx = torch.tensor([i for i, x in enumerate(routes) if x == r])
        adv_B[idx] = rewards_B[idx] - rewards_B[idx].mean()
    return reward_weight * adv_B


def _head_width(head) -> int | None:
    out = getattr(head, "out_features", None)
    weight = getattr(head, "weight", None)
    return out if out is not None else (weight.shape[0] if isinstance(weight, torch.Tensor) else None)


def head_mismatch(student_head, teacher_head) -> None:
    """Refuse heads of different widths compared whole (no ``vocab_size``): a padded head (a vocabulary rounded up to a
    multiple of 64, say) would otherwise fail deep in the loss with a bare tensor-size error."""
    s, t = _head_width(student_head), _head_width(teacher_head)
    if s is not None and t is not None and s != t:
        raise ValueError(f"the student's head has {s} outputs and the teacher's {t}: a head padded past the "
                         "tokenizer; pass update_step(..., vocab_size=len(tokenizer)) to compare the two over the "
                         "tokenizer's ids (the merge always does)")


def update_step(
    student: PreTrainedModel,
    batch: Batch,
    teacher_hidden: TeacherScores,
    objectives: dict[str, Objective],
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    chunk_size: int = 16,
    grad_clip: float = 1.0,
    route_weights: dict[str, float] | None = None,
    reward_weight: float = 0.0,
    shard: slice | None = None,
    vocab_size: int | None = None,
    normalize_groups: Mapping[str, str] | None = None,
    normalize_clip: float = 4.0,
) -> StepStats:
    """One optimizer step on ``batch``: rows are grouped by (teacher, route objective) and each group's objective is
    summed over its response tokens; the total is divided by the batch's response tokens. ``route_weights`` scale a
    route's tokens (default 1). A ``reward_weight`` adds the verifier outcome as a sequence advantage on on-policy
    batches. Returns per-route statistics. A non-finite loss or gradient norm takes no step at all (``skipped``
    in the statistics; the caller counts it). ``vocab_size`` (the tokenizer's ``len(tok)``; the merge always gives
    it): every divergence compares the two heads over ids ``[0, vocab_size)`` only, so a student and a teacher whose
    heads are padded past the tokenizer, each its own way, still compare token for token.

    ``shard`` (one rank's contiguous rows of a sharded student, :mod:`tasks.training.sharded`): only those rows are learned
    from and ``teacher_hidden`` scores only them, while the normaliser and the reward baseline stay the whole batch's,
    so the loss is these rows' share of the whole batch's and the ranks' summed gradients are its gradient; the
    statistics cover these rows.

    ``normalize_groups`` (route -> its group: itself, or a spec label's value; ``opd.route_normalization``): each
    group's per-token signal is scaled by the batch's spread over its own (:func:`spread_scales`, clipped to
    ``[1 / normalize_clip, normalize_clip]``), measured on this batch's tokens with no gradient."""
    t0 = time.perf_counter()
    rollout, routes = batch.rollout, batch.routes
    mine = shard or slice(0, len(routes))
    route_weights = route_weights or {}
    student.train()
    # Position t predicts token t+1: drop the last position, and mask to positions whose next token is a response token.
    student_hidden_b_T_H = forward_hidden(student, rollout.sequences_B_T[mine],
                                          rollout.attention_mask_B_T[mine])[:, :-1]
    mask_B_T = rollout.loss_mask_B_T()
    total_tokens = max(int(mask_B_T.sum()), 1)
    seq_adv_B = None
    if reward_weight > 0 and batch.on_policy:
        seq_adv_B = sequence_advantages(batch.rewards_B, routes, reward_weight)
    parts: list[tuple[list[str], ObjectiveResult]] = []  # each group's rows' routes and its objective's result
    stats = StepStats(loss=0.0, tokens=total_tokens)
    # In teacher-name order, whatever order they scored in (the pool loads resident ones first): the loss sums the
    # same way every run, so a resumed merge stays bit-identical.
    for name, score in sorted(teacher_hidden.items()):
        rows, hidden_b_T_H, teacher_head, signal_b_T, _ = TeacherScore(*score)  # (a bare 3-tuple will do)
        if vocab_size is None:
            head_mismatch(student.get_output_embeddings(), teacher_head)
        by_objective: dict[Objective, list[int]] = {}
        for j, row in enumerate(rows):
            by_objective.setdefault(objectives[routes[row]], []).append(j)
        for obj, js in by_objective.items():
            if obj.policy_gradient and (batch.tokens is None or not batch.on_policy):
                raise ValueError(f"loss {obj.loss!r} needs on-policy rollouts with behaviour log-probs")
            idx = torch.tensor([rows[j] for j in js])
            tokens = None
            if batch.tokens is not None and (obj.policy_gradient or seq_adv_B is not None):
                tokens = TokenInputs(batch.tokens.targets_B_T[idx], batch.tokens.logq_behaviour_B_T[idx],
                                     batch.tokens.logq_old_B_T[idx])
            with autocast_for(student):  # the student's head under its compute dtype (the teacher's is not)
                res = chunked_objective(
                    student_hidden_b_T_H[idx - mine.start],
                    hidden_b_T_H[torch.tensor(js), :-1],
                    student.get_output_embeddings(),
                    teacher_head,
                    mask_B_T[idx] if signal_b_T is None else mask_B_T[idx] * signal_b_T[js, :-1].to(mask_B_T),
                    obj,
                    tokens=tokens,
                    seq_adv_B=None if seq_adv_B is None or tokens is None else seq_adv_B[idx],
                    weight_B=torch.tensor([route_weights.get(routes[i], 1.0) for i in idx.tolist()]),
                    chunk_size=chunk_size,
                    normalizer=total_tokens,
                    targets_B_T=rollout.sequences_B_T[idx, 1:],
                    vocab_size=vocab_size,
                )
            parts.append(([routes[row] for row in idx.tolist()], res))
            for k, row in enumerate(idx.tolist()):
                r = routes[row]
                stats.loss_sum[r] = stats.loss_sum.get(r, 0.0) + float(res.loss_sum_B[k])
                stats.kl_sum[r] = stats.kl_sum.get(r, 0.0) + float(res.reverse_kl_sum_B[k])
                stats.kl_tokens[r] = stats.kl_tokens.get(r, 0.0) + float(res.tokens_B[k])
                for d, value in zip(DIAGNOSTICS, res.diagnostics_B_4[k].tolist()):
                    getattr(stats, d)[r] = getattr(stats, d).get(r, 0.0) + value
    loss = student_hidden_b_T_H.new_zeros((), dtype=torch.float32)
    if normalize_groups is None:
        for _, res in parts:
            loss = loss + res.loss
    else:
        sums: dict[str, list[float]] = {}
        for rs, res in parts:
            for r, n, l, q in zip(rs, res.tokens_B.tolist(), res.loss_sum_B.tolist(), res.loss_sq_sum_B.tolist()):
                acc = sums.setdefault(normalize_groups[r], [0.0, 0.0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + n, acc[1] + l, acc[2] + q
        scales = spread_scales({g: tuple(v) for g, v in sums.items()}, normalize_clip)
        for rs, res in parts:
            loss = loss + (res.loss_B * res.loss_B.new_tensor([scales[normalize_groups[r]] for r in rs])).sum()
        stats.signal_scale = {r: scales[normalize_groups[r]] for r in dict.fromkeys(routes[mine])}
    for row in range(mine.start, mine.stop):
        r = routes[row]
        stats.sequences[r] = stats.sequences.get(r, 0) + 1
        stats.truncated[r] = stats.truncated.get(r, 0) + int(rollout.truncated_B[row])
        stats.reward_sum[r] = stats.reward_sum.get(r, 0.0) + float(batch.rewards_B[row])
        ids = rollout.sequences_B_T[row][rollout.response_mask_B_T[row].bool()].tolist()
        stats.repetition[r] = stats.repetition.get(r, 0.0) + repetition_rate(ids)
        stats.length[r] = stats.length.get(r, 0.0) + len(ids)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # also on a non-finite loss: with a sharded student the backward is collective
    grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # sharded: a DTensor
    # A non-finite loss or gradient is skipped whole: no optimizer step (the weights and Adam moments stay finite) and
    # no LR-schedule step; the caller counts it. The norm is global, so every rank of a sharded student agrees.
    stats.skipped = not (bool(torch.isfinite(loss)) and bool(torch.isfinite(grad_norm)))
    if stats.skipped:
        optimizer.zero_grad(set_to_none=True)
    else:
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    student.eval()
    stats.grad_norm = float(grad_norm)
    stats.loss = float(loss.detach())
    stats.seconds = {"update": time.perf_counter() - t0}
    return stats


def opd_step(
    student: PreTrainedModel,
    teachers: Mapping[str, Teacher],
    tok: PreTrainedTokenizerBase,
    prompts: list[str],
    routes: list[str],
    answers: list[str],
    groups: dict[str, list[int]],
    optimizer: torch.optim.Optimizer,
    scheduler,
    max_new_tokens: int | list[int],
    objective: Objective = Objective(),
    chunk_size: int = 16,
    grad_clip: float = 1.0,
    *,
    verifiers: Mapping[str, Verifier],
) -> StepStats:
    """One plain on-policy step with one objective for every route: sample, score, update (``routes[i]`` is row i's
    route, ``groups`` maps each teacher to the rows it scores; ``max_new_tokens`` one cap, or each row's)."""
    t0 = time.perf_counter()
    caps_B = list(max_new_tokens) if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
    batch = sample_batch(student, tok, prompts, routes, answers, caps_B, 0,
                         objective.sample_temperature, objective.temperature, with_logprobs=objective.policy_gradient,
                         verifiers=verifiers)
    t1 = time.perf_counter()
    hidden = score_with_teachers(teachers, groups, batch.rollout)
    t2 = time.perf_counter()
    stats = update_step(student, batch, hidden, {r: objective for r in set(routes)}, optimizer, scheduler,
                        chunk_size, grad_clip, vocab_size=len(tok))
    stats.seconds.update(generate=t1 - t0, teacher=t2 - t1)
    return stats
