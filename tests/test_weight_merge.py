"""Weight-merging baselines (tasks.merging.weight_merge): hand-computed merges, identities between the methods, DARE's
expectation and determinism, the mismatch errors, and a round trip through real checkpoints. The mergekit
cross-check runs only where a ``mergekit-yaml`` is found (on PATH or in $MERGEKIT_YAML; mergekit lives in its own
venv, e.g. ``python -m venv /tmp/mk && /tmp/mk/bin/pip install torch==2.13.0 mergekit``)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tasks.modeling.models import create_model, save_model
from tasks.world.tokenizer import build_char_tokenizer
from tasks.merging.weight_merge import check_compatible, dare, merge_checkpoints, task_arithmetic, task_vectors, ties

T = torch.tensor


def sd(*xs, dtype=torch.float64) -> dict:
    return {"w": T(xs, dtype=dtype)}


def close(a: dict, b: dict, atol: float = 1e-9) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


# ---- hand-computed merges ------------------------------------------------------------------------------------------

def test_task_vectors_by_hand():
    tv = task_vectors(sd(1, 2, 3, 4), [sd(2, 2, 1, 4), sd(1, 5, 3, 2)])
    close(tv[0], sd(1, 0, -2, 0))
    close(tv[1], sd(0, 3, 0, -2))


def test_task_arithmetic_by_hand():
    # deltas [1, 0, -2, 0] and [0, 3, 0, -2]; sum [1, 3, -2, -2]; base + 0.5 * sum
    merged = task_arithmetic(sd(1, 2, 3, 4), [sd(2, 2, 1, 4), sd(1, 5, 3, 2)], scale=0.5)
    close(merged, sd(1.5, 3.5, 2, 3))


def test_ties_by_hand():
    base = sd(1, 1, 1, 1, 1)
    d1, d2, d3 = (3, -1, 2, 0.5, -4), (-1.5, 2, 1, -3, -0.5), (2, -3, -0.2, 1, 1.2)
    experts = [sd(*(1 + x for x in d)) for d in (d1, d2, d3)]
    # density 0.6 of 5 entries keeps k = 3 per expert:
    #   trimmed 1 [3, 0, 2, 0, -4]   trimmed 2 [-1.5, 2, 0, -3, 0]   trimmed 3 [2, -3, 0, 0, 1.2]
    # sums [3.5, -1, 2, -3, -2.8] elect signs [+, -, +, -, -]; agreeing entries' means [2.5, -3, 2, -3, -4]
    merged = ties(base, experts, density=0.6, scale=0.5)
    close(merged, sd(1 + 0.5 * 2.5, 1 - 0.5 * 3, 1 + 0.5 * 2, 1 - 0.5 * 3, 1 - 0.5 * 4))


def test_ties_zero_sum_elects_plus_and_all_zero_entry_stays_base():
    # entry 0: +1 and -1 sum to 0 -> sign + -> mean of {+1}; entry 1: likewise +2; entry 2: no expert moved it
    merged = ties(sd(0, 0, 5), [sd(1, -2, 5), sd(-1, 2, 5)], density=1.0)
    close(merged, sd(1, 2, 5))


def test_dare_entries_by_hand():
    # one expert, p = 0.5: each entry is either dropped (base) or kept at delta / p = 2 * delta
    base, expert = sd(10, 10, 10, 10, 10, 10), sd(11, 8, 13, 14, 10, 9)
    delta = T([1, -2, 3, 4, 0, -1], dtype=torch.float64)
    merged = dare(base, [expert], density=0.5, seed=3)["w"]
    kept = merged != 10
    assert torch.equal(merged[kept], 10 + 2 * delta[kept])
    assert 0 < kept.sum() < 5  # with this seed some entries are kept and some dropped (entry 4 has delta 0)


# ---- identities ----------------------------------------------------------------------------------------------------

def rand_sd(seed: int, shapes=((3, 4), (5,))) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(s, generator=g, dtype=torch.float64) for i, s in enumerate(shapes)}


def test_one_expert_scale_one_is_that_expert():
    base, expert = rand_sd(0), rand_sd(1)
    close(task_arithmetic(base, [expert], scale=1.0), expert)


def test_dare_density_one_is_task_arithmetic():
    base, experts = rand_sd(0), [rand_sd(1), rand_sd(2), rand_sd(3)]
    for seed in (0, 1, 7):
        close(dare(base, experts, density=1.0, scale=0.3, seed=seed), task_arithmetic(base, experts, scale=0.3))


def test_ties_agreeing_signs_density_one_is_mean_of_deltas():
    base = rand_sd(0)
    g = torch.Generator().manual_seed(5)
    signs = {k: torch.randn(v.shape, generator=g).sign().double() for k, v in base.items()}
    experts = [{k: base[k] + signs[k] * (0.1 + torch.rand(v.shape, generator=g, dtype=torch.float64))
                for k, v in base.items()} for _ in range(3)]
    mean = {k: base[k] + 0.7 * sum(e[k] - base[k] for e in experts) / 3 for k in base}
    close(ties(base, experts, density=1.0, scale=0.7), mean)


def test_non_float_tensors_are_copied_from_base():
    base = {"w": T([1.0, 2.0]), "step": T([3, 4]), "mask": T([True, False])}
    expert = {"w": T([2.0, 2.0]), "step": T([9, 9]), "mask": T([False, False])}
    for merged in (task_arithmetic(base, [expert]), ties(base, [expert]), dare(base, [expert])):
        assert torch.equal(merged["step"], base["step"]) and torch.equal(merged["mask"], base["mask"])
        assert merged["w"].dtype == torch.float32


def test_low_precision_keeps_dtype():
    base = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    expert = {"w": T([1.0, -2.0, 3.0, 0.5]).to(torch.bfloat16)}
    merged = task_arithmetic(base, [expert], scale=0.5)["w"]
    assert merged.dtype == torch.bfloat16 and torch.equal(merged.float(), T([0.5, -1.0, 1.5, 0.25]))


# ---- DARE: expectation and determinism -----------------------------------------------------------------------------

def test_dare_expectation_is_task_arithmetic():
    base, experts = sd(0, 0, 0, 0), [sd(1, -2, 0.5, 4), sd(-1, 1, 2, -3)]
    n = 4000
    mean = sum(dare(base, experts, density=0.5, seed=s)["w"] for s in range(n)) / n
    # each entry's variance is sum_i tau_i^2 (1 - p) / p <= 25, so the mean's std is <= 5 / sqrt(4000) = 0.08
    torch.testing.assert_close(mean, task_arithmetic(base, experts)["w"], atol=0.3, rtol=0)


def test_dare_keeps_about_density():
    base, expert = {"w": torch.zeros(10_000)}, {"w": torch.ones(10_000)}
    kept = (dare(base, [expert], density=0.3, seed=1)["w"] != 0).float().mean()
    assert abs(kept - 0.3) < 0.02


def test_dare_is_deterministic_in_seed_and_independent_of_dict_order():
    base, experts = rand_sd(0, ((8, 8), (16,))), [rand_sd(1, ((8, 8), (16,))), rand_sd(2, ((8, 8), (16,)))]
    a = dare(base, experts, density=0.5, seed=11)
    close(a, dare(base, experts, density=0.5, seed=11), atol=0)
    assert not torch.equal(a["t0"], dare(base, experts, density=0.5, seed=12)["t0"])
    reordered = [dict(reversed(list(d.items()))) for d in [base, *experts]]
    close(a, dare(reordered[0], reordered[1:], density=0.5, seed=11), atol=0)


# ---- errors --------------------------------------------------------------------------------------------------------

def test_mismatch_errors_name_the_tensor():
    base = {"a": torch.zeros(2), "b": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"expert #1 .* no tensor 'b'"):
        check_compatible(base, [base, {"a": torch.zeros(2)}])
    with pytest.raises(ValueError, match=r"'b' has shape \(4,\), the base \(3,\)"):
        task_arithmetic(base, [{"a": torch.zeros(2), "b": torch.zeros(4)}])
    with pytest.raises(ValueError, match=r"tensor 'c' the base lacks"):
        ties(base, [{**base, "c": torch.zeros(1)}])
    with pytest.raises(ValueError, match="no experts"):
        dare(base, [])


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5])
def test_bad_density(density):
    with pytest.raises(ValueError, match="density"):
        ties(sd(0.0), [sd(1.0)], density=density)
    with pytest.raises(ValueError, match="density"):
        dare(sd(0.0), [sd(1.0)], density=density)


# ---- checkpoints ---------------------------------------------------------------------------------------------------

SIZE = dict(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=32)


def perturbed(model, seed: int, std: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(std * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight-merge")
    tok = build_char_tokenizer()
    base = save_model(create_model(tok, seed=0, **SIZE), tok, root / "base")
    experts = [save_model(perturbed(create_model(tok, seed=0, **SIZE), i), tok, root / f"e{i}") for i in (1, 2)]
    return root, base, experts


def weights(path) -> dict:
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare"])
def test_merge_checkpoints_round_trip(ckpts, method):
    root, base, experts = ckpts
    out = merge_checkpoints(base, experts, method, root / f"out-{method}", density=0.5, scale=0.8, seed=4)
    merged = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).state_dict()
    base_sd, expert_sds = weights(base), [weights(e) for e in experts]
    expected = {"task_arithmetic": lambda: task_arithmetic(base_sd, expert_sds, 0.8),
                "ties": lambda: ties(base_sd, expert_sds, 0.5, 0.8),
                "dare": lambda: dare(base_sd, expert_sds, 0.5, 0.8, seed=4)}[method]()
    assert expected.keys() <= merged.keys()
    close({k: merged[k] for k in expected}, expected, atol=0)
    assert not torch.equal(merged["lm_head.weight"], base_sd["lm_head.weight"])
    record = json.loads((root / f"out-{method}" / "weight_merge.json").read_text())
    assert record["method"] == method and record["expert_uris"] == [str(e) for e in experts]
    assert (root / f"out-{method}" / "tokenizer.json").exists()


def test_merge_checkpoints_rejects_mismatches(ckpts, tmp_path):
    root, base, experts = ckpts
    tok = build_char_tokenizer()
    wider = save_model(create_model(tok, **{**SIZE, "intermediate_size": 48}), tok, tmp_path / "wider")
    with pytest.raises(ValueError, match=rf"expert {wider} .*'model.layers.0.mlp.gate_proj.weight' has shape"):
        merge_checkpoints(base, [experts[0], wider], "ties", tmp_path / "out")
    qwen = save_model(create_model(tok, arch="qwen2", **SIZE), tok, tmp_path / "qwen")
    with pytest.raises(ValueError, match=rf"expert {qwen} has architecture \('qwen2'"):
        merge_checkpoints(base, [qwen], "task_arithmetic", tmp_path / "out")
    with pytest.raises(ValueError, match="method 'slerp'"):
        merge_checkpoints(base, experts, "slerp", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- optional: the same merges by mergekit -------------------------------------------------------------------------

MERGEKIT_YAML = os.environ.get("MERGEKIT_YAML") or shutil.which("mergekit-yaml")


@pytest.mark.skipif(MERGEKIT_YAML is None, reason="mergekit-yaml not found (put it on PATH or set MERGEKIT_YAML)")
@pytest.mark.parametrize("method,density", [("task_arithmetic", 1.0), ("ties", 0.5), ("dare", 1.0)])
def test_matches_mergekit(ckpts, tmp_path, method, density):
    """mergekit's dare_linear draws from an unseeded RNG and rescales to the L1 norm, so DARE compares at density 1."""
    root, base, experts = ckpts
    params = "weight: 1.0" + ("" if method == "task_arithmetic" else f", density: {density}")
    models = "".join(f"  - model: {e}\n    parameters: {{{params}}}\n" for e in experts)
    config = tmp_path / "merge.yml"
    config.write_text(f"merge_method: {method.replace('dare', 'dare_linear')}\nbase_model: {base}\n"
                      f"parameters: {{lambda: 0.8}}\ndtype: float32\nmodels:\n{models}")
    subprocess.run([MERGEKIT_YAML, str(config), str(tmp_path / "mk")], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    ours = merge_checkpoints(base, experts, method, tmp_path / "ours", density=density, scale=0.8)
    theirs = weights(tmp_path / "mk")
    mine = weights(Path(ours))
    assert theirs.keys() == mine.keys()
    close(mine, theirs, atol=1e-6)
