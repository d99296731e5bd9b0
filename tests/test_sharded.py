"""The student update on several processes (FSDP2 over gloo, 2 CPU processes started by torchrun) against one process
on the same global batch: the update step alone (with and without ExOPD's extrapolated target), then a whole quick
merge; and the launcher itself (tasks/training/launch.py): its torchrun command, and a rank that fails."""

import os
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.training.distill import extrapolate_scores, sample_batch, score_with_teachers, update_step
from tasks.modeling.teacher import checkpoint_teachers
from tasks.objectives.losses import Objective
from tasks.modeling.models import create_model
from tasks.modeling.device import resolve_backend
from tasks.training.launch import launch, node_command, torchrun_args
from tasks.training.sharded import (full_state_dict, rank, rows_of, shard_groups, shard_student,
                                    sum_stats)
from tasks.world.tokenizer import build_char_tokenizer
from tasks.training.sft import make_optimizer
from tasks.world.domains import Route, domain_of, format_prompt
from tasks.world.spec import world_verifiers

pytestmark = pytest.mark.slow

PROBLEMS = {"rev-high": ["abcd", "qwe", "zz", "xyzw", "ab"], "sort-low": ["5203", "91", "777", "8412"]}


def test_rows_of_splits_contiguously_and_evenly():
    assert [rows_of(7, r, 3) for r in range(3)] == [slice(0, 3), slice(3, 5), slice(5, 7)]
    assert [rows_of(4, r, 2) for r in range(2)] == [slice(0, 2), slice(2, 4)]
    assert shard_groups({"a": [0, 2, 5], "b": [1, 3]}, slice(2, 4)) == {"a": [2], "b": [3]}


def test_unsupported_combinations_fail_at_config_time_with_their_reason():
    from pydantic import ValidationError

    from tasks.config import OPDConfig

    assert OPDConfig(nproc=2).nproc == 2
    assert OPDConfig(nproc=2, reward_scale=1.5).reward_scale == 1.5  # ExOPD shards (see the update test below)
    assert OPDConfig(nproc=4, nnodes=2, rdzv_endpoint="head.example:29400").nnodes == 2
    for bad, match in [({"overlap_generation": True}, "overlap_generation: the background generation .* gathered"),
                       ({"rollout_backend": "vllm"}, "rollout_backend 'vllm': the engine needs the full weights "
                                                     "gathered from every process .* broadcast"),
                       ({"batch_size": 1}, "every process"),
                       ({"dist_backend": "nccl", "device": "cpu"}, "nccl' needs the student on CUDA GPUs.*'cpu'"),
                       ({"nproc": 3, "nnodes": 2, "rdzv_endpoint": "h:1"}, "not a multiple of opd.nnodes"),
                       ({"nnodes": 2}, "needs opd.rdzv_endpoint"),
                       ({"rdzv_endpoint": "head.example"}, "is not HOST:PORT")]:
        with pytest.raises(ValidationError, match=match):
            OPDConfig(**{"nproc": 2, **bad})
    if not torch.cuda.is_available():  # auto resolves to the CPU here
        with pytest.raises(ValidationError, match="nccl' needs the student on CUDA GPUs"):
            OPDConfig(nproc=2, dist_backend="nccl")
    assert [resolve_backend("auto", d) for d in ("cpu", "cuda")] == ["gloo", "nccl"]
    assert resolve_backend("gloo", "cuda") == "gloo"
    with pytest.raises(ValueError, match="nccl moves only CUDA tensors"):
        resolve_backend("nccl", "cpu")


def test_the_torchrun_command_is_the_documented_one(tmp_path):
    job = tmp_path / "jobs" / "run1"
    assert node_command(job, 4, 2, "head.example:29400", "run1") == (
        "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint head.example:29400 --rdzv-id run1 "
        f"-m tasks.training.launch {job}")
    assert torchrun_args(job, 2) == ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "-m",
                                     "tasks.training.launch", str(job)]
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        torchrun_args(job, 2, nnodes=2)


