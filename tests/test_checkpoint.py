"""Unit tier for the merge checkpoints (tasks/checkpoint.py) and the test-only fault injection (tasks/faults.py): what
a write interrupted at any point leaves, what is read back, what makes two merges "the same command"."""

import pytest
import torch

from tasks.checkpoint import KEEP, MergeCheckpoints, batch_from_state, batch_state, merge_key
from tasks.config import pipeline_config
from tasks.distill import Batch
from tasks.faults import InjectedFault, fault
from tasks.losses import TokenInputs
from tasks.rollout import Rollout


def _save(store: MergeCheckpoints, step: int):
    weights = {"w": torch.full((2, 3), float(step)), "b": torch.arange(3.0)}
    trainer = {"optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1}]},
               "torch_rng": torch.get_rng_state(), "pending": None}
    return store.save(weights, trainer, {"step": step, "run_id": "r"})


def test_a_checkpoint_reads_back_what_was_saved_and_only_the_newest_are_kept(tmp_path):
    store = MergeCheckpoints(tmp_path / "m")
    assert store.latest() is None
    for step in (3, 6, 9):
        rng_saved = torch.get_rng_state()  # what _save writes for this step
        _save(store, step)
    torch.rand(8)  # the live generator moves on: what reads back must be the saved state, not the current one
    assert not torch.equal(rng_saved, torch.get_rng_state())
    assert store.latest().name == "step-00000009"
    assert sorted(p.name for p in store.root.glob("step-*")) == ["step-00000006", "step-00000009"][-KEEP:]
    ck = store.load(store.latest())
    assert ck.step == 9 and torch.equal(ck.weights["w"], torch.full((2, 3), 9.0))
    assert torch.equal(ck.trainer["torch_rng"], rng_saved), "the torch RNG state read back is not the one saved"
    assert ck.state["run_id"] == "r"


def test_an_interrupted_write_is_never_picked_up_and_is_cleaned(tmp_path, monkeypatch):
    store = MergeCheckpoints(tmp_path / "m")
    _save(store, 3)
    monkeypatch.setenv("OPD_FAULT", "checkpoint_write:1=raise")  # half the files written, then the process "dies"
    with pytest.raises(InjectedFault):
        _save(store, 6)
    (half,) = store.root.glob(".tmp-*")
    assert (half / "student.safetensors").exists() and not (half / "state.json").exists()
    assert store.latest().name == "step-00000003"
    # A kill between the rename and the pointer update leaves a complete folder that `latest` does not name.
    (store.root / "step-00000006").mkdir()
    store.clean()
    assert not list(store.root.glob(".tmp-*")) and not (store.root / "step-00000006").exists()
    assert store.load(store.latest()).step == 3
    monkeypatch.delenv("OPD_FAULT")
    _save(store, 6)
    assert store.load(store.latest()).step == 6


def test_begin_and_finish_frame_one_run_and_the_lock_admits_one_process(tmp_path):
    store = MergeCheckpoints(tmp_path / "m")
    store.acquire()
    with pytest.raises(RuntimeError, match="another process is running this merge"):
        MergeCheckpoints(tmp_path / "m").acquire()
    store.begin("run-1")
    _save(store, 3)
    assert store.run_id() == "run-1" and store.finished() is None
    store.finish({"run_id": "run-1", "result": {"rows": []}})
    assert store.finished()["run_id"] == "run-1" and store.latest() is None and not list(store.root.glob("step-*"))
    store.begin("run-2")
    assert store.run_id() == "run-2" and store.finished() is None
    store.release()
    MergeCheckpoints(tmp_path / "m").acquire()


def test_the_same_command_ignores_run_policy_fields_only():
    cfg = pipeline_config("quick").merge("/base", ["t1"])
    key = merge_key(cfg, "sha:1", "sha:t", "sqlite:///x")
    policy = cfg.model_copy(update={"retries": 3, "opd": cfg.opd.model_copy(update={
        "checkpoint_every": 7, "max_bad_steps": 99, "resume": False})})
    assert merge_key(policy, "sha:1", "sha:t", "sqlite:///x") == key
    steps = cfg.model_copy(update={"opd": cfg.opd.model_copy(update={"steps": 7})})
    assert merge_key(steps, "sha:1", "sha:t", "sqlite:///x") != key
    assert merge_key(cfg, "sha:2", "sha:t", "sqlite:///x") != key  # other student weights
    assert merge_key(cfg, "sha:1", "sha:u", "sqlite:///x") != key  # other teachers
    assert merge_key(cfg, "sha:1", "sha:t", "http://127.0.0.1:5000") != key  # another MLflow store


def test_a_batch_survives_the_checkpoint_format(tmp_path):
    ro = Rollout(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]]),
                 torch.tensor([False]), 1)
    tokens = TokenInputs(torch.tensor([[2, 3]]), torch.tensor([[-0.5, -0.1]]), torch.tensor([[-0.4, -0.2]]))
    batch = Batch(ro, ["rev-low"], ["ab"], True, 4, torch.tensor([1.0]), tokens, 1)
    torch.save(batch_state(batch), tmp_path / "b.pt")
    back = batch_from_state(torch.load(tmp_path / "b.pt", weights_only=True))
    assert (back.routes, back.answers, back.on_policy, back.version) == (["rev-low"], ["ab"], True, 4)
    assert back.generated == 1
    assert torch.equal(back.rollout.sequences_B_T, ro.sequences_B_T) and back.rollout.prompt_width == 1
    assert torch.equal(back.tokens.logq_old_B_T, tokens.logq_old_B_T)
    assert batch_state(None) is None and batch_from_state(None) is None


def test_fault_rules_count_hits_per_point(monkeypatch):
    monkeypatch.setenv("OPD_FAULT", "loss:2=nan,loss:4-=nan,update:1=raise")
    assert [fault("loss") for _ in range(5)] == [None, "nan", None, "nan", "nan"]
    with pytest.raises(InjectedFault, match="update"):
        fault("update")
    assert fault("update") is None and fault("generate") is None
    monkeypatch.setenv("OPD_FAULT", "loss:1=nan")  # a new spec restarts the counts
    assert fault("loss") == "nan"
    monkeypatch.delenv("OPD_FAULT")
    assert fault("loss") is None
