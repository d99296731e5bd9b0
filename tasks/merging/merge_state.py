"""The merge's state as one object: everything that decides the rest of a merge, saved whole into a checkpoint
(:class:`tasks.training.checkpoint.MergeCheckpoints`) and restored whole, so that a merge resumed from it ends as a merge never
stopped would (on CPU with the transformers backends: the same weights and metrics, bit for bit).

The loop (:class:`tasks.merging.merge.MergeLoop`) keeps its counters and measurements in a :class:`MergeState` as it runs;
:meth:`MergeLoop.capture` copies into it what lives in the components (the student's weights, the optimizer and LR
schedule, the RNGs, the batch generated ahead, the prompt sampler's position, the teacher pool's residents, the cached
teacher samples) just before it is saved, and the loop gives those back to the components when it resumes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from tasks.training.checkpoint import Checkpoint, batch_from_state, batch_state
from tasks.training.distill import Batch
from tasks.evaluation.evaluate import GateResult, RouteScore

# Fields written to trainer.pt (tensors and optimizer state); student.safetensors holds ``weights``; the rest is JSON.
TRAINER_FIELDS = ("optimizer", "scheduler", "torch_rng", "pending", "rollout_rng")


def _generated() -> dict[str, int]:
    return {"student_tokens": 0, "teacher_sampled_tokens": 0}


def _teachers() -> dict[str, Any]:
    return {"resident": [], "loads": 0, "evictions": 0}


@dataclass
class MergeState:
    """One merge's state. Position: ``step`` (optimizer steps attempted over all stages, MLflow's x-axis),
    ``version`` (steps taken: the student's version), the stage it is in (``stage_no``, ``stage_step``), the gates'
    results and skipped steps. Measurements the rest of the merge reports: the metric window since the last
    evaluation, teacher and base accuracies, the latest scores, costs. Randomness and data position: the prompt
    sampler's, python's, torch's and the rollout thread's RNG states, the vLLM engine's request count (it seeds each
    request), the batch generated ahead, the teacher-sample cache and the teacher pool's residents. The student:
    its weights, optimizer and LR-schedule states (set only in a state being saved or just loaded)."""

    run_id: str
    step: int = 0
    version: int = 0
    stage_no: int = 0
    stage_step: int = 0
    bad_steps: int = 0
    gates: list[GateResult] = field(default_factory=list)
    window: dict[str, dict[str, float]] = field(default_factory=dict)
    teacher_acc: dict[str, float] = field(default_factory=dict)
    teacher_exact: dict[str, float | None] = field(default_factory=dict)  # the best teacher's exact-format figure
    # opd.route_sampling retention: the teachers' accuracy on the held-out slice and each route's smoothed need.
    slice_teacher_acc: dict[str, float] = field(default_factory=dict)
    route_need: dict[str, float] = field(default_factory=dict)
    recovery: dict[str, dict[str, float]] = field(default_factory=dict)  # "base"/"teacher" -> route -> share
    base_scores: dict[str, RouteScore] = field(default_factory=dict)
    scores: dict[str, RouteScore] = field(default_factory=dict)
    teacher_costs: dict[str, list[float]] = field(default_factory=dict)  # teacher -> [tokens scored, seconds]
    generated: dict[str, int] = field(default_factory=_generated)  # response tokens sampled, whole merge
    train_seconds: float = 0.0  # generation + teacher scoring + updates, evaluations left out, whole merge
    sampler_rng: tuple | None = None
    python_rng: tuple | None = None
    engine_requests: int = 0
    offpolicy: dict[str, dict[str, list[int]]] = field(default_factory=dict)  # teacher -> prompt -> sample ids
    teachers: dict[str, Any] = field(default_factory=_teachers)  # the pool's residents (LRU order), loads, evictions
    torch_rng: torch.Tensor | None = None
    rollout_rng: torch.Tensor | None = None
    pending: Batch | None = None
    optimizer: dict | None = None
    scheduler: dict | None = None
    weights: dict[str, torch.Tensor] | None = None

    def files(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """``(weights, trainer, state)`` as :meth:`tasks.training.checkpoint.MergeCheckpoints.save` writes them."""
        trainer = {k: getattr(self, k) for k in TRAINER_FIELDS}
        trainer["pending"] = batch_state(self.pending)
        state = {f.name: getattr(self, f.name) for f in fields(self)
                 if f.name not in TRAINER_FIELDS and f.name != "weights"}
        state["gates"] = [asdict(g) for g in self.gates]
        state["base_scores"] = {r: asdict(s) for r, s in self.base_scores.items()}
        state["scores"] = {r: asdict(s) for r, s in self.scores.items()}
        return self.weights, trainer, state

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> MergeState:
        """The state a committed checkpoint holds (fields a checkpoint older than them lacks keep their defaults)."""
        st, tr = dict(ckpt.state), ckpt.trainer
        st.pop("format", None)
        known = {f.name for f in fields(cls)}
        unknown = set(st) - known
        if unknown:
            raise ValueError(f"{ckpt.path}: state.json has fields this code does not know: {sorted(unknown)}")
        st["gates"] = [GateResult(**g) for g in st.get("gates", [])]
        st["base_scores"] = {r: RouteScore(**s) for r, s in st.get("base_scores", {}).items()}
        st["scores"] = {r: RouteScore(**s) for r, s in st.get("scores", {}).items()}
        for key in ("sampler_rng", "python_rng"):
            if st.get(key) is not None:
                st[key] = rng_state(st[key])
        return cls(**st, **{k: tr.get(k) for k in TRAINER_FIELDS if k != "pending"},
                   pending=batch_from_state(tr.get("pending")), weights=ckpt.weights)

    def release_tensors(self) -> None:
        """Drop the weights, optimizer and trainer tensors once the components hold them again (or saved them)."""
        self.weights = self.optimizer = self.scheduler = self.torch_rng = self.rollout_rng = self.pending = None


def rng_state(state: list | tuple) -> tuple:
    """A ``random.Random`` state back from JSON (lists where it had tuples)."""
    return state[0], tuple(state[1]), state[2]
