"""Devices and precision (tasks/modeling/device.py): the device and dtype settings, bf16 against fp32 on this CPU
(the loss within a stated tolerance, the same argmax tokens on a fixed batch, every loss and log-prob in fp32), and
the teacher pool parking evicted teachers off the device."""

import copy

import pytest
import torch
from pydantic import ValidationError

from tasks.config import OPDConfig, TrainConfig
from tasks.modeling.device import (
    NoCudaDevice,
    autocast_for,
    model_device,
    place_frozen,
    place_trained,
    resolve_device,
    set_compute_dtype,
)
from tasks.modeling.models import create_model
from tasks.modeling.rollout import forward_hidden, rollout_from_responses, token_logprobs
from tasks.modeling.teacher import checkpoint_teachers
from tasks.modeling.teacher_pool import TeacherPool, host_parking
from tasks.objectives.losses import Objective
from tasks.training.distill import Batch, extrapolate_scores, score_with_teachers, update_step
from tasks.training.sft import SFTBatch, make_optimizer, sft_batch, sft_loss
from tasks.world.tokenizer import build_char_tokenizer

# bf16 keeps 8 bits of mantissa: a relative error of ~2^-8 per product, averaged over a step's tokens. These are the
# tolerances the README states for bf16 against fp32 on the same weights and batch.
LOSS_RTOL = 0.02
LOGPROB_ATOL = 0.05
ARGMAX_MARGIN = 0.25  # logits: bf16's error on a product of this size is well under it

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def fixed_batch(tok) -> Batch:
    """Eight rollouts of fixed text (no sampling): the same tokens whatever the precision."""
    prompts = [f"<|im_start|>user\nrev {w}<|im_end|>\n<|im_start|>assistant\n" for w in
               ("abcd", "qwe", "zz", "xyzw", "ab", "pqrs", "mno", "lk")]
    answers = ["dcba", "ewq", "zz", "wzyx", "ba", "srqp", "onm", "kl"]
    responses = [tok(a + "<|im_end|>", add_special_tokens=False)["input_ids"] for a in answers]
    rollout = rollout_from_responses(tok, prompts, responses)
    return Batch(rollout, ["rev-high"] * 8, answers, True, 0, torch.zeros(8), None, 8,
                 int(rollout.response_lengths_B.sum()))