def _fail_on(failing: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == failing:
        raise KeyError(f"rank {failing} broke")
    dist.barrier()  # the others wait for the rank that failed


def _fail_unpicklable(failing: int) -> None:
    import torch.distributed as dist

    class Local(Exception):  # a class no other process can import: its error comes back as text
        pass

    if dist.get_rank() == failing:
        raise Local(f"rank {failing} broke its own way")
    dist.barrier()


def _die_on(failing: int) -> None:
    import torch.distributed as dist

    if dist.get_rank() == failing:
        os.kill(os.getpid(), signal.SIGKILL)  # no Python error to report
    dist.barrier()


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
    assert out, f"{fn}{args} still running after 600 s: it hangs"
    return out[0]


def _on_two_ranks(folder, fn, *args):
    return launch(fn, args, folder, nproc_per_node=2, backend="gloo", device="cpu")


@pytest.mark.parametrize("failing", [1, 0])
def test_a_failing_rank_fails_the_call_with_its_error_instead_of_hanging(tmp_path, failing):
    """Either rank's own exception comes back as it is (type and message), its rank and traceback there in a note,
    though the other rank waits in a collective when it fails."""
    err = _outcome(_on_two_ranks, tmp_path / "job", _fail_on, failing)
    assert isinstance(err, KeyError) and f"rank {failing} broke" in str(err), repr(err)
    (note,) = err.__notes__
    assert f"raised on rank {failing} of the sharded job job" in note, note
    assert "in _fail_on" in note and f"KeyError: 'rank {failing} broke'" in note, note
    assert not (tmp_path / "job" / "result.json").exists()


def test_a_rank_error_that_cannot_travel_comes_back_as_its_traceback_and_a_killed_rank_is_said(tmp_path):
    err = _outcome(_on_two_ranks, tmp_path / "job", _fail_unpicklable, 1)
    assert isinstance(err, RuntimeError), repr(err)
    assert "rank 1 of the sharded job job" in str(err) and "Local: rank 1 broke its own way" in str(err), str(err)
    err = _outcome(_on_two_ranks, tmp_path / "job", _die_on, 1)  # the same folder: the last attempt's error is gone
    assert isinstance(err, RuntimeError), repr(err)
    assert "failed with no Python error from any rank of its own" in str(err), str(err)
    assert "SIGKILL" in str(err), str(err)  # torchrun's report of the rank it lost


def _train(steps: int, sharded: bool, reward_scale: float = 1.0) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``steps`` update steps of a tiny student on its own rollouts (sampled, with behaviour log-probs and a reward
    baseline, two routes with their own objective and weight, gradient clipping active); with ``reward_scale`` != 1
    the target is ExOPD's extrapolation past the teacher, away from a whole (unsharded) reference on every rank.
    Returns the student's full weights and the whole batch's loss per step (rank 0's when sharded)."""
    tok = build_char_tokenizer()
    student = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    teacher = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=1).eval()
    reference = create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=2).eval()
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
        if reward_scale != 1.0:
            hidden = extrapolate_scores(hidden, reference, batch.rollout, reward_scale, vocab_size=len(tok))
        st = update_step(student, batch, hidden, objectives, optimizer, scheduler, chunk_size=4, grad_clip=0.05,
                         route_weights={"sort-low": 2.0}, reward_weight=0.5, shard=rows)
        losses.append((sum_stats(st, list(PROBLEMS)) if sharded else st).loss)
    weights = full_state_dict(student) if sharded else student.state_dict()
    return ({k: v.detach().clone() for k, v in weights.items()} if rank() == 0 else {}), losses


def _train_rank(steps: int, reward_scale: float, out: str) -> list[float]:
    """One rank of :func:`_train` under torchrun (tasks/training/launch.py): rank 0 saves the full weights to ``out``
    and returns the losses (the job's result is JSON)."""
    weights, losses = _train(steps, True, reward_scale)
    if rank() == 0:
        save_file({k: v.contiguous() for k, v in weights.items()}, out)
    return losses


# Float32 summation order differs (each rank's gradients, then their sum): Adam turns that into weight differences of
# ~2e-6 (~8e-6 with ExOPD's 1.5x extrapolated logits), far below any real difference (the weights move ~6e-2).
@pytest.mark.parametrize(("reward_scale", "tol"), [(1.0, 1e-5), (1.5, 3e-5)], ids=["opd", "exopd"])
def test_update_step_on_two_gloo_ranks_under_torchrun_equals_one_process(tmp_path, reward_scale, tol):
    """The launch entry point under a real ``torchrun`` (2 CPU processes, gloo) takes the step one process takes."""
    one, one_losses = _train(3, sharded=False, reward_scale=reward_scale)
    out = tmp_path / "two.safetensors"
    two_losses = launch(_train_rank, (3, reward_scale, str(out)), tmp_path / "job", nproc_per_node=2,
                        backend="gloo", device="cpu")
    two = load_file(out)
    assert sorted(two) == sorted(one)
    diff = max((two[k] - one[k]).abs().max().item() for k in one)
    init = create_model(build_char_tokenizer(), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                        seed=0).state_dict()
    moved = min((one[k] - init[k]).abs().max().item() for k in one if k.endswith("weight"))
    print(f"reward_scale {reward_scale}: max abs weight diff 1 process vs 2 torchrun ranks after 3 steps: {diff:.2e} "
          f"(smallest weight change {moved:.2e})")
    assert moved > 1e-3
    assert diff < tol
    assert two_losses == pytest.approx(one_losses, abs=1e-5)


def test_exopd_changes_the_update():
    """The ExOPD case above is not the plain one: the extrapolated target moves the weights elsewhere."""
    (plain, _), (exopd, _) = _train(1, sharded=False), _train(1, sharded=False, reward_scale=1.5)
    assert max((plain[k] - exopd[k]).abs().max().item() for k in plain) > 1e-4


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
