"""Guided OPD: on hard routes the student continues from the start of its teacher's own solution, and the start is
withdrawn over the on-policy stage until the student generates alone.

A route whose teacher is registered with ``wrapper: guided`` (its record's ``guide_fraction`` and ``guide_steps``)
gets, in each on-policy batch, a prefix of that teacher's own sample of the prompt (sampled once per prompt and
cached, as the off-policy teacher completions are: :class:`tasks.training.distill.OffPolicyData`) written at the
head of the response before the student samples the rest. The prefix tokens are ``external``
(:class:`tasks.modeling.rollout.Span`): the teacher scores the whole sequence, the loss covers only what the student
wrote. The prefix is ``fraction(step)`` of the sample's tokens before its end token, ``fraction(step) =
guide_fraction * max(0, 1 - step / guide_steps)`` on the on-policy stage's step, so after ``guide_steps`` steps
every rollout is the student's own. Pure functions here; the batch source is :class:`GuidedPrefixes`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GuideSchedule:
    """How much of a teacher's solution a guided route's rollouts start from, by the on-policy stage's step."""

    fraction: float  # share of the teacher's sample given at step 0, in (0, 1]
    steps: int  # steps over which it is withdrawn linearly to none (>= 1)

    def __post_init__(self):
        if not 0 < self.fraction <= 1 or self.steps < 1:
            raise ValueError(f"a guide schedule needs 0 < fraction <= 1 and steps >= 1, got {self.fraction}, "
                             f"{self.steps}")

    def at(self, step: int) -> float:
        """The share of the teacher's sample given at stage step ``step`` (0 from ``steps`` on)."""
        return self.fraction * max(0.0, 1.0 - step / self.steps)


def prefix_length(sample: Sequence[int], fraction: float, eos: Sequence[int]) -> int:
    """How many tokens of a teacher's ``sample`` a rollout starts from: ``floor(fraction * n)`` of its ``n`` tokens
    before its end token (any id of ``eos``; the student always writes at least the end)."""
    n = len(sample) - (1 if sample and sample[-1] in eos else 0)
    return min(n, math.floor(fraction * n + 1e-9))


class GuidedPrefixes:
    """The batch source of guided OPD: for each row of a guided route (``schedules``: route -> its schedule), the
    prefix of its teacher's own sample the student continues from at the current step.

    ``samples(texts, caps_B, generator) -> (token-id lists, sampled now, their tokens)``: each row's teacher sample
    (:meth:`tasks.training.distill.OffPolicyData.teacher_samples`: cached teacher completions). ``origin``: the student's optimizer step count when the on-policy stage began, so that a
    batch made at student version ``v`` is at stage step ``v - origin``."""

    def __init__(self, schedules: Mapping[str, GuideSchedule], samples, eos: Sequence[int], origin: int = 0):
        self.schedules, self.samples, self.eos, self.origin = dict(schedules), samples, tuple(eos), origin

    def fractions(self, version: int) -> dict[str, float]:
        """Each guided route's share at student version ``version``."""
        return {r: s.at(version - self.origin) for r, s in self.schedules.items()}

    def active(self, routes: Sequence[str], version: int) -> bool:
        fractions = self.fractions(version)
        return any(fractions.get(r, 0.0) > 0 for r in routes)

    def prefixes(self, texts, caps_B: list[int], version: int,
                 generator: torch.Generator | None = None) -> tuple[list[list[int]], int]:
        """Each row's prefix (empty for rows of other routes and once a route's schedule has run out), never so long
        that the row's cap leaves the student no token of its own; and the tokens teachers sampled for them now
        (samples not yet cached)."""
        fractions = self.fractions(version)
        rows = [b for b, t in enumerate(texts) if fractions.get(t.route, 0.0) > 0]
        out: list[list[int]] = [[] for _ in texts]
        if not rows:
            return out, 0
        samples, _, tokens = self.samples([texts[b] for b in rows], [caps_B[b] for b in rows], generator)
        for b, sample in zip(rows, samples):
            k = min(prefix_length(sample, fractions[texts[b].route], self.eos), caps_B[b] - 1)
            out[b] = list(sample[:max(0, k)])
        return out, tokens
