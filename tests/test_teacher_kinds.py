"""The teacher interface (tasks/modeling/teacher.py): the merge's scoring and update read only ``Teacher.score``, whatever the
kind behind it; each kind gives the teacher's own log-probs; which kind a registered teacher is, is data."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from tasks.training.distill import Batch, score_with_teachers, update_step
from tasks.modeling.engines import ALL_VOCAB, ServedHead
from tasks.objectives.losses import Objective
from tasks.modeling.models import create_model
from tasks.modeling.rollout import forward_hidden, position_ids_from_mask, rollout_from_responses
from tasks.modeling.teacher import (
    CheckpointTeacher,
    ServedTeacher,
    TeacherBatch,
    TeacherScore,
    checkpoint_teachers,
    make_teachers,
    teacher_kind,
)
from tasks.world.tokenizer import build_char_tokenizer
from tasks.training.sft import make_optimizer

PROMPTS = ["reverse abcd |", "reverse qwe |", "reverse zz |"]
RESPONSES = ["dcba", "ewq", "zz"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def rollout(tok):
    ids = tok(RESPONSES, add_special_tokens=False)["input_ids"]
    return rollout_from_responses(tok, PROMPTS, [x + [tok.eos_token_id] for x in ids])


def tiny(tok, seed):
    return create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed).eval()


def hf_logprobs(model, rollout, rows):
    """``log_softmax`` of ``model``'s logits on ``rows``: what every kind must reproduce."""
    idx = torch.tensor(rows)
    mask = rollout.attention_mask_B_T[idx]
    with torch.no_grad():
        logits = model(input_ids=rollout.sequences_B_T[idx], attention_mask=mask,
                       position_ids=position_ids_from_mask(mask)).logits
    return torch.log_softmax(logits.float(), -1)


class ModelServer:
    """A stand-in for a vLLM engine or server (those are tested against the real engine in tests/test_vllm.py):
    prompt log-probs in vLLM's layout, computed from a transformers forward of the checkpoint."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def prompt_logprobs(self, sequences, k):
        self.calls.append(k)
        out = []
        for seq in sequences:
            with torch.no_grad():
                logp_T_V = torch.log_softmax(self.model(torch.tensor([seq])).logits[0].float(), -1)
            entries = [None]
            for i in range(1, len(seq)):
                row = logp_T_V[i - 1]
                top = row.topk(len(row) if k == ALL_VOCAB else k).indices.tolist()
                entries.append({t: float(row[t]) for t in dict.fromkeys([*top, seq[i]])})
            out.append(entries)
        return out


def response_positions(rollout, rows):
    """(row, position) of every hidden position that predicts a response token."""
    mask = rollout.loss_mask_B_T()
    return [(j, t) for j, r in enumerate(rows) for t in mask[r].nonzero().squeeze(-1).tolist()]


def test_a_checkpoint_teacher_scores_its_own_full_distribution(tok, rollout):
    teacher = tiny(tok, 1)
    rows = [0, 2]
    score = CheckpointTeacher("t", {"t": teacher}).score(TeacherBatch(rollout, rows))
    assert isinstance(score, TeacherScore) and score.rows == rows
    got = torch.log_softmax(score.head(score.features_b_T_F).float(), -1)
    want = hf_logprobs(teacher, rollout, rows)
    real = rollout.attention_mask_B_T[torch.tensor(rows)].bool()
    assert torch.allclose(got[real], want[real], atol=1e-5)


@pytest.mark.parametrize("k", [ALL_VOCAB, 3])
def test_a_served_teacher_gives_the_checkpoint_log_probs_it_was_asked_for(tok, rollout, k):
    """Whole vocabulary: every log-prob of the checkpoint at every response position. Top k: exact on the k
    served tokens (and the actual token), which is all top-k objectives read."""
    teacher = tiny(tok, 1)
    server = ModelServer(teacher)
    rows = [0, 1, 2]
    served = ServedTeacher("t", {"t": teacher}, {"t": server}, len(tok), kind="endpoint")
    score = served.score(TeacherBatch(rollout, rows, k))
    assert server.calls == [k] and isinstance(score.head, ServedHead)
    got = score.head(score.features_b_T_F)
    want = hf_logprobs(teacher, rollout, rows)
    for j, t in response_positions(rollout, rows):
        if k == ALL_VOCAB:
            assert torch.allclose(got[j, t], want[j, t], atol=1e-5)
        else:
            top = want[j, t].topk(k).indices
            assert torch.allclose(got[j, t, top], want[j, t, top], atol=1e-5)
            nxt = rollout.sequences_B_T[rows[j], t + 1]
            assert got[j, t, nxt] == pytest.approx(float(want[j, t, nxt]), abs=1e-5)


class UniformTeacher:
    """A kind the merge has never seen: every next token equally likely. Only ``score`` is implemented."""

    name, kind = "uniform", "checkpoint"

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def score(self, batch):
        B, T = len(batch.rows), batch.rollout.sequences_B_T.shape[1]
        # ServedHead with nothing served spreads the mass evenly over the vocabulary.
        return TeacherScore(list(batch.rows), torch.zeros(B, T, 3), ServedHead(self.vocab_size))


def test_the_update_reads_only_the_interface_reverse_kl_to_a_uniform_teacher(tok, rollout):
    """KL(student || uniform) = log V - H(student) at each position, summed over the response tokens: hand-computed
    from the student's own logits, against what scoring + update_step compute from a teacher kind they do not know."""
    student = tiny(tok, 5)
    rows = [0, 1, 2]
    routes = ["rev"] * 3
    with torch.no_grad():
        logp_B_T_V = hf_logprobs(student, rollout, rows)[:, :-1]
    mask = rollout.loss_mask_B_T().bool()
    entropy = -(logp_B_T_V.exp() * logp_B_T_V).sum(-1)
    want = float(((math.log(len(tok)) - entropy) * mask).sum())
    scores = score_with_teachers({"uniform": UniformTeacher(len(tok))}, {"uniform": rows}, rollout)
    batch = Batch(rollout, routes, ["dcba", "ewq", "zz"], True, 0, torch.zeros(3))
    opt, sched = make_optimizer(student, 0.0, 0.0, 0, 1)
    stats = update_step(student, batch, scores, {"rev": Objective(loss="reverse_kl")}, opt, sched)
    assert stats.loss_sum["rev"] == pytest.approx(want, rel=1e-4)
    assert stats.loss == pytest.approx(want / int(mask.sum()), rel=1e-4)


