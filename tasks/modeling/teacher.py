"""The teacher interface the merge calls, and the kinds behind it.

A merge asks each teacher one thing: ``teacher.score(batch)``, the teacher's next-token distribution at every
position of the student's exact sequences (:class:`TeacherBatch`: rows of a rollout, and how much of the
distribution the rows' objectives read). The answer (:class:`TeacherScore`) is lazy: per-position features and a head
that turns them into log-prob logits, so the objective applies the head chunk by chunk instead of holding ``[B, T, V]``
log-probs. Besides scoring, a teacher samples completions (off-policy batches: :meth:`Teacher.sample`) and is
evaluated on held-out prompts (:attr:`Teacher.model`, the checkpoint behind it).

Kinds (:data:`KINDS`; which one a registered teacher is, is data: :func:`teacher_kind` reads its record and the
merge's ``opd.teacher_backend``):

- ``checkpoint``: a local transformers checkpoint; one forward over the rows gives its final hidden states, the head
  is its output embedding (the whole vocabulary, exactly).
- ``engine``: the same checkpoint served by an in-process vLLM engine; ``endpoint``: a vLLM OpenAI-compatible server
  (the record's ``endpoint``). Both return prompt log-probs of the rows' real tokens, as many per position as the
  batch asks (``logprobs``: -1 the whole vocabulary, ``k`` the top k; the actual token always), packed for
  :class:`tasks.modeling.engines.ServedHead`.

A teacher's kind is two things, both stored in its registry record: its *transport* (``checkpoint``, ``engine``,
``endpoint``: how its numbers are computed) and its *wrapper* (:data:`tasks.modeling.routing.WRAPPERS`): ``plain`` reads the student's
tokens as they are; ``aligned`` (:class:`tasks.modeling.aligned.AlignedTeacher`) is a model of another tokenizer that
renders each row through its own chat template from the row's :class:`tasks.specs.render.RowText` and gives a signal
on the student's tokens with a mask of the positions it could read; ``context``
(:class:`tasks.modeling.aligned.ContextTeacher`) reads the same way with the row's privileged ``context`` column
written into its prompt, which the student never sees; ``guided`` scores as ``plain`` does, and its route's on-policy
rollouts start from a prefix of its own solution that the student continues (guided OPD: the batch source
:class:`tasks.training.guided.GuidedPrefixes`, its schedule in the record). Combined and extrapolated teachers wrap scores
per route (the spec's ``combine``, ``opd.reward_scale``).

Writing a teacher: implement :class:`Teacher`'s ``score`` (log-prob logits over the student's vocabulary at each
position of ``batch.rows``, lazily through a head, and optionally ``signal_b_T``, the positions it has a signal for),
``sample`` (its own completions of rows, returned in the student's tokens) and either ``model`` (a checkpoint that
reads the student's tokens, evaluated as the student is) or ``answer`` (greedy texts in its own terms).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tasks.modeling.engines import ALL_VOCAB, ServedHead, TeacherServer, pack_prompt_logprobs, real_tokens
from tasks.modeling.rollout import Rollout, cap_responses, eos_ids, forward_hidden, generate
from tasks.modeling.routing import TeacherRecord, reads_own_text
from tasks.specs.render import RowText

Kind = Literal["checkpoint", "engine", "endpoint"]
KINDS: tuple[Kind, ...] = ("checkpoint", "engine", "endpoint")


@dataclass(frozen=True)
class TeacherBatch:
    """What a teacher scores: rows ``rows`` of the student's ``rollout`` (its exact tokens, ``[B, T]``), and how much
    of the distribution their objectives read: ``logprobs`` -1 the whole vocabulary, ``k`` the top k, 1 the sampled
    token alone (a local checkpoint always gives the whole vocabulary)."""

    rollout: Rollout
    rows: list[int]
    logprobs: int = ALL_VOCAB
    tok: PreTrainedTokenizerBase | None = None  # the student's tokenizer
    texts: Sequence[RowText] | None = None  # per row of the rollout (all of them): what its route rendered


class TeacherScore(NamedTuple):
    """A teacher's scores of ``rows``: ``head(features_b_T_F)`` are log-prob logits ``[b, T, V]`` (up to a constant per
    position), position t predicting token t+1 of the row. ``signal_b_T`` (None: every position): 1 where the teacher
    has a signal, 0 where it has none (the update masks those out of the loss). ``tokens``: the teacher's own tokens
    it read (0: the rows' own, as a teacher of the student's tokenizer reads them)."""

    rows: list[int]
    features_b_T_F: torch.Tensor
    head: torch.nn.Module
    signal_b_T: torch.Tensor | None = None
    tokens: int = 0


class Teacher(Protocol):
    """What the merge calls on a teacher."""

    name: str
    kind: Kind

    def score(self, batch: TeacherBatch) -> TeacherScore:
        """The teacher's next-token log-probs on ``batch``'s rows, in one pass."""

    def sample(self, tok: PreTrainedTokenizerBase, rows: Sequence[RowText], caps: list[int], temperature: float,
               generator: torch.Generator | None = None) -> Rollout:
        """One completion per row at ``temperature`` (each cut at its cap): the teacher's own samples, as a rollout
        in the student's tokenizer ``tok`` over the rows' student prompts."""

    @property
    def model(self) -> PreTrainedModel | None:
        """The checkpoint behind the teacher when it reads the student's tokens as they are (held-out evaluation,
        parity checks of served kinds); None for a teacher that reads its own text (it answers with ``answer``)."""


class CheckpointTeacher:
    """A teacher that is a local transformers checkpoint, taken from ``models`` (a name -> model mapping, e.g. a
    :class:`tasks.modeling.teacher_pool.TeacherPool` that loads it on first use and may evict it between steps)."""

    kind: Kind = "checkpoint"

    def __init__(self, name: str, models: Mapping[str, PreTrainedModel]):
        self.name, self.models = name, models

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, kind={self.kind!r})"

    @property
    def model(self) -> PreTrainedModel:
        return self.models[self.name]

    def score(self, batch: TeacherBatch) -> TeacherScore:
        model = self.model
        idx = torch.tensor(batch.rows)
        with torch.no_grad():
            hidden_b_T_H = forward_hidden(model, batch.rollout.sequences_B_T[idx], batch.rollout.attention_mask_B_T[idx])
        # The head, not the model: a pool may evict the model before the update reads these scores.
        return TeacherScore(list(batch.rows), hidden_b_T_H, model.get_output_embeddings())

    def sample(self, tok: PreTrainedTokenizerBase, rows: Sequence[RowText], caps: list[int], temperature: float,
               generator: torch.Generator | None = None) -> Rollout:
        model = self.model
        rollout = generate(model, tok, [r.prompt for r in rows], max(caps), temperature=temperature,
                           generator=generator)
        return cap_responses(rollout, caps, eos_ids(tok, model))


class ServedTeacher(CheckpointTeacher):
    """A teacher whose scores come from a vLLM engine or server (``servers[name]``, see :mod:`tasks.modeling.engines`); its
    checkpoint (``models[name]``) still samples and is evaluated. ``vocab_size``: the student's vocabulary, which the
    packed scores are spread over."""

    def __init__(self, name: str, models: Mapping[str, PreTrainedModel], servers: Mapping[str, TeacherServer],
                 vocab_size: int, kind: Kind = "engine"):
        super().__init__(name, models)
        self.servers, self.vocab_size, self.kind = servers, vocab_size, kind

    def score(self, batch: TeacherBatch) -> TeacherScore:
        served = self.servers[self.name].prompt_logprobs([real_tokens(batch.rollout, r) for r in batch.rows],
                                                         batch.logprobs)
        return TeacherScore(list(batch.rows), pack_prompt_logprobs(served, batch.rollout, batch.rows, self.vocab_size),
                            ServedHead(self.vocab_size))


def teacher_kind(record: TeacherRecord, backend: str) -> Kind:
    """The transport a registered teacher has in a merge whose ``opd.teacher_backend`` is ``backend``: the record's
    own ``transport`` when it names one (an aligned teacher is always its checkpoint), else its checkpoint (``hf``),
    else its ``endpoint`` when the record has one, else an in-process engine on its checkpoint."""
    transport = getattr(record, "transport", "auto")
    if transport != "auto":
        return transport
    if backend == "hf" or reads_own_text(record):
        return "checkpoint"
    return "endpoint" if record.endpoint else "engine"


def make_teachers(kinds: Mapping[str, Kind], models: Mapping[str, PreTrainedModel],
                  servers: Mapping[str, TeacherServer] | None = None, vocab_size: int = 0,
                  aligned: Mapping[str, Teacher] | None = None) -> dict[str, Teacher]:
    """One teacher object per name of ``kinds`` (name -> kind); served kinds need ``servers`` and ``vocab_size``.
    ``aligned``: teachers already wrapped (name -> an :class:`tasks.modeling.aligned.AlignedTeacher`), taken as
    they are."""
    out: dict[str, Teacher] = {}
    for name, kind in kinds.items():
        if kind not in KINDS:
            raise ValueError(f"teacher {name!r}: unknown kind {kind!r}; kinds: {list(KINDS)}")
        if aligned and name in aligned:
            if kind != "checkpoint":
                raise ValueError(f"teacher {name!r} is aligned (another tokenizer) and needs its checkpoint; "
                                 f"transport {kind!r} is not supported for it (expected transport checkpoint)")
            out[name] = aligned[name]
        elif kind == "checkpoint":
            out[name] = CheckpointTeacher(name, models)
        elif servers is None:
            raise ValueError(f"teacher {name!r} is of kind {kind!r} but no servers were given")
        else:
            out[name] = ServedTeacher(name, models, servers, vocab_size, kind)
    return out


def checkpoint_teachers(models: Mapping[str, PreTrainedModel]) -> dict[str, Teacher]:
    """``models`` (name -> checkpoint, or a pool) as checkpoint teachers, nothing loaded yet."""
    return make_teachers({name: "checkpoint" for name in models}, models)
