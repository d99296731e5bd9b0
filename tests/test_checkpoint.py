"""Unit tier for the merge checkpoints (tasks/training/checkpoint.py) and the test-only fault injection (tests/faults): what
a write interrupted at any point leaves, what is read back, what makes two merges "the same command"; the fault rules
and where their points sit in the production code."""

import math

import pytest
import torch

from tasks.training.checkpoint import KEEP, MergeCheckpoints, batch_from_state, batch_state, merge_key
from tasks.config import pipeline_config
from tasks.training.distill import Batch
from tasks.objectives.losses import TokenInputs
from tasks.modeling.rollout import Rollout
from tests.faults import InjectedFault, fault, missing_anchors


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    """Rule hits are counted per process until $OPD_FAULT changes: every test here starts from zero."""
    import tests.faults.rules

    monkeypatch.setattr(tests.faults.rules, "_counts", {})
    monkeypatch.setattr(tests.faults.rules, "_spec_seen", [""])


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


def test_every_fault_point_still_has_the_call_it_hooks():
    """tests/faults/points.py hooks each point on a call its production function makes: a refactor that drops the
    call would silently disarm the point (and the reliability tests that need it)."""
    assert missing_anchors() == []


def test_checkpoint_saved_fires_once_the_checkpoint_is_committed(tmp_path, monkeypatch):
    store = MergeCheckpoints(tmp_path / "m")
    monkeypatch.setenv("OPD_FAULT", "checkpoint_saved:2=raise")
    _save(store, 3)
    with pytest.raises(InjectedFault, match=r"at checkpoint_saved \(hit 2"):
        _save(store, 6)
    assert store.latest().name == "step-00000006" and not list(store.root.glob(".tmp-*"))


def test_the_generate_loss_and_update_points_sit_inside_one_step(monkeypatch):
    """On tiny real models: ``generate`` fires per sampled batch; ``loss`` once per update (here two objectives, so
    two objective calls a step) and its NaN is a real one, through the backward pass (NaN gradient norm, step
    skipped); ``update`` fires with the gradients computed and no optimizer step taken."""
    from tasks.training.distill import sample_batch, update_step
    from tasks.objectives.losses import Objective
    from tasks.modeling.models import create_model
    from tasks.modeling.rollout import forward_hidden
    from tasks.world.tokenizer import build_char_tokenizer
    from tasks.world.domains import Route, domain_of, format_prompt
    from tasks.world.spec import world_verifiers

    tok = build_char_tokenizer()
    student, teacher = (create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=s)
                        for s in (8, 9))
    problems = [("rev-high", "abcd"), ("rev-high", "qwe"), ("sort-low", "5203"), ("sort-low", "91")]
    routes = [r for r, _ in problems]
    prompts = [format_prompt(Route.parse(r), p) for r, p in problems]
    answers = [domain_of(Route.parse(r)).answer(p) for r, p in problems]
    verifiers = world_verifiers(sorted(set(routes)))

    torch.manual_seed(0)
    monkeypatch.setenv("OPD_FAULT", "generate:2=raise")
    batch = sample_batch(student, tok, prompts, routes, answers, [6] * 4, 0, verifiers=verifiers)
    with pytest.raises(InjectedFault, match=r"at generate \(hit 2"):
        sample_batch(student, tok, prompts, routes, answers, [6] * 4, 0, verifiers=verifiers)

    with torch.no_grad():
        hidden = forward_hidden(teacher, batch.rollout.sequences_B_T, batch.rollout.attention_mask_B_T)
    scores = {"t": (list(range(4)), hidden, teacher.get_output_embeddings())}
    objectives = {"rev-high": Objective("reverse_kl"), "sort-low": Objective("forward_kl")}
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)

    def weights() -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in student.state_dict().items()}

    monkeypatch.setenv("OPD_FAULT", "loss:2=nan,update:3=raise")
    w0 = weights()
    first = update_step(student, batch, scores, objectives, optimizer)
    assert not first.skipped and math.isfinite(first.loss), "the 1st step's loss was hit twice (once per objective)"
    w1 = weights()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)
    second = update_step(student, batch, scores, objectives, optimizer)
    assert second.skipped and math.isnan(second.loss) and math.isnan(second.grad_norm)
    assert all(torch.equal(w1[k], v) for k, v in weights().items())
    with pytest.raises(InjectedFault, match=r"at update \(hit 3"):
        update_step(student, batch, scores, objectives, optimizer)
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and any(bool(g.abs().sum() > 0) for g in grads) and all(bool(g.isfinite().all()) for g in grads)
    assert all(torch.equal(w1[k], v) for k, v in weights().items())  # computed, not stepped
