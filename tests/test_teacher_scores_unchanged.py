"""The checkpoint teacher's scores and the update's loss on a fixed built-in-world batch are what they were before the
teacher interface changed (issue 30: TeacherBatch with row texts, TeacherScore with a signal mask, Rollout's loss
mask). tests/data/teacher_scores_before_issue30.json was written by this file's ``compute`` run at commit 0061959
(`python tests/test_teacher_scores_unchanged.py OUT` in a checkout of it). The engine and endpoint teachers are held
to the checkpoint teacher's scores by tests/test_vllm.py's parity tests, so they stay the same too."""

import json
import sys
from pathlib import Path

import pytest
import torch

from tasks.modeling.models import create_model
from tasks.modeling.rollout import rollout_from_responses
from tasks.modeling.teacher import checkpoint_teachers
from tasks.objectives.losses import Objective
from tasks.training.distill import Batch, score_with_teachers, update_step
from tasks.world.domains import Route, format_prompt, gold_completion
from tasks.world.tokenizer import build_char_tokenizer

BEFORE = Path(__file__).parent / "data" / "teacher_scores_before_issue30.json"
PROBLEMS = {"shift-low": ["1:ab", "2:xyz", "3:abc"], "rev-high": ["abcd", "qwe", "zz"], "sort-low": ["5203", "91", "777"]}


def compute():
    tok = build_char_tokenizer()
    student = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0).eval()
    teacher = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1).eval()
    routes = [r for r, ps in PROBLEMS.items() for _ in ps]
    prompts = [format_prompt(Route.parse(r), p) for r, ps in PROBLEMS.items() for p in ps]
    responses = [tok(gold_completion(Route.parse(r), p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                 for r, ps in PROBLEMS.items() for p in ps]
    responses[1] = responses[1][:2]  # one cut short (no EOS)
    ro = rollout_from_responses(tok, prompts, responses)
    groups = {"t": [0, 2, 4, 6, 8], "u": [1, 3, 5, 7]}
    scores = score_with_teachers(checkpoint_teachers({"t": teacher, "u": student}), groups, ro)
    out = {"logprobs": {}, "loss": {}}
    mask = ro.response_mask_B_T[:, 1:].bool()
    for name, score in sorted(scores.items()):
        rows, hidden, head = score[0], score[1], score[2]
        with torch.no_grad():
            logp = torch.log_softmax(head(hidden[:, :-1]).float(), -1)
        targets = ro.sequences_B_T[rows, 1:]
        got = logp.gather(-1, targets[..., None]).squeeze(-1)
        out["logprobs"][name] = [got[k][mask[r]].tolist() for k, r in enumerate(rows)]
    for loss in ("reverse_kl", "forward_kl", "jsd", "skew_kl"):
        model = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        batch = Batch(ro, routes, ["x"] * len(routes), True, 0, torch.zeros(len(routes)))
        st = update_step(model, batch, scores, {r: Objective(loss=loss) for r in PROBLEMS}, opt, vocab_size=len(tok))
        out["loss"][loss] = {"loss": st.loss, "kl_sum": st.kl_sum, "tokens": st.tokens}
    return out


def test_checkpoint_teacher_scores_and_losses_are_unchanged():
    before, now = json.loads(BEFORE.read_text()), compute()
    assert sorted(now["logprobs"]) == sorted(before["logprobs"]) == ["t", "u"]
    for name, rows in before["logprobs"].items():
        assert [len(r) for r in now["logprobs"][name]] == [len(r) for r in rows]  # the same positions scored
        for got, want in zip(now["logprobs"][name], rows):
            assert got == pytest.approx(want, abs=1e-6)
    for loss, want in before["loss"].items():
        got = now["loss"][loss]
        assert got["tokens"] == want["tokens"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["kl_sum"] == pytest.approx(want["kl_sum"], rel=1e-6)


if __name__ == "__main__":
    BEFORE.parent.mkdir(parents=True, exist_ok=True)
    Path(sys.argv[1]).write_text(json.dumps(compute(), indent=1))
