"""RL specialists (RLVR teachers) in the train-specialists flow: GRPO from the quick base on one route, the route's
verifier as the reward, for real through Prefect and MLflow; and the keys that keep sft and rl specialists apart."""

import hashlib
import time

import pytest
import torch
from mlflow.tracking import MlflowClient

from tasks.config import RLConfig, SpecialistsConfig, TrainConfig, WorldConfig, pipeline_config
from tasks.training.specialist import SPECIALISTS_EXPERIMENT, specialist_dir
from tasks.tracking.runs import tracking_uri

pytestmark = pytest.mark.slow

ROUTE = "rev-low"
# Measured on this 2-core machine (2026-12): the quick base answers 0.47 of rev-low's held-out prompts; 200 GRPO steps
# of 32 prompts x 8 samples (the RLConfig defaults) reach 0.62 in ~35 s of training. Asserted with room for noise.
RL = RLConfig(steps=200, eval_every=50)
MARGIN = 0.08


def _runs(client: MlflowClient):
    exp = client.get_experiment_by_name(SPECIALISTS_EXPERIMENT)
    return client.search_runs([exp.experiment_id]) if exp else []


@pytest.fixture(scope="module")
def rl_run(prefect_server):
    """The quick base (3 routes, 250 steps), then the specialists flow with trainer rl on a world of one route.
    Returns (config, base result, registered names, seconds of the specialists flow)."""
    from flows.base import prepare_base
    from flows.specialists import train_specialists

    quick = pipeline_config("quick")
    base = prepare_base(quick.pretrain())
    world = WorldConfig.model_validate({**quick.world.model_dump(), "routes": [ROUTE]})
    cfg = SpecialistsConfig(world=world, base_uri=base["uri"], trainer="rl", rl=RL, min_accuracy=0.0, workers=1,
                            name_prefix="rlspec")
    t0 = time.perf_counter()
    names = train_specialists(cfg)
    return cfg, base, names, time.perf_counter() - t0