def peaked(tok, seed: int):
    """A random model whose output head is scaled up 8x: peaked next-token distributions, as a trained model's are
    (a fresh model's are near uniform, and so is the divergence between two of them)."""
    model = create_model(tok, seed=seed, **SHAPE)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def trained(tok):
    """A small model fitted (fp32) to the fixed batch's answers: confident where it learned, as a trained student is."""
    model = create_model(tok, seed=0, **SHAPE)
    rollout = fixed_batch(tok).rollout
    optimizer, _ = make_optimizer(model, 3e-3, 0.0, 0, 150)
    for _ in range(150):
        loss = sft_loss(model, SFTBatch(rollout.sequences_B_T, rollout.attention_mask_B_T,
                                        rollout.sequences_B_T.masked_fill(rollout.attention_mask_B_T == 0, -100)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def loss_of(tok, student_dtype: str, teacher_dtype: str) -> tuple[float, list[float], float]:
    """The first update's loss and the student's per-token log-probs of the fixed batch, from the same initial weights
    (seed 0 student, seed 1 teacher) at the given precisions."""
    student = place_trained(peaked(tok, 0), "cpu", student_dtype)
    teacher = place_frozen(peaked(tok, 1), "cpu", teacher_dtype)
    batch = fixed_batch(tok)
    (logq_B_T,) = token_logprobs(student, batch.rollout, (1.0,), vocab_size=len(tok))
    optimizer, _ = make_optimizer(student, 1e-3, 0.0, 0, 10)
    scores = score_with_teachers(checkpoint_teachers({"t": teacher}), {"t": list(range(8))}, batch.rollout)
    st = update_step(student, batch, scores, {"rev-high": Objective(loss="reverse_kl")}, optimizer, chunk_size=8,
                     vocab_size=len(tok))
    assert logq_B_T.dtype == torch.float32  # log-probs are fp32 whatever the weights' dtype
    return st.loss, logq_B_T[batch.rollout.loss_mask_B_T().bool()].tolist(), st.teacher_entropy["rev-high"]


def test_bf16_loss_and_logprobs_match_fp32_within_tolerance(tok):
    ref_loss, ref_lp, ref_teacher_entropy = loss_of(tok, "fp32", "fp32")
    for student_dtype, teacher_dtype in [("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16")]:
        loss, lp, teacher_entropy = loss_of(tok, student_dtype, teacher_dtype)
        print(f"student {student_dtype}, teacher {teacher_dtype}: loss {loss:.5f} vs fp32 {ref_loss:.5f} "
              f"(rel {abs(loss - ref_loss) / ref_loss:.2e}), max |log q| gap "
              f"{max(abs(a - b) for a, b in zip(lp, ref_lp)):.2e}")
        assert ref_loss > 1.0  # two peaked random models: far apart, so the tolerance is not vacuous
        assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
        assert lp == pytest.approx(ref_lp, abs=LOGPROB_ATOL)
        if student_dtype == "bf16":
            assert loss != ref_loss  # bf16 really ran: not bit-identical to fp32
        if teacher_dtype == "fp32":  # a bf16 student's autocast does not lower an fp32 teacher's precision
            assert teacher_entropy == pytest.approx(ref_teacher_entropy, rel=1e-6)


def test_bf16_student_computes_in_bf16_keeps_fp32_weights_and_fp32_loss(tok):
    student = place_trained(create_model(tok, seed=0, **SHAPE), "cpu", "bf16")
    assert all(p.dtype == torch.float32 for p in student.parameters())  # master weights
    batch = fixed_batch(tok)
    hidden_B_T_H = forward_hidden(student, batch.rollout.sequences_B_T, batch.rollout.attention_mask_B_T)
    with autocast_for(student):
        logits = student.get_output_embeddings()(hidden_B_T_H)
    assert logits.dtype == torch.bfloat16  # the head's product ran under bf16 autocast
    loss = sft_loss(student, sft_batch(tok, ["<|im_start|>user\nrev ab<|im_end|>\n<|im_start|>assistant\n"], ["ba"]))
    assert loss.dtype == torch.float32


def test_bf16_and_fp32_pick_the_same_argmax_tokens_on_a_fixed_batch(tok):
    """The same greedy token at every position where fp32's best token leads its runner-up by more than bf16's error
    (ARGMAX_MARGIN logits); only near-ties may flip, and they are few."""
    fp32 = trained(tok)
    bf16 = set_compute_dtype(copy.deepcopy(fp32), torch.bfloat16)
    rollout = fixed_batch(tok).rollout
    with torch.no_grad():
        logits = []
        for model in (fp32, bf16):
            hidden_B_T_H = forward_hidden(model, rollout.sequences_B_T, rollout.attention_mask_B_T)
            with autocast_for(model):
                logits.append(model.get_output_embeddings()(hidden_B_T_H).float())
    top2_B_T_2 = logits[0].topk(2, dim=-1).values
    clear_B_T = (top2_B_T_2[..., 0] - top2_B_T_2[..., 1] > ARGMAX_MARGIN) & rollout.attention_mask_B_T.bool()
    same_B_T = logits[0].argmax(-1) == logits[1].argmax(-1)
    real = int(rollout.attention_mask_B_T.sum())
    print(f"argmax agreement bf16 vs fp32: {same_B_T[clear_B_T].float().mean():.4f} on the {int(clear_B_T.sum())} "
          f"positions with a margin > {ARGMAX_MARGIN}, {same_B_T[rollout.attention_mask_B_T.bool()].float().mean():.4f}"
          f" on all {real}")
    assert int(clear_B_T.sum()) >= 0.95 * real
    assert bool(same_B_T[clear_B_T].all())


def test_exopd_with_reference_in_another_dtype_than_the_teacher(tok):
    """ExOPD's target with a bf16 teacher and an fp32 reference equals the all-fp32 one within the tolerance: the
    two models' hidden states meet in fp32 and each head gets its own dtype back (losses.head_input)."""
    batch = fixed_batch(tok)
    values = []
    for teacher_dtype in ("fp32", "bf16"):
        teacher = place_frozen(peaked(tok, 1), "cpu", teacher_dtype)
        reference = place_frozen(peaked(tok, 2), "cpu", "fp32")
        scores = score_with_teachers(checkpoint_teachers({"t": teacher}), {"t": [0, 3]}, batch.rollout)
        rows, hidden, head, _, _ = extrapolate_scores(scores, reference, batch.rollout, 1.5, vocab_size=len(tok))["t"]
        assert hidden.dtype == torch.float32
        with torch.no_grad():
            values.append(torch.log_softmax(head(hidden), -1))
    # The target's logits are 1.5 x the teacher's log-probs minus 0.5 x the reference's: bf16's error scaled by 1.5.
    assert values[1] == pytest.approx(values[0], abs=1.5 * LOGPROB_ATOL)
    assert not torch.equal(values[1], values[0])


def test_devices_resolve_and_cuda_without_a_gpu_is_refused():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(NoCudaDevice, match="torch sees no CUDA GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="not one of auto, cpu, cuda"):
        resolve_device("tpu")
    model = place_trained(torch.nn.Linear(2, 2), "cpu", "bf16")
    assert model_device(model) == torch.device("cpu") and model.opd_compute_dtype == torch.bfloat16


def test_device_and_dtype_fields_validate_per_role():
    opd = OPDConfig(device="cpu", dtype="bf16", teacher_dtype="fp16", reference_dtype="bf16", teacher_device="cpu")
    assert (opd.device, opd.dtype, opd.teacher_dtype, opd.reference_dtype) == ("cpu", "bf16", "fp16", "bf16")
    assert TrainConfig(dtype="bf16").dtype == "bf16"
    with pytest.raises(ValidationError, match="device"):
        OPDConfig(device="gpu")
    with pytest.raises(ValidationError, match="dtype"):
        OPDConfig(dtype="fp16")  # a trained model in fp16 would need loss scaling
    with pytest.raises(ValidationError, match="teacher_offload"):
        OPDConfig(teacher_offload="nvme")


def test_an_evicted_teacher_is_parked_and_brought_back_without_a_reload():
    """With parking (a GPU's teachers in host memory), a teacher evicted from the device comes back by unpark, not by
    loading its checkpoint again; at most max_resident are on the device at any time."""
    loaded, parked, unparked = [], [], []
    models = {}

    def load(name):
        loaded.append(name)
        models[name] = torch.nn.Linear(1, 1)
        return models[name]

    def park(m):
        parked.append(m)
        return m

    def unpark(m):
        unparked.append(m)
        return m

    pool = TeacherPool([f"t{i}" for i in range(4)], load, max_resident=2, park=park, unpark=unpark)
    for name in ["t0", "t1", "t2", "t3", "t0", "t1", "t2", "t3"]:
        assert pool[name] is models[name]
        assert len(pool.resident) <= 2
    assert loaded == ["t0", "t1", "t2", "t3"]  # each checkpoint read once
    assert pool.loads == 4 and pool.evictions == 6 and pool.unparks == 4
    assert parked[:2] == [models["t0"], models["t1"]] and unparked[0] is models["t0"]
    assert set(pool.parked) == {"t0", "t1"} and list(pool.resident) == ["t2", "t3"]
    with pytest.raises(ValueError, match="come together"):
        TeacherPool(["a"], load, 1, park=park)


def test_parking_applies_to_gpu_teachers_with_cpu_offload_only():
    assert host_parking(torch.device("cpu"), "cpu") == {}
    assert host_parking(torch.device("cuda", 0), "disk") == {}
    parking = host_parking(torch.device("cuda", 0), "cpu")
    assert set(parking) == {"park", "unpark"}
    m = parking["park"](torch.nn.Linear(2, 2))  # on this CPU machine: stays on the CPU (pinned only with CUDA)
    assert model_device(m) == torch.device("cpu")


def test_merge_threads_default_to_the_cores_shared_out_among_a_machines_processes(monkeypatch):
    from tasks.modeling.device import cpu_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_threads(0) == 8
    assert cpu_threads(0, 3) == 2  # 8 cores, 3 ranks on this machine: 2 each, never more than the cores
    assert cpu_threads(0, 16) == 1  # more ranks than cores: still one thread each
    assert cpu_threads(5, 3) == 5  # an explicit count is taken as given
    with pytest.raises(ValidationError):
        OPDConfig(threads=-1)


def test_the_merge_runs_under_opd_threads_and_gives_the_count_back(monkeypatch):
    """merge_rank sets torch's thread count before the loop (and so before any vLLM engine) is built, and restores
    the process's count when the merge ends, failed or not."""
    import tasks.merging.merge as merge
    from tasks.config import MergeConfig

    seen = []

    class Stop(Exception):
        pass

    class FakeLoop:
        def __init__(self, *a, **k):
            seen.append(torch.get_num_threads())
            raise Stop

    before = torch.get_num_threads()
    monkeypatch.setattr(merge, "MergeLoop", FakeLoop)
    want = 3 if before != 3 else 2
    with pytest.raises(Stop):
        merge.merge_rank(MergeConfig(opd=OPDConfig(threads=want)), "unused", None, "run")
    assert seen == [want]
    assert torch.get_num_threads() == before
