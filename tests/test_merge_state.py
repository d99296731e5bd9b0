"""The merge's state is one object (tasks/merging/merge_state.py): saved whole into a checkpoint and read back whole, every
field equal; a checkpoint with a field this code does not know is refused, not half read. (That a merge resumed from it
ends bit-identical to an unbroken one is tests/test_resume.py's.)"""

from __future__ import annotations

import json
import random
from dataclasses import fields

import pytest
import torch

from tasks.training.checkpoint import MergeCheckpoints
from tasks.training.distill import Batch
from tasks.evaluation.evaluate import GateResult, RouteScore
from tasks.merging.merge_state import TRAINER_FIELDS, MergeState
from tasks.modeling.rollout import Rollout


def a_state() -> MergeState:
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    rollout = Rollout(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]]),
                      torch.tensor([False]), 1)
    rng = random.Random(9)
    rng.random()
    return MergeState(
        run_id="abc", step=12, version=11, stage_no=1, stage_step=4, bad_steps=1,
        gates=[GateResult(0.5, {"r": 1.0}, {"r": 0.75})],
        window={"r": {"div": 1.5, "tok": 3.0}}, teacher_acc={"r": 0.9},
        base_scores={"r": RouteScore(0.1, 4.0, 0.0, 10)}, scores={"r": RouteScore(0.8, 5.0, 0.1, 10)},
        teacher_costs={"t": [30.0, 0.2]}, generated={"student_tokens": 40, "teacher_sampled_tokens": 8},
        train_seconds=3.5, sampler_rng=rng.getstate(), python_rng=random.getstate(), engine_requests=7,
        offpolicy={"t": {"p": [1, 2, 3]}}, teachers={"resident": ["t"], "loads": 2, "evictions": 1},
        torch_rng=torch.get_rng_state(), rollout_rng=gen.get_state(),
        pending=Batch(rollout, ["r"], ["x"], True, 11, torch.tensor([1.0])),
        optimizer=opt.state_dict(), scheduler=sched.state_dict(), weights=model.state_dict())


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, Batch):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(Batch))
    if isinstance(a, Rollout):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in fields(Rollout))
    return a == b


def test_a_saved_state_reads_back_whole(tmp_path):
    state = a_state()
    ckpts = MergeCheckpoints(tmp_path)
    path = ckpts.save(*state.files())
    back = MergeState.from_checkpoint(ckpts.load(path))
    for f in fields(MergeState):
        assert same(getattr(back, f.name), getattr(state, f.name)), f.name
    # The RNG states are usable as they were: the next draws agree.
    r1, r2 = random.Random(), random.Random()
    r1.setstate(state.sampler_rng)
    r2.setstate(back.sampler_rng)
    assert r1.random() == r2.random()


def test_the_checkpoint_files_split_tensors_from_json(tmp_path):
    weights, trainer, state = a_state().files()
    assert set(trainer) == set(TRAINER_FIELDS) and "weights" not in state and not set(TRAINER_FIELDS) & set(state)
    json.dumps(state)  # the JSON part is plain data


def test_a_checkpoint_with_an_unknown_field_is_refused(tmp_path):
    ckpts = MergeCheckpoints(tmp_path)
    weights, trainer, state = a_state().files()
    path = ckpts.save(weights, trainer, {**state, "sampling_weights": {"r": 2.0}})
    with pytest.raises(ValueError, match="sampling_weights"):
        MergeState.from_checkpoint(ckpts.load(path))


def test_release_drops_the_tensors_but_keeps_the_position():
    state = a_state()
    state.release_tensors()
    assert state.weights is None and state.optimizer is None and state.pending is None and state.torch_rng is None
    assert state.step == 12 and state.offpolicy == {"t": {"p": [1, 2, 3]}}
