"""The student update on several processes (FSDP2 over gloo, 2 CPU processes) against one process on the same global
batch: the update step alone, then a whole quick merge."""

import re

import pytest
import torch

from tasks.training.distill import sample_batch, score_with_teachers, update_step
from tasks.modeling.teacher import checkpoint_teachers
from tasks.objectives.losses import Objective
from tasks.modeling.models import create_model
from tasks.training.sharded import full_state_dict, rank, rows_of, run_ranks, shard_groups, shard_student, sum_stats
from tasks.world.tokenizer import build_char_tokenizer
from tasks.training.sft import make_optimizer
from tasks.world.domains import Route, domain_of, format_prompt
from tasks.world.spec import world_verifiers

PROBLEMS = {"rev-high": ["abcd", "qwe", "zz", "xyzw", "ab"], "sort-low": ["5203", "91", "777", "8412"]}


def test_rows_of_splits_contiguously_and_evenly():
    assert [rows_of(7, r, 3) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert [rows_of(4, r, 2) for r in range(2)] == [slice(0, 2), slice(2, 4)]
    assert shard_groups({"a": [0, 2, 5], "b": [1, 3]}, slice(2, 4)) == {"a": [2], "b": [3]}


def test_unsupported_combinations_fail_at_config_time():
    from pydantic import ValidationError

    from tasks.config import OPDConfig

    assert OPDConfig(nproc=2).nproc == 2
    for bad, match in [({"overlap_generation": True}, "overlap_generation"), ({"batch_size": 1}, "every process"),
                       ({"dist_backend": "nccl"}, "runs its models on CPU")]:
        with pytest.raises(ValidationError, match=match):
            OPDConfig(nproc=2, **bad)


def _fail_on(failing: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == failing:
        raise KeyError(f"rank {failing} broke")
    dist.barrier()  # the others wait for the rank that failed


def _outcome(fn, *args) -> BaseException | None:
    """``fn(*args)`` in a daemon thread: its exception (None if it returned), or a failure if it does not end within
    10 minutes (a bound on the wait, so that a hang fails the test instead of hanging it; no timing is asserted)."""
    import threading

    out: list = []

    def call():
        try:
            fn(*args)
            out.append(None)
        except BaseException as e:  # handed to the test thread, which asserts on it
            out.append(e)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=600)
    assert out, f"{fn.__name__}{args} still running after 600 s: it hangs"
    return out[0]


def test_a_failing_rank_fails_the_call_with_its_error_instead_of_hanging():
    err = _outcome(run_ranks, _fail_on, 2, "gloo", 1)
    assert isinstance(err, RuntimeError), repr(err)
    assert re.search(r"rank 1 of the sharded merge failed:[\s\S]*rank 1 broke", str(err)), str(err)
    err = _outcome(run_ranks, _fail_on, 2, "gloo", 0)
    assert isinstance(err, KeyError) and "rank 0 broke" in str(err), repr(err)  # rank 0's own error comes as it is


def _train(steps: int, sharded: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``steps`` update steps of a tiny student on its own rollouts (sampled, with behaviour log-probs and a reward
    baseline, two routes with their own objective and weight, gradient clipping active); returns the student's full
    weights and the whole batch's loss per step (rank 0's when sharded)."""
    tok = build_char_tokenizer()
    student = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    teacher = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1).eval()
    if sharded:
        shard_student(student)
    optimizer, scheduler = make_optimizer(student, 3e-2, 0.0, 0, steps)
    routes = [r for r, ps in PROBLEMS.items() for _ in ps]
    problems = [p for ps in PROBLEMS.values() for p in ps]
    prompts = [format_prompt(Route.parse(r), p) for r, p in zip(routes, problems)]
    answers = [domain_of(Route.parse(r)).answer(p) for r, p in zip(routes, problems)]
    objectives = {"rev-high": Objective(loss="reverse_kl"), "sort-low": Objective(loss="forward_kl")}
    rows = rows_of(len(routes)) if sharded else None
    torch.manual_seed(0)
    losses = []
    for step in range(steps):
        batch = sample_batch(student, tok, prompts, routes, answers, [6] * len(routes), step, with_logprobs=True,
                             verifiers=world_verifiers(list(PROBLEMS)))
        groups = {"t": list(range(len(routes)))}
        hidden = score_with_teachers(checkpoint_teachers({"t": teacher}), shard_groups(groups, rows) if sharded else groups, batch.rollout)
        st = update_step(student, batch, hidden, objectives, optimizer, scheduler, chunk_size=4, grad_clip=0.05,
                         route_weights={"sort-low": 2.0}, reward_weight=0.5, shard=rows)
        losses.append((sum_stats(st, list(PROBLEMS)) if sharded else st).loss)
    weights = full_state_dict(student) if sharded else student.state_dict()
    return ({k: v.detach().clone() for k, v in weights.items()} if rank() == 0 else {}), losses


def test_update_step_on_two_gloo_ranks_equals_one_process():
    one, one_losses = _train(3, sharded=False)
    two, two_losses = run_ranks(_train, 2, "gloo", 3, True)
    assert sorted(two) == sorted(one)
    diff = max((two[k] - one[k]).abs().max().item() for k in one)
    moved = min((one[k] - create_model(build_char_tokenizer(), hidden_size=32, num_layers=2, num_heads=2,
                                       intermediate_size=64, seed=0).state_dict()[k]).abs().max().item()
                for k in one if k.endswith("weight"))
    print(f"max abs weight diff 1 rank vs 2 ranks after 3 steps: {diff:.2e} (smallest weight change {moved:.2e})")
    assert moved > 1e-3
    assert diff < 1e-5
    assert two_losses == pytest.approx(one_losses, abs=1e-5)


@pytest.fixture(scope="module")
def merged_twice(short_pipeline):
    """From the short quick-profile pipeline's base and teachers (tests/conftest.py), the same merge twice, back to
    back: the student update on 1 process, then on 2 gloo processes. (Not the pipeline's own merge: other tests of the
    session may re-register a teacher between the two, and both runs must see the same registry.)"""
    from flows.merge import merge

    cfg, pipe = short_pipeline
    mcfg = cfg.merge(pipe["base_uri"], pipe["teachers"])
    one = merge(mcfg.model_copy(update={"opd": mcfg.opd.model_copy(update={"resume": False})}))
    two = merge(mcfg.model_copy(update={"opd": mcfg.opd.model_copy(update={"nproc": 2})}))
    return cfg, {**one, "base_uri": pipe["base_uri"]}, two


@pytest.mark.e2e
def test_quick_merge_on_two_gloo_ranks_equals_one_process(merged_twice):
    from mlflow.tracking import MlflowClient
    from safetensors.torch import load_file

    from tasks.tracking.runs import tracking_uri

    cfg, one, two = merged_twice
    w1, w2 = (load_file(f"{r['student_uri']}/model.safetensors") for r in (one, two))
    assert sorted(w1) == sorted(w2)
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    base = load_file(f"{one['base_uri']}/model.safetensors")
    moved = max((w1[k] - base[k]).abs().max().item() for k in w1)
    print(f"quick merge, {cfg.opd.steps} steps: max abs weight diff 1 rank vs 2 ranks {diff:.2e} "
          f"(max change {moved:.2e})")
    assert moved > 1e-3
    assert diff < 1e-4
    assert two["rows"] == one["rows"]
    # Rank 0 alone logged, the whole batch's statistics: the same curves as one process.
    client = MlflowClient(tracking_uri())
    assert client.get_run(two["run_id"]).data.params["opd.nproc"] == "2"
    for key in ("train/loss", "rollout/generated", f"divergence/{cfg.world.routes[0]}"):
        h1, h2 = (client.get_metric_history(r["run_id"], key) for r in (one, two))
        assert [m.step for m in h2] == [m.step for m in h1], key
        assert [m.value for m in h2] == pytest.approx([m.value for m in h1], rel=1e-4, abs=1e-6), key