def test_rl_specialist_beats_its_base_and_logs_every_step(rl_run):
    cfg, base, names, seconds = rl_run
    client = MlflowClient(tracking_uri())
    # Other tests (the benchmark's) train rl specialists of this route too, from their own bases.
    (run,) = [r for r in _runs(client) if r.info.run_name == f"specialist-rl-{ROUTE}"
              and r.data.params.get("base_uri") == base["uri"]]
    acc = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"accuracy/{ROUTE}")}
    assert sorted(acc) == [0, 50, 100, 150, 200]  # the start, every eval_every steps, the end
    before, after = acc[0], acc[RL.steps]  # step 0 is the base itself, on the same held-out prompts
    print(f"\n{ROUTE}: base {before:.3f} -> rl specialist {after:.3f} after {RL.steps} GRPO steps "
          f"({RL.prompts_per_step} prompts x {RL.group_size}); specialists flow {seconds:.0f} s")
    assert before == pytest.approx(base["accuracy"][ROUTE], abs=0.02)
    assert after > before + MARGIN
    for key in (f"rl/reward/{ROUTE}", "train/loss", "rollout/tokens"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == list(range(1, RL.steps + 1)), key
    tokens = [m.value for m in client.get_metric_history(run.info.run_id, "rollout/tokens")]
    samples = RL.prompts_per_step * RL.group_size
    assert all(2 * samples <= t <= 8 * samples for t in tokens)  # rev-low answers: 2-4 letters + EOS, cap 8
    rewards = [m.value for m in client.get_metric_history(run.info.run_id, f"rl/reward/{ROUTE}")]
    assert sum(rewards[-50:]) / 50 > sum(rewards[:50]) / 50  # the sampled reward rises too
    assert run.data.params["trainer"] == "rl" and run.data.params["steps"] == str(RL.steps)


def test_registry_record_says_rl(rl_run):
    from teachers.registry import TeacherRegistry

    cfg, _, names, _ = rl_run
    assert names == [f"rlspec-{ROUTE}"]
    rec = TeacherRegistry().get(names[0])
    assert rec.provenance.source == "train-specialists-rl"
    assert rec.provenance.config_hash == cfg.rl.config_hash() != cfg.train.config_hash()
    assert f"{ROUTE}-rl-" in rec.model_uri


def test_rerun_is_a_cache_hit_and_sft_is_not_served_from_the_rl_cache(rl_run):
    from flows.specialists import train_specialists
    from teachers.registry import TeacherRegistry

    cfg, _, names, _ = rl_run
    client = MlflowClient(tracking_uri())
    before = len(_runs(client))
    rl_uri = TeacherRegistry().get(names[0]).model_uri
    t0 = time.perf_counter()
    assert train_specialists(cfg) == names
    print(f"\ncached rerun {time.perf_counter() - t0:.1f} s")
    assert len(_runs(client)) == before  # no new training run: the task's body did not run
    assert TeacherRegistry().get(names[0]).model_uri == rl_uri
    # The same route, base and world with trainer sft trains (briefly) into its own folder.
    sft = cfg.model_copy(update={"trainer": "sft", "train": TrainConfig(steps=10, warmup_steps=2),
                                 "name_prefix": "sftspec"})
    (sft_name,) = train_specialists(sft)
    assert len(_runs(client)) == before + 1
    rec = TeacherRegistry().get(sft_name)
    assert rec.provenance.source == "train-specialists" and rec.model_uri != rl_uri


def test_sft_and_rl_specialists_never_share_a_folder_or_a_cache_entry():
    from prefect.cache_policies import INPUTS

    train, rl = TrainConfig(), RLConfig()
    args = ("/s/prompt_sets/routes-0123456789ab", ROUTE, "fp0")  # (prompt set, route, base fingerprint)
    sft_dir, rl_dir = specialist_dir(*args, train), specialist_dir(*args, rl)
    assert sft_dir != rl_dir and sft_dir.parent == rl_dir.parent
    assert rl_dir.name.startswith(f"{ROUTE}-rl-") and not sft_dir.name.startswith(f"{ROUTE}-rl-")
    # An sft specialist keeps the folder it had before rl existed (finished ones stay valid).
    old_key = hashlib.sha256(f"{args[0]}|{ROUTE}|fp0|{train.config_hash()}".encode()).hexdigest()[:12]
    assert sft_dir.name == f"{ROUTE}-{old_key}"
    assert specialist_dir(*args, RLConfig(steps=7)) != rl_dir  # every rl field is in the key
    inputs = dict(prompt_set=args[0], route=ROUTE, base_uri="/b", base_fingerprint="fp0")
    keys = {INPUTS.compute_key(None, {**inputs, "train": recipe}, {}) for recipe in (train, rl, RLConfig(lr=1e-3))}
    assert len(keys) == 3


def test_policy_loss_is_on_policy_at_the_sampling_temperature():
    """Rollouts sampled at T with old log-probs at T: the ratio is 1, so the loss is minus the mean advantage."""
    from tasks.modeling.models import create_model
    from tasks.training.rl import policy_loss
    from tasks.modeling.rollout import generate, token_logprobs
    from tasks.world.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = create_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, seed=0)
    ro = generate(model, tok, ["<bos><rev><low>abc=", "<bos><sort><low>312="], 6, temperature=0.5)
    adv_B = torch.tensor([1.5, -0.5])
    (old_B_T,) = token_logprobs(model, ro, (0.5,))
    mask_B_T = ro.loss_mask_B_T().float()
    expected = -(adv_B[:, None] * mask_B_T).sum() / mask_B_T.sum()
    assert policy_loss(model, ro, adv_B, old_B_T, temperature=0.5).item() == pytest.approx(float(expected), abs=1e-5)
    assert policy_loss(model, ro, adv_B, old_B_T).item() != pytest.approx(float(expected), abs=1e-3)  # T=1 is not