def test_score_with_teachers_passes_each_teacher_its_rows_and_logprobs_and_costs(tok, rollout):
    seen = {}

    class Spy(UniformTeacher):
        def score(self, batch):
            seen[self.name] = (batch.rows, batch.logprobs)
            return super().score(batch)

    a, b = Spy(len(tok)), Spy(len(tok))
    a.name, b.name = "a", "b"
    costs: dict[str, list[float]] = {}
    out = score_with_teachers({"a": a, "b": b}, {"a": [0, 2], "b": [1]}, rollout, {"a": 1}, costs)
    assert seen == {"a": ([0, 2], 1), "b": ([1], ALL_VOCAB)} and out["a"].rows == [0, 2]
    real = rollout.attention_mask_B_T.sum(-1)
    assert costs["a"][0] == float(real[0] + real[2]) and costs["b"][0] == float(real[1])


def test_checkpoint_teachers_load_nothing_until_scored(tok, rollout):
    from tasks.modeling.teacher_pool import TeacherPool

    loaded = []
    pool = TeacherPool(["t0", "t1"], lambda name: loaded.append(name) or tiny(tok, 7), max_resident=1)
    teachers = checkpoint_teachers(pool)
    assert set(teachers) == {"t0", "t1"} and loaded == []
    teachers["t1"].score(TeacherBatch(rollout, [0]))
    assert loaded == ["t1"]


def test_a_registered_teacher_kind_is_data():
    rec = SimpleNamespace(endpoint="")
    served = SimpleNamespace(endpoint="http://127.0.0.1:8000")
    assert teacher_kind(rec, "hf") == "checkpoint" and teacher_kind(served, "hf") == "checkpoint"
    assert teacher_kind(rec, "vllm") == "engine" and teacher_kind(served, "vllm") == "endpoint"
    models = {"a": None, "b": None}
    teachers = make_teachers({"a": "checkpoint", "b": "endpoint"}, models, {"b": None}, 10)
    assert type(teachers["a"]) is CheckpointTeacher and type(teachers["b"]) is ServedTeacher
    assert teachers["b"].kind == "endpoint"
    with pytest.raises(ValueError, match="unknown kind 'lora'"):
        make_teachers({"a": "lora"}, models)
    with pytest.raises(ValueError, match="no servers"):
        make_teachers({"b": "engine"}, models)


def test_forward_hidden_is_what_the_checkpoint_kind_returns(tok, rollout):
    teacher = tiny(tok, 1)
    score = CheckpointTeacher("t", {"t": teacher}).score(TeacherBatch(rollout, [1]))
    direct = forward_hidden(teacher, rollout.sequences_B_T[[1]], rollout.attention_mask_B_T[[1]])
    assert torch.equal(score.features_b_T_F, direct)
