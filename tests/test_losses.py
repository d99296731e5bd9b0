"""The objective menu of ``tasks.objectives.losses``: every divergence, top-k form, policy-gradient correction and the chunked
objective, checked against float64 references computed another way (explicit probability tables, plain loops),
hand-worked values, limits and a Monte-Carlo check of the sampled-token estimator."""

import math

import pytest
import torch
import torch.nn.functional as F

from tasks.objectives.losses import (
    Objective,
    TokenInputs,
    chunked_objective,
    divergence,
    kl,
    log1mexp,
    policy_gradient_loss,
    sampled_token_advantage,
    token_divergence,
    topk_log_probs,
)

ID = torch.nn.Identity()  # with identity heads the "hidden states" are the logits themselves
SUPPORTS = ("tail", "renormalize", "truncate")
# (loss, beta, alpha): every full divergence, JSD and the skews at several mixing weights (endpoints included).
CASES = [
    ("reverse_kl", 0.5, 0.1),
    ("forward_kl", 0.5, 0.1),
    ("jsd", 0.0, 0.1),
    ("jsd", 0.1, 0.1),
    ("jsd", 0.5, 0.1),
    ("jsd", 0.9, 0.1),
    ("jsd", 1.0, 0.1),
    ("skew_kl", 0.5, 0.0),
    ("skew_kl", 0.5, 0.1),
    ("skew_kl", 0.5, 0.7),
    ("skew_reverse_kl", 0.5, 0.0),
    ("skew_reverse_kl", 0.5, 0.1),
    ("skew_reverse_kl", 0.5, 0.7),
]
FIVE = [("reverse_kl", 0.5, 0.1), ("forward_kl", 0.5, 0.1), ("jsd", 0.3, 0.1), ("skew_kl", 0.5, 0.2),
        ("skew_reverse_kl", 0.5, 0.2)]


# ----------------------------------------------------------------------------------------------------- helpers


def _randn(*shape, seed, scale=1.5, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).to(dtype)


def _softmax_py(row, temperature=1.0):
    """An explicit probability table from one row of logits, in plain Python floats."""
    zs = [float(z) / temperature for z in row]
    top = max(zs)
    e = [math.exp(z - top) for z in zs]
    s = sum(e)
    return [x / s for x in e]


def _softmax_t(z_N_V):
    """Explicit float64 softmax tables (differentiable), written out rather than F.softmax."""
    e = torch.exp(z_N_V - z_N_V.max(-1, keepdim=True).values.detach())
    return e / e.sum(-1, keepdim=True)


def _kl_ref(a, b, log=math.log):
    """KL(a || b) over explicit tables, one category at a time (0 log 0 = 0)."""
    total = 0.0
    for a_c, b_c in zip(a, b):
        if (a_c.detach() if torch.is_tensor(a_c) else a_c) > 0.0:
            total = total + a_c * log(a_c / b_c)
    return total


def _ref_div(q, p, loss, beta=0.5, alpha=0.1, log=math.log):
    """The module docstring's divergences from probability tables ``q`` (student) and ``p`` (teacher): lists of
    Python floats (``log=math.log``) or of 0-d float64 tensors (``log=torch.log``, differentiable)."""
    if loss == "reverse_kl" or (loss == "jsd" and beta == 1.0):
        return _kl_ref(q, p, log)
    if loss == "forward_kl" or (loss == "jsd" and beta == 0.0):
        return _kl_ref(p, q, log)
    if loss == "jsd":
        m = [beta * p_c + (1 - beta) * q_c for p_c, q_c in zip(p, q)]
        return beta * _kl_ref(p, m, log) + (1 - beta) * _kl_ref(q, m, log)
    if loss == "skew_kl":
        return _kl_ref(p, [alpha * p_c + (1 - alpha) * q_c for p_c, q_c in zip(p, q)], log)
    if loss == "skew_reverse_kl":
        return _kl_ref(q, [alpha * q_c + (1 - alpha) * p_c for p_c, q_c in zip(p, q)], log)
    raise AssertionError(loss)


def _ref_rows(zq_N_V, zp_N_V, loss, beta=0.5, alpha=0.1, temperature=1.0):
    """Per-row reference divergence (float64 tensor) from logits, by plain loops."""
    return torch.tensor([
        _ref_div(_softmax_py(a, temperature), _softmax_py(b, temperature), loss, beta, alpha)
        for a, b in zip(zq_N_V.tolist(), zp_N_V.tolist())
    ], dtype=torch.float64)


def _ref_rows_t(zq_N_V, zp_N_V, loss, beta=0.5, alpha=0.1):
    """The same reference, differentiable: float64 tensors in, ``[N]`` out."""
    q, p = _softmax_t(zq_N_V), _softmax_t(zp_N_V)
    return torch.stack([_ref_div(list(q[n]), list(p[n]), loss, beta, alpha, torch.log) for n in range(q.shape[0])])


def _topk_tables(q, p, idx, support):
    """The (k + 1)-, k- or raw k-category tables of a top-k support, from full tables ``q``, ``p`` and indices."""
    qs, ps = [q[i] for i in idx], [p[i] for i in idx]
    if support == "tail":
        return qs + [1.0 - sum(qs)], ps + [1.0 - sum(ps)]
    if support == "renormalize":
        return [x / sum(qs) for x in qs], [x / sum(ps) for x in ps]
    return qs, ps


def _top_indices(table, k):
    return sorted(range(len(table)), key=lambda i: -table[i])[:k]


def _close(got, ref, rtol=1e-5, atol=1e-6):
    got, ref = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    assert torch.allclose(got, ref, rtol=rtol, atol=atol), f"\n got {got}\n ref {ref}\n diff {(got - ref).abs().max()}"


def _grad(f, x):
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(f(x), x)
    return g


def _batch(B=3, T=7, V=11, seed=0):
    s, t = _randn(B, T, V, seed=seed), _randn(B, T, V, seed=seed + 100)
    # Row 0 partly masked, row 1 fully masked (an all-masked chunk is skipped), row 2 mostly unmasked.
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [0] * 7, [0, 1, 1, 1, 1, 1, 1]], dtype=torch.float32)[:B, :T]
    return s, t, mask


def _on_policy_tokens(s_B_T_V, seed=0, sample_temperature=1.0, temperature=1.0):
    """Targets drawn at random and the current student's log-probs of them (detached): an on-policy TokenInputs."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, s_B_T_V.shape[-1], s_B_T_V.shape[:2], generator=g)
    s = s_B_T_V.detach().float()
    beh = F.log_softmax(s / sample_temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    old = F.log_softmax(s / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)
    return TokenInputs(targets, beh, old)


def _direct(s, t, mask, obj, normalizer=None):
    """The objective over the whole tensor at once (no chunking): masked mean of token_divergence."""
    div = token_divergence(s.flatten(0, 1), t.flatten(0, 1), obj).view(mask.shape)
    return (div * mask).sum() / (mask.sum() if normalizer is None else normalizer)


# ---------------------------------------------------------------------------- 1. divergences vs the reference


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss,beta,alpha", CASES)
def test_divergence_matches_explicit_reference(loss, beta, alpha, seed):
    zq, zp = _randn(5, 9, seed=seed), _randn(5, 9, seed=seed + 10, scale=2.5)
    ref = _ref_rows(zq, zp, loss, beta, alpha)
    _close(token_divergence(zq, zp, Objective(loss=loss, beta=beta, alpha=alpha)), ref)
    got64 = divergence(F.log_softmax(zq.double(), -1), F.log_softmax(zp.double(), -1), loss, beta, alpha)
    _close(got64, ref, rtol=1e-10, atol=1e-13)


def test_two_category_hand_computed_values():
    # q = (1/2, 1/2), p = (1/4, 3/4), and for alpha = beta = 1/2 the mixture m = (3/8, 5/8):
    #   KL(q||p) = 1/2 ln 2 + 1/2 ln(2/3)        = 1/2 ln(4/3)                 = 0.143841036225890
    #   KL(p||q) = 1/4 ln(1/2) + 3/4 ln(3/2)                                  = 0.130812035941137
    #   KL(p||m) = 1/4 ln(2/3) + 3/4 ln(6/5)                                  = 0.035374890568425
    #   KL(q||m) = 1/2 ln(4/3) + 1/2 ln(4/5)      = 1/2 ln(16/15)               = 0.032269260568786
    #   JSD(1/2) = (KL(p||m) + KL(q||m)) / 2                                  = 0.033822075568605
    #   skew_kl(1/2) = KL(p||m); skew_reverse_kl(1/2) = KL(q||m) (m is the same mixture for both)
    expected = {
        ("reverse_kl", 0.5, 0.5): 0.143841036225890,
        ("forward_kl", 0.5, 0.5): 0.130812035941137,
        ("jsd", 0.5, 0.5): 0.033822075568605,
        ("skew_kl", 0.5, 0.5): 0.035374890568425,
        ("skew_reverse_kl", 0.5, 0.5): 0.032269260568786,
    }
    logq = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    logp = torch.tensor([[0.25, 0.75]], dtype=torch.float64).log()
    for (loss, beta, alpha), value in expected.items():
        assert _ref_div([0.5, 0.5], [0.25, 0.75], loss, beta, alpha) == pytest.approx(value, abs=1e-14)
        assert divergence(logq, logp, loss, beta, alpha).item() == pytest.approx(value, abs=1e-14), loss
        got32 = token_divergence(logq.float() + 3.0, logp.float() - 1.0, Objective(loss=loss, beta=beta, alpha=alpha))
        assert got32.item() == pytest.approx(value, rel=1e-5), loss  # logits: any shift of log-probs


def test_kl_helper_and_log1mexp():
    a, b = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64), torch.tensor([[0.6, 0.1, 0.3]], dtype=torch.float64)
    assert kl(a.log(), b.log()).item() == pytest.approx(_kl_ref([0.2, 0.3, 0.5], [0.6, 0.1, 0.3]), abs=1e-14)
    x = torch.tensor([-1e-6, -1e-3, -0.5, -math.log(2.0), -1.0, -20.0], dtype=torch.float64)
    # log(1 - e^x): expm1 near 0, log1p far from it (the switch point does not matter for the reference)
    ref = [math.log(-math.expm1(v)) if v > -1.0 else math.log1p(-math.exp(v)) for v in x.tolist()]
    _close(log1mexp(x), ref, rtol=1e-12, atol=0)
    assert torch.isfinite(log1mexp(torch.tensor([0.0, 1e-9]))).all()  # a full top-k mass: a finite tail bucket


# ------------------------------------------------------------------------------------- 2. identities and limits


@pytest.mark.parametrize("loss,beta,alpha", CASES)
def test_identical_inputs_give_zero(loss, beta, alpha):
    z = _randn(6, 10, seed=3)
    got = token_divergence(z, z.clone(), Objective(loss=loss, beta=beta, alpha=alpha))
    _close(got, torch.zeros(6), atol=1e-6)


def _logs(seed, N=6, V=10):
    return F.log_softmax(_randn(N, V, seed=seed, dtype=torch.float64), -1), \
        F.log_softmax(_randn(N, V, seed=seed + 1, scale=2.0, dtype=torch.float64), -1)


def test_jsd_endpoints_and_limits():
    logq, logp = _logs(4)
    fkl, rkl = divergence(logq, logp, "forward_kl"), divergence(logq, logp, "reverse_kl")
    assert (fkl > 0.05).all() and (rkl > 0.05).all() and not torch.allclose(fkl, rkl)
    # The GKD/TRL endpoints ...
    _close(divergence(logq, logp, "jsd", beta=0.0), fkl, rtol=1e-12, atol=0)
    _close(divergence(logq, logp, "jsd", beta=1.0), rkl, rtol=1e-12, atol=0)
    # ... are the limits of the scaled interior values.
    _close(divergence(logq, logp, "jsd", beta=1e-4) / 1e-4, fkl, rtol=1e-2, atol=0)
    _close(divergence(logq, logp, "jsd", beta=1 - 1e-4) / 1e-4, rkl, rtol=1e-2, atol=0)


def test_jsd_half_is_symmetric():
    logq, logp = _logs(5)
    _close(divergence(logq, logp, "jsd", beta=0.5), divergence(logp, logq, "jsd", beta=0.5), rtol=1e-12, atol=0)
    assert not torch.allclose(divergence(logq, logp, "jsd", beta=0.2), divergence(logp, logq, "jsd", beta=0.2))


def test_skew_alpha_zero_is_plain_kl():
    logq, logp = _logs(6)
    _close(divergence(logq, logp, "skew_kl", alpha=0.0), divergence(logq, logp, "forward_kl"), rtol=1e-12, atol=0)
    _close(divergence(logq, logp, "skew_reverse_kl", alpha=0.0), divergence(logq, logp, "reverse_kl"), rtol=1e-12,
           atol=0)


@pytest.mark.parametrize("loss", ["skew_kl", "skew_reverse_kl"])
def test_skew_alpha_one_is_zero(loss):
    # alpha = 1 mixes the reference distribution entirely into itself: KL(p || p) = KL(q || q) = 0, value and gradient.
    # Objective accepts alpha = 1.0 (it validates alpha in [0, 1]), so the divergence must be defined there.
    obj = Objective(loss=loss, alpha=1.0)
    zq, zp = _randn(6, 10, seed=6), _randn(6, 10, seed=7, scale=2.0)
    value = token_divergence(zq, zp, obj)
    grad = _grad(lambda z: token_divergence(z, zp, obj).sum(), zq)
    assert value.shape == (6,)  # one zero per row
    _close(value, torch.zeros(6), atol=1e-6)
    _close(grad, torch.zeros(6, 10), atol=1e-6)


# ------------------------------------------------------------------------------------------------------ 3. top-k


@pytest.mark.parametrize("source", ["teacher", "student"])
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("loss,beta,alpha", FIVE)
def test_topk_with_k_at_least_vocab_is_the_full_divergence(loss, beta, alpha, support, source):
    zq, zp = _randn(5, 9, seed=7), _randn(5, 9, seed=8, scale=2.5)
    full = token_divergence(zq, zp, Objective(loss=loss, beta=beta, alpha=alpha))
    for k in (9, 20):
        obj = Objective(loss=loss, beta=beta, alpha=alpha, top_k=k, top_k_source=source, top_k_support=support)
        _close(token_divergence(zq, zp, obj), full, atol=2e-6)


@pytest.mark.parametrize("source", ["teacher", "student"])
@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("loss,beta,alpha", FIVE)
def test_topk_matches_explicit_reference_table(loss, beta, alpha, support, source):
    V, k = 12, 4
    zq, zp = _randn(6, V, seed=11), _randn(6, V, seed=12, scale=2.0)
    obj = Objective(loss=loss, beta=beta, alpha=alpha, top_k=k, top_k_source=source, top_k_support=support)
    got = token_divergence(zq, zp, obj)
    ref, full = [], []
    for a, b in zip(zq.tolist(), zp.tolist()):
        q, p = _softmax_py(a), _softmax_py(b)
        qk, pk = _topk_tables(q, p, _top_indices(p if source == "teacher" else q, k), support)
        ref.append(_ref_div(qk, pk, loss, beta, alpha))
        full.append(_ref_div(q, p, loss, beta, alpha))
    _close(got, ref, rtol=1e-4, atol=1e-5)
    if support == "tail":  # an exact divergence of a coarse-graining: data processing inequality
        ref, full = torch.tensor(ref), torch.tensor(full)
        assert (ref <= full + 1e-12).all() and (got.double() <= full + 1e-5).all()
        assert (ref < full - 1e-3).any()  # and the bound is not vacuous here


@pytest.mark.parametrize("support", ["tail", "renormalize"])
@pytest.mark.parametrize("loss,beta,alpha", FIVE)
def test_topk_gradient_matches_reference_table(loss, beta, alpha, support):
    V, k = 10, 3
    zq, zp = _randn(4, V, seed=13), _randn(4, V, seed=14, scale=2.0)
    obj = Objective(loss=loss, beta=beta, alpha=alpha, top_k=k, top_k_support=support)
    g = _grad(lambda z: token_divergence(z, zp, obj).sum(), zq)
    idx = zp.double().topk(k, -1).indices

    def ref(z64):
        q, p = _softmax_t(z64), _softmax_t(zp.double())
        out = 0.0
        for n in range(z64.shape[0]):
            qk, pk = _topk_tables(list(q[n]), list(p[n]), idx[n].tolist(), support)
            out = out + _ref_div(qk, pk, loss, beta, alpha, torch.log)
        return out

    _close(g, _grad(ref, zq.double()), rtol=1e-4, atol=1e-6)


def test_topk_log_probs_shapes_and_unknown_support():
    logq = F.log_softmax(_randn(3, 8, seed=15), -1)
    logp = F.log_softmax(_randn(3, 8, seed=16), -1)
    idx = logp.topk(3, -1).indices
    lq, lp = topk_log_probs(logq, logp.gather(-1, idx), idx, "tail")
    assert lq.shape == lp.shape == (3, 4)
    _close(lq.exp().sum(-1), torch.ones(3))
    _close(lp.exp().sum(-1), torch.ones(3))
    with pytest.raises(ValueError, match="top_k_support"):
        topk_log_probs(logq, logp.gather(-1, idx), idx, "bogus")


# --------------------------------------------------------------------------------------- 4. stop-gradient top-k


def _stopgrad_case(k, V=10, seed=17):
    zq, zp = _randn(5, V, seed=seed), _randn(5, V, seed=seed + 1, scale=2.0)
    naive = Objective(loss="reverse_kl", top_k=k, top_k_support="truncate")
    sg = Objective(loss="reverse_kl", top_k=k, top_k_support="truncate", top_k_stop_grad=True)
    return zq, zp, naive, sg


def test_stop_grad_topk_value_and_gradient():
    k = 3
    zq, zp, naive, sg = _stopgrad_case(k)
    _close(token_divergence(zq, zp, sg), token_divergence(zq, zp, naive), rtol=1e-6, atol=1e-7)
    g_sg = _grad(lambda z: token_divergence(z, zp, sg).sum(), zq)
    g_naive = _grad(lambda z: token_divergence(z, zp, naive).sum(), zq)
    # Explicit float64 formulas, grad_z q_i = q_i (onehot_i - q):
    #   stop-grad:  sum_{i in S} q_i (onehot_i - q) (log q_i - log p_i)
    #   bias:       sum_{i in S} q_i (onehot_i - q)            (= grad of the top-k mass sum_{i in S} q_i)
    q, p = _softmax_t(zq.double()), _softmax_t(zp.double())
    V = q.shape[1]
    expect_sg, expect_bias = torch.zeros_like(q), torch.zeros_like(q)
    for n in range(q.shape[0]):
        for i in zp[n].double().topk(k).indices.tolist():
            grad_qi = q[n, i] * (torch.eye(V, dtype=torch.float64)[i] - q[n])
            expect_sg[n] += grad_qi * (q[n, i].log() - p[n, i].log())
            expect_bias[n] += grad_qi
    _close(g_sg, expect_sg, rtol=1e-4, atol=1e-6)
    _close(g_naive - g_sg, expect_bias, rtol=1e-4, atol=1e-6)
    assert expect_bias.abs().max() > 1e-2  # the bias is real at k < V


def test_stop_grad_topk_at_full_vocab_has_the_naive_gradient():
    zq, zp, naive, sg = _stopgrad_case(10)
    g_sg = _grad(lambda z: token_divergence(z, zp, sg).sum(), zq)
    _close(g_sg, _grad(lambda z: token_divergence(z, zp, naive).sum(), zq), atol=1e-6)
    _close(g_sg, _grad(lambda z: _ref_rows_t(z, zp.double(), "reverse_kl").sum(), zq.double()), rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------------------------- 5. gradients


@pytest.mark.parametrize("loss,beta,alpha", CASES)
def test_gradient_matches_float64_reference(loss, beta, alpha):
    zq = _randn(4, 7, seed=21).requires_grad_(True)
    zp = _randn(4, 7, seed=22, scale=2.0).requires_grad_(True)
    w = torch.tensor([1.0, -0.5, 2.0, 0.3])
    (token_divergence(zq, zp, Objective(loss=loss, beta=beta, alpha=alpha)) * w).sum().backward()
    ref = _grad(lambda z: (_ref_rows_t(z, zp.detach().double(), loss, beta, alpha) * w.double()).sum(),
                zq.detach().double())
    _close(zq.grad, ref, rtol=1e-4, atol=1e-6)
    assert zp.grad is None or not zp.grad.any()  # the teacher is never differentiated


# ------------------------------------------------------------------------------------ 6. the chunked objective


CHUNK_OBJECTIVES = [
    Objective(loss="reverse_kl"),
    Objective(loss="jsd", beta=0.3, top_k=4),
    Objective(loss="forward_kl", top_k=5, top_k_source="student", top_k_support="renormalize"),
    Objective(loss="reverse_kl", top_k=3, top_k_support="truncate", top_k_stop_grad=True),
    Objective(loss="skew_reverse_kl", alpha=0.2, temperature=2.0),
]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("obj", CHUNK_OBJECTIVES, ids=lambda o: f"{o.loss}-k{o.top_k}")
def test_chunked_equals_unchunked(obj, chunk_size):
    s, t, mask = _batch()
    hs = s.clone().requires_grad_(True)
    res = chunked_objective(hs, t, ID, ID, mask, obj, chunk_size=chunk_size)
    res.loss.backward()
    hd = s.clone().requires_grad_(True)
    direct = _direct(hd, t, mask, obj)
    direct.backward()
    _close(res.loss, direct, rtol=1e-6, atol=1e-7)
    _close(hs.grad, hd.grad, rtol=1e-5, atol=1e-8)
    div = token_divergence(s.flatten(0, 1), t.flatten(0, 1), obj).view(mask.shape)
    _close(res.loss_sum_B, (div * mask).sum(-1), rtol=1e-6, atol=1e-7)
    assert res.tokens_B.tolist() == [5.0, 0.0, 6.0]


@pytest.mark.parametrize("obj", [Objective(loss="jsd", top_k=4), Objective(loss="sampled_token")],
                         ids=lambda o: o.loss)
def test_masked_positions_contribute_nothing(obj):
    s, t, mask = _batch()
    tokens = _on_policy_tokens(s)
    g = torch.Generator().manual_seed(5)
    off = mask == 0
    s2, t2 = s.clone(), t.clone()
    s2[off] += 300.0 * torch.randn(s2[off].shape, generator=g)
    t2[off] -= 300.0 * torch.randn(t2[off].shape, generator=g)
    tokens2 = TokenInputs(tokens.targets_B_T.masked_fill(off, 0), tokens.logq_behaviour_B_T.masked_fill(off, -7.0),
                          tokens.logq_old_B_T.masked_fill(off, -9.0))
    grads, results = [], []
    for hs, ht, tok in ((s, t, tokens), (s2, t2, tokens2)):
        hs = hs.clone().requires_grad_(True)
        res = chunked_objective(hs, ht, ID, ID, mask, obj, tokens=tok, chunk_size=3)
        res.loss.backward()
        grads.append(hs.grad)
        results.append(res)
    _close(results[1].loss, results[0].loss, rtol=1e-6, atol=1e-7)
    _close(results[1].loss_sum_B, results[0].loss_sum_B, rtol=1e-6, atol=1e-7)
    _close(results[1].reverse_kl_sum_B, results[0].reverse_kl_sum_B, rtol=1e-6, atol=1e-7)
    _close(grads[1], grads[0], rtol=1e-6, atol=1e-9)
    assert not grads[1][off].any()


def test_normalizer_and_weights_scale_as_documented():
    s, t, mask = _batch()
    obj = Objective(loss="forward_kl")
    base = chunked_objective(s, t, ID, ID, mask, obj, chunk_size=2)
    assert base.loss.item() == pytest.approx(base.loss_sum_B.sum().item() / 11.0, rel=1e-6)
    w = torch.tensor([0.5, 3.0, 2.0])
    hs = s.clone().requires_grad_(True)
    res = chunked_objective(hs, t, ID, ID, mask, obj, weight_B=w, chunk_size=2, normalizer=4.0)
    res.loss.backward()
    assert res.loss.item() == pytest.approx((w * base.loss_sum_B).sum().item() / 4.0, rel=1e-6)
    _close(res.loss_sum_B, base.loss_sum_B, rtol=1e-7, atol=0)  # the per-sequence sums are unweighted
    g_base = _grad(lambda h: chunked_objective(h, t, ID, ID, mask, obj, chunk_size=2).loss, s)
    _close(hs.grad, g_base * (11.0 / 4.0) * w[:, None, None], rtol=1e-5, atol=1e-9)
    # No masked position at all: a zero loss, not a division by zero.
    empty = chunked_objective(s, t, ID, ID, torch.zeros_like(mask), obj)
    assert empty.loss.item() == 0.0 and empty.tokens_B.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("obj", CHUNK_OBJECTIVES + [Objective(loss="sampled_token", temperature=0.5)],
                         ids=lambda o: f"{o.loss}-k{o.top_k}-T{o.temperature}")
def test_reverse_kl_sum_is_the_full_reverse_kl_whatever_the_objective(obj):
    s, t, mask = _batch()
    tokens = _on_policy_tokens(s, temperature=obj.temperature) if obj.policy_gradient else None
    res = chunked_objective(s, t, ID, ID, mask, obj, tokens=tokens, chunk_size=4)
    rkl = _ref_rows(s.flatten(0, 1), t.flatten(0, 1), "reverse_kl", temperature=obj.temperature).view(mask.shape)
    _close(res.reverse_kl_sum_B, (rkl * mask).sum(-1), rtol=1e-5, atol=1e-6)
    assert not res.reverse_kl_sum_B.requires_grad and not res.loss_sum_B.requires_grad


def rng_state_calls(monkeypatch) -> list[str]:
    """Record every save or restore of torch's global CPU RNG state (what ``torch.utils.checkpoint`` does around a
    recomputation when asked to preserve it)."""
    calls: list[str] = []
    for name in ("get_rng_state", "set_rng_state"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def test_the_chunked_backward_leaves_the_global_rng_alone(monkeypatch):
    """The loss chunks draw no random numbers, so their recomputation must not save and restore torch's global RNG:
    a restore during backward rewinds the draws an overlapped rollout thread (opd.overlap_generation) made meanwhile,
    which made merges with overlap non-reproducible (and their resume differ from an uninterrupted run)."""
    s, t, mask = _batch()
    hs = s.clone().requires_grad_(True)
    calls = rng_state_calls(monkeypatch)
    chunked_objective(hs, t, ID, ID, mask, Objective(loss="reverse_kl"), chunk_size=2).loss.backward()
    assert hs.grad.abs().sum() > 0  # the recomputation ran
    assert calls == []


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_chunked_with_linear_heads(chunk_size):
    B, T, H, Ht, V = 3, 7, 5, 9, 11
    torch.manual_seed(0)
    student_head, teacher_head = torch.nn.Linear(H, V), torch.nn.Linear(Ht, V)
    hs, ht = _randn(B, T, H, seed=31).requires_grad_(True), _randn(B, T, Ht, seed=32)
    _, _, mask = _batch()
    obj = Objective(loss="jsd", beta=0.4, top_k=4)
    res = chunked_objective(hs, ht, student_head, teacher_head, mask, obj, chunk_size=chunk_size)
    res.loss.backward()
    assert teacher_head.weight.grad is None and teacher_head.bias.grad is None
    g_h, g_w = hs.grad.clone(), student_head.weight.grad.clone()
    hs.grad, student_head.weight.grad = None, None
    _direct(student_head(hs), teacher_head(ht), mask, obj).backward()
    _close(g_h, hs.grad, rtol=1e-5, atol=1e-8)
    _close(g_w, student_head.weight.grad, rtol=1e-5, atol=1e-8)
    assert g_w.abs().sum() > 0 and teacher_head.weight.grad is None


# ------------------------------------------------------------------------------------------------ 7. temperature


@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("loss,beta,alpha", FIVE)
def test_temperature_divides_both_sides(loss, beta, alpha, temperature):
    zq, zp = _randn(5, 9, seed=41), _randn(5, 9, seed=42, scale=2.0)
    got = token_divergence(zq, zp, Objective(loss=loss, beta=beta, alpha=alpha, temperature=temperature))
    _close(got, _ref_rows(zq, zp, loss, beta, alpha, temperature=temperature), rtol=1e-5, atol=1e-6)
    _close(got, token_divergence(zq / temperature, zp / temperature, Objective(loss=loss, beta=beta, alpha=alpha)))
    top = Objective(loss=loss, beta=beta, alpha=alpha, temperature=temperature, top_k=3)
    _close(token_divergence(zq, zp, top), token_divergence(zq / temperature, zp / temperature,
                                                           Objective(loss=loss, beta=beta, alpha=alpha, top_k=3)))


def test_sample_temperature_leaves_full_losses_alone():
    s, t, mask = _batch()
    out = []
    for ts in (1.0, 3.0):
        obj = Objective(loss="jsd", temperature=1.5, sample_temperature=ts)
        hs = s.clone().requires_grad_(True)
        res = chunked_objective(hs, t, ID, ID, mask, obj, chunk_size=3)
        res.loss.backward()
        out.append((res.loss, hs.grad))
    assert out[0][0].item() == out[1][0].item() and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("temperature,sample_temperature", [(1.0, 1.0), (2.0, 1.0), (1.0, 0.7), (0.5, 1.5)])
def test_sampled_token_temperatures(temperature, sample_temperature):
    """The ratio q_theta(x) / q_beh(x) is taken at the sampling temperature, the advantage log p(x) - log q_old(x) at
    the divergence temperature; checked off-policy (clip active) against a float64 re-derivation."""
    s, t, mask = _batch()
    g = torch.Generator().manual_seed(43)
    on = _on_policy_tokens(s, seed=1, sample_temperature=sample_temperature, temperature=temperature)
    stale = on.logq_behaviour_B_T + 0.4 * torch.randn(mask.shape, generator=g)  # a stale behaviour policy
    tokens = TokenInputs(on.targets_B_T, stale, on.logq_old_B_T)
    obj = Objective(loss="sampled_token", temperature=temperature, sample_temperature=sample_temperature)
    hs = s.clone().requires_grad_(True)
    res = chunked_objective(hs, t, ID, ID, mask, obj, tokens=tokens, chunk_size=2)
    res.loss.backward()

    x = tokens.targets_B_T[..., None]

    def ref(h64):
        logq_x = torch.log(_softmax_t(h64 / sample_temperature)).gather(-1, x).squeeze(-1)
        logp_x = torch.log(_softmax_t(t.double() / temperature)).gather(-1, x).squeeze(-1)
        adv = logp_x - tokens.logq_old_B_T.double()
        r = torch.exp(logq_x - stale.double())
        per_tok = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
        return (per_tok * mask).sum() / mask.sum()

    assert res.loss.item() == pytest.approx(ref(s.double()).item(), rel=1e-5)
    _close(hs.grad, _grad(ref, s.double()), rtol=1e-4, atol=1e-7)
    # On-policy the ratio is 1, so the value is minus the advantage whatever the sampling temperature.
    res_on = chunked_objective(s, t, ID, ID, mask, obj, tokens=on)
    logp = F.log_softmax(t / temperature, -1).gather(-1, x).squeeze(-1)
    _close(res_on.loss_sum_B, ((on.logq_old_B_T - logp) * mask).sum(-1), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------- 8. policy gradient


@pytest.mark.parametrize("correction", ["clip", "truncate", "none"])
def test_policy_gradient_on_policy_is_minus_advantage_times_score(correction):
    z = _randn(6, 5, seed=51)
    x = torch.tensor([0, 4, 2, 2, 1, 3])
    adv = torch.tensor([1.0, -2.0, 0.5, -0.1, 3.0, 0.0])

    def loss(zz):
        logq = F.log_softmax(zz, -1).gather(-1, x[:, None]).squeeze(-1)
        out = policy_gradient_loss(logq, logq.detach(), adv, correction, clip_eps=0.2, ratio_cap=2.0)
        _close(out, -adv, atol=1e-7)
        return out.sum()

    q = torch.softmax(z.double(), -1)
    expected = -adv.double()[:, None] * (F.one_hot(x, 5).double() - q)  # -a * grad_z log q(x)
    _close(_grad(loss, z), expected, rtol=1e-5, atol=1e-7)


def _pg(logq_old, logq, adv, correction):
    logq = torch.tensor(logq, dtype=torch.float64, requires_grad=True)
    f64 = dict(dtype=torch.float64)
    out = policy_gradient_loss(logq, torch.tensor(logq_old, **f64), torch.tensor(adv, **f64), correction,
                               clip_eps=0.2, ratio_cap=2.0)
    out.sum().backward()
    return out.detach(), logq.grad


def test_policy_gradient_clip_hand_computed():
    # Ratios r = exp(logq - logq_old) = 1.5, 1.5, 0.5, 0.5, 1.1 with advantages +1, -1, +1, -1, +2 and eps = 0.2:
    #   loss = -min(r a, clip(r, 0.8, 1.2) a)
    #   r=1.5, a=+1: -min(1.5, 1.2) = -1.2   clipped    -> d/dlogq = 0
    #   r=1.5, a=-1: -min(-1.5, -1.2) = 1.5  unclipped  -> d/dlogq = -r a = 1.5
    #   r=0.5, a=+1: -min(0.5, 0.8) = -0.5   unclipped  -> d/dlogq = -0.5
    #   r=0.5, a=-1: -min(-0.5, -0.8) = 0.8  clipped    -> d/dlogq = 0
    #   r=1.1, a=+2: -2.2 inside the trust region       -> d/dlogq = -2.2
    r = [1.5, 1.5, 0.5, 0.5, 1.1]
    old = [-1.0, -2.0, -0.5, -3.0, -1.5]
    value, grad = _pg(old, [o + math.log(x) for o, x in zip(old, r)], [1.0, -1.0, 1.0, -1.0, 2.0], "clip")
    _close(value, [-1.2, 1.5, -0.5, 0.8, -2.2], rtol=1e-12, atol=1e-12)
    _close(grad, [0.0, 1.5, -0.5, 0.0, -2.2], rtol=1e-12, atol=1e-12)


def test_policy_gradient_truncate_and_none_hand_computed():
    # truncate, cap = 2: r = 3, a = 0.7 -> value -cap a = -1.4, d/dlogq = -cap a = -1.4 (the ratio's own 3 is cut);
    #                    r = 0.5, a = -2 -> value -r a = 1.0, d/dlogq = -r a = 1.0 (below the cap: plain IS)
    old = [-2.0, -1.0]
    logq = [old[0] + math.log(3.0), old[1] + math.log(0.5)]
    value, grad = _pg(old, logq, [0.7, -2.0], "truncate")
    _close(value, [-1.4, 1.0], rtol=1e-12, atol=1e-12)
    _close(grad, [-1.4, 1.0], rtol=1e-12, atol=1e-12)
    # none: -r a and d/dlogq = -r a: r = 3, a = 0.7 -> -2.1; r = 0.5, a = -2 -> 1.0
    value, grad = _pg(old, logq, [0.7, -2.0], "none")
    _close(value, [-2.1, 1.0], rtol=1e-12, atol=1e-12)
    _close(grad, [-2.1, 1.0], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="correction"):
        policy_gradient_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), "bogus")


def test_advantage_is_detached():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    logq = torch.tensor([-1.5, -0.5], requires_grad=True)
    a = sampled_token_advantage(logp, logq)
    _close(a, [0.5, -1.5], atol=1e-7)
    assert not a.requires_grad


# ------------------------------------------------------------------------- 9. the sampled-token estimator (MC)


def test_sampled_token_estimator_is_unbiased():
    n, V = 200_000, 8
    zq, zp = _randn(V, seed=61), _randn(V, seed=62, scale=2.0)
    logq, logp = F.log_softmax(zq.double(), -1), F.log_softmax(zp.double(), -1)
    q = logq.exp()
    kl_qp = float((q * (logq - logp)).sum())
    x = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(63))

    # The value: -a = log q(x) - log p(x) is an unbiased one-sample estimate of KL(q || p).
    est = -sampled_token_advantage(logp[x], logq[x])
    se = float(est.std()) / math.sqrt(n)
    assert abs(float(est.mean()) - kl_qp) < 5 * se, (float(est.mean()), kl_qp, se)

    # The gradient: n sequences of one on-policy token each; loss = mean, so the per-sample gradient is n * grad.
    hs = zq.expand(n, 1, V).clone().requires_grad_(True)
    logq32 = F.log_softmax(zq, -1)[x][:, None]
    tokens = TokenInputs(x[:, None], logq32, logq32)
    res = chunked_objective(hs, zp.expand(n, 1, V), ID, ID, torch.ones(n, 1), Objective(loss="sampled_token"),
                            tokens=tokens, chunk_size=1)
    res.loss.backward()
    per_sample = hs.grad[:, 0].double() * n
    analytic = q * (logq - logp - kl_qp)  # grad_z KL(q || p)
    tol = 5 * per_sample.std(0) / math.sqrt(n) + 1e-6
    assert ((per_sample.mean(0) - analytic).abs() < tol).all(), (per_sample.mean(0), analytic, tol)
    assert res.loss.item() == pytest.approx(float(est.mean()), rel=1e-4)  # on-policy value: mean of -a


# --------------------------------------------------------------------------------------------- 10. validation


@pytest.mark.parametrize("kwargs,field", [
    (dict(loss="kl"), "loss"),
    (dict(loss="jsd", beta=-0.1), "beta"),
    (dict(loss="jsd", beta=1.5), "beta"),
    (dict(loss="skew_kl", alpha=-0.01), "alpha"),
    (dict(loss="skew_kl", alpha=1.01), "alpha"),
    (dict(top_k=-1), "top_k"),
    (dict(loss="forward_kl", top_k=4, top_k_stop_grad=True), "top_k_stop_grad"),
    (dict(loss="sampled_token", top_k=4), "top_k"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(sample_temperature=0.0), "temperature"),
    (dict(sample_temperature=-2.0), "temperature"),
])
def test_objective_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        Objective(**kwargs)


def test_objective_accepts_the_edges_and_is_frozen():
    for obj in (Objective(loss="jsd", beta=0.0), Objective(loss="jsd", beta=1.0), Objective(loss="skew_kl", alpha=1.0),
                Objective(loss="reverse_kl", top_k=3, top_k_stop_grad=True), Objective(loss="sampled_token")):
        assert obj.policy_gradient == (obj.loss == "sampled_token")
    with pytest.raises(Exception):
        Objective().loss = "jsd"
    with pytest.raises(ValueError, match="sampled_token"):
        divergence(torch.zeros(1, 2), torch.zeros(1, 2), "sampled_token")


def test_chunked_objective_input_errors():
    s, t, mask = _batch()
    with pytest.raises(ValueError, match="TokenInputs"):
        chunked_objective(s, t, ID, ID, mask, Objective(loss="sampled_token"))
    with pytest.raises(ValueError, match="TokenInputs"):
        chunked_objective(s, t, ID, ID, mask, Objective(), seq_adv_B=torch.ones(3))
    with pytest.raises(ValueError, match="shape mismatch"):
        chunked_objective(s, t, ID, ID, mask[:, :-1], Objective())
    with pytest.raises(ValueError, match="shape mismatch"):
        chunked_objective(s, t[:2], ID, ID, mask, Objective())
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_objective(s, t, ID, ID, mask, Objective(), chunk_size=0)


# --------------------------------------------------------------------------------------- 11. reward (GKD + RL)


@pytest.mark.parametrize("normalizer", [None, 4.0])
@pytest.mark.parametrize("loss,beta,alpha", [("reverse_kl", 0.5, 0.1), ("jsd", 0.3, 0.1), ("sampled_token", 0.5, 0.1)])
def test_sequence_reward_adds_the_policy_gradient_term(loss, beta, alpha, normalizer):
    s, t, mask = _batch()
    tokens = _on_policy_tokens(s, seed=2)
    seq_adv = torch.tensor([0.7, -1.3, 2.0])
    obj = Objective(loss=loss, beta=beta, alpha=alpha)
    hs = s.clone().requires_grad_(True)
    res = chunked_objective(hs, t, ID, ID, mask, obj, tokens=tokens, seq_adv_B=seq_adv, chunk_size=3,
                            normalizer=normalizer)
    res.loss.backward()
    denom = float(mask.sum()) if normalizer is None else normalizer
    x = tokens.targets_B_T[..., None]
    logp_x = torch.log(_softmax_t(t.double())).gather(-1, x).squeeze(-1)
    token_adv = (logp_x - tokens.logq_old_B_T.double()) if loss == "sampled_token" else torch.zeros_like(logp_x)

    def ref(h64):
        # divergence part (explicit tables) + on-policy policy-gradient part: value -a, gradient -a grad log q(x)
        div = 0.0 if loss == "sampled_token" else _ref_rows_t(h64.flatten(0, 1), t.double().flatten(0, 1), loss, beta,
                                                              alpha).view(mask.shape)
        logq_x = torch.log(_softmax_t(h64)).gather(-1, x).squeeze(-1)
        adv = seq_adv.double()[:, None] + token_adv
        pg = -adv * torch.exp(logq_x - logq_x.detach())
        return ((div + pg) * mask).sum() / denom

    assert res.loss.item() == pytest.approx(ref(s.double()).item(), rel=1e-5, abs=1e-6)
    _close(hs.grad, _grad(ref, s.double()), rtol=1e-4, atol=1e-7)
    # And it really is an addition: the reward-free loss differs by exactly the policy-gradient term.
    base = chunked_objective(s, t, ID, ID, mask, obj, tokens=tokens, chunk_size=3, normalizer=normalizer)
    assert res.loss.item() - base.loss.item() == pytest.approx(-(seq_adv * mask.sum(-1)).sum().item() / denom,
                                                               rel=1e-5)


def test_non_finite_log_probs_at_masked_positions_do_not_poison_the_gradient():
    # Padding positions may carry -inf behaviour log-probs; they are masked, so loss and gradient stay finite.
    B, T, V = 2, 5, 7
    zs, zt = _randn(B, T, V, seed=40), _randn(B, T, V, seed=41)
    zs = zs.float().requires_grad_(True)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    logq = torch.log_softmax(zs.detach(), -1).gather(-1, targets[..., None]).squeeze(-1)
    logq[1, 3:] = float("-inf")
    res = chunked_objective(zs, zt.float(), ID, ID, mask, Objective(loss="sampled_token"),
                            tokens=TokenInputs(targets, logq, logq), chunk_size=2)
    res.loss.backward()
    assert torch.isfinite(res.loss) and torch.isfinite(zs.grad).all()
    assert zs.grad[1, 3:].abs().sum() == 0


# ------------------------------------------------------------------ per-token diagnostics
def test_token_diagnostics_hand_computed():
    from tasks.objectives.losses import token_diagnostics

    logq = torch.log_softmax(torch.zeros(1, 4), -1)  # uniform over 4: entropy log 4
    logp = torch.log_softmax(torch.tensor([[0.0, 0.0, -60.0, -60.0]]), -1)  # two tokens at 1/2: entropy log 2
    d = token_diagnostics(logq, logp, torch.tensor([1]))
    _close(d[0, 0], torch.tensor(math.log(4)), rtol=1e-6, atol=1e-6)
    _close(d[0, 1], torch.tensor(math.log(2)), rtol=1e-6, atol=1e-6)
    _close(d[0, 2], torch.tensor(math.log(2)), rtol=1e-6, atol=1e-6)  # -log p(token 1) = log 2
    assert d[0, 3] == 1.0  # V = 4 < 8: both top sets are the whole vocabulary
    # V = 10: the student's top 8 are tokens 2..9, the teacher's 0..7: they share 2..7, 6 of 8.
    logq = torch.log_softmax(torch.arange(10.0)[None], -1)
    logp = torch.log_softmax(-torch.arange(10.0)[None], -1)
    d = token_diagnostics(logq, logp, None)
    assert d[0, 3] == pytest.approx(0.75) and d[0, 2] == 0.0


def test_chunked_objective_sums_the_diagnostics_over_masked_tokens():
    from tasks.objectives.losses import token_diagnostics

    g = torch.Generator().manual_seed(5)
    B, T, H, V = 2, 7, 6, 12
    hs = torch.randn(B, T, H, generator=g)
    ht = torch.randn(B, T, H, generator=g)
    head_s, head_t = torch.nn.Linear(H, V), torch.nn.Linear(H, V)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]], dtype=torch.float32)
    targets = torch.randint(V, (B, T), generator=g)
    res = chunked_objective(hs, ht, head_s, head_t, mask, Objective(), chunk_size=3, targets_B_T=targets)
    with torch.no_grad():
        d = token_diagnostics(torch.log_softmax(head_s(hs), -1).flatten(0, 1),
                              torch.log_softmax(head_t(ht), -1).flatten(0, 1), targets.flatten()).view(B, T, 4)
    _close(res.diagnostics_B_4, (d * mask[..., None]).sum(1), rtol=1e-5, atol=1e-6)


def test_extrapolated_head_is_the_teacher_at_scale_one_and_the_reward_optimum_beyond():
    from tasks.objectives.losses import ExtrapolatedHead

    g = torch.Generator().manual_seed(11)
    Ht, Hr, V = 5, 3, 7
    head_t, head_r = torch.nn.Linear(Ht, V), torch.nn.Linear(Hr, V)
    h = torch.randn(4, Ht + Hr, generator=g)
    logp_t = torch.log_softmax(head_t(h[:, :Ht]), -1)
    logp_r = torch.log_softmax(head_r(h[:, Ht:]), -1)
    with torch.no_grad():
        one = torch.log_softmax(ExtrapolatedHead(head_t, head_r, Ht, 1.0)(h), -1)
        two = torch.log_softmax(ExtrapolatedHead(head_t, head_r, Ht, 2.0)(h), -1)
    _close(one, logp_t.detach(), rtol=1e-6, atol=1e-6)
    # scale 2: pi ∝ p_r (p_t / p_r)^2 = p_t^2 / p_r, normalised (computed by hand in float64).
    ref = (2 * logp_t.double() - logp_r.double())
    _close(two.double(), ref - torch.logsumexp(ref, -1, keepdim=True), rtol=1e-6, atol=1e-6)
    # It maximises  scale * E_pi[log p_t - log p_r] - KL(pi || p_r): any other distribution scores lower.
    def objective(logpi):
        pi = logpi.exp()
        return (2 * (pi * (logp_t - logp_r)).sum(-1) - (pi * (logpi - logp_r)).sum(-1)).detach()
    other = torch.log_softmax(two + 0.3 * torch.randn(two.shape, generator=g), -1)
    assert bool((objective(two) > objective(other)).all())


def test_sft_loss_is_the_target_tokens_cross_entropy_by_hand():
    # One sequence, V = 3, three positions; the last is masked out. Student logits [0, 0, ln 2] at every position:
    # probabilities [1/4, 1/4, 1/2]. Targets 2, 0 (and 1, masked): -log(1/2) = ln 2, -log(1/4) = 2 ln 2; mean 1.5 ln 2.
    V = 3
    logits = torch.tensor([0.0, 0.0, math.log(2.0)])
    head_s = torch.nn.Linear(V, V, bias=False)
    head_t = torch.nn.Linear(V, V, bias=False)
    with torch.no_grad():
        head_s.weight.copy_(torch.eye(V))
        head_t.weight.copy_(torch.eye(V))
    hs_B_T_H = logits.expand(1, 3, V).clone().requires_grad_(True)
    ht_B_T_H = torch.randn(1, 3, V)  # the teacher plays no part in the loss value
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0]])
    targets_B_T = torch.tensor([[2, 0, 1]])
    res = chunked_objective(hs_B_T_H, ht_B_T_H, head_s, head_t, mask_B_T, Objective(loss="sft"), chunk_size=2,
                            targets_B_T=targets_B_T)
    assert res.loss.item() == pytest.approx(1.5 * math.log(2.0), abs=1e-6)
    res.loss.backward()
    # d/dz of -log softmax(z)[y] = softmax(z) - onehot(y), divided by the 2 masked tokens; the masked position gets 0.
    p = torch.tensor([0.25, 0.25, 0.5])
    expected = torch.stack([(p - torch.tensor([0.0, 0.0, 1.0])) / 2, (p - torch.tensor([1.0, 0.0, 0.0])) / 2,
                            torch.zeros(V)])
    _close(hs_B_T_H.grad[0], expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="target tokens"):
        chunked_objective(hs_B_T_H, ht_B_T_H, head_s, head_t, mask_B_T, Objective(loss="sft"))
    with pytest.raises(ValueError, match="top_k does not apply"):
        Objective(loss="sft", top_k=2)


def test_sft_needs_off_policy_batches_in_the_config():
    from tasks.config import OPDConfig

    with pytest.raises(ValueError, match="set lmbda = 0"):
        OPDConfig(loss="sft")
    assert OPDConfig(loss="sft", lmbda=0.0).objective().loss == "sft"
    assert OPDConfig(cold_start_loss="sft", cold_start_steps=10).cold_start_objective().loss == "sft"
    with pytest.raises(ValueError, match="teacher_backend 'hf'"):
        OPDConfig(reward_scale=1.5, teacher_backend="vllm")
    OPDConfig(reward_scale=1.5, nproc=2, batch_size=4)  # ExOPD with a sharded student: allowed (tests/test_sharded.py)


# ------------------------------------------------------- 12. defaults, messages and edge cases (mutation testing)
# Each test below pins something `make mutation` showed no other test checked.


def test_defaults_are_the_documented_ones():
    # divergence(): beta = 1/2 and alpha = 0.1 by default (the two-category values of the hand-computed test above).
    logq = torch.tensor([[0.5, 0.5]], dtype=torch.float64).log()
    logp = torch.tensor([[0.25, 0.75]], dtype=torch.float64).log()
    assert divergence(logq, logp, "jsd").item() == pytest.approx(0.033822075568605, abs=1e-14)
    # alpha = 0.1: m = 0.1 p + 0.9 q = (0.475, 0.525); KL(p || m) = 1/4 ln(0.25/0.475) + 3/4 ln(0.75/0.525)
    skl = 0.25 * math.log(0.25 / 0.475) + 0.75 * math.log(0.75 / 0.525)
    assert divergence(logq, logp, "skew_kl").item() == pytest.approx(skl, abs=1e-14)
    # m = 0.1 q + 0.9 p = (0.275, 0.725); KL(q || m) = 1/2 ln(0.5/0.275) + 1/2 ln(0.5/0.725)
    srkl = 0.5 * math.log(0.5 / 0.275) + 0.5 * math.log(0.5 / 0.725)
    assert divergence(logq, logp, "skew_reverse_kl").item() == pytest.approx(srkl, abs=1e-14)
    # stop_grad is off by default: on a sub-distribution (a truncated top-k support) the plain KL gradient, which
    # differs there from the stop-gradient surrogate's.
    zq, zp = _randn(4, 9, seed=70), _randn(4, 9, seed=71, scale=2.0)
    idx = zp.topk(3, -1).indices
    logp_k = F.log_softmax(zp, -1).gather(-1, idx)

    def rkl_k(z, **kw):
        return divergence(F.log_softmax(z, -1).gather(-1, idx), logp_k, "reverse_kl", **kw).sum()

    g_default = _grad(rkl_k, zq)
    _close(g_default, _grad(lambda z: kl(F.log_softmax(z, -1).gather(-1, idx), logp_k).sum(), zq), atol=1e-7)
    assert (g_default - _grad(lambda z: rkl_k(z, stop_grad=True), zq)).abs().max() > 1e-2
    # topk_log_probs(): the tail bucket by default.
    logq_v = F.log_softmax(zq, -1)
    got, want = topk_log_probs(logq_v, logp_k, idx), topk_log_probs(logq_v, logp_k, idx, "tail")
    assert got[0].shape == got[1].shape == (4, 4)
    _close(got[0], want[0], rtol=0, atol=0)
    _close(got[1], want[1], rtol=0, atol=0)
    # policy_gradient_loss(): PPO clipping with eps = 0.2 by default (ratios 1.5 and 0.5 clip to 1.2 and 0.8) ...
    old = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    logq_x = old + torch.tensor([1.5, 0.5], dtype=torch.float64).log()
    _close(policy_gradient_loss(logq_x, old, torch.tensor([1.0, -1.0], dtype=torch.float64)), [-1.2, 0.8], rtol=1e-12)
    # ... and a truncation cap of 2 (ratio 3 -> 2): -2 * 0.7.
    logq_3 = old + math.log(3.0)
    _close(policy_gradient_loss(logq_3, old, torch.tensor([0.7, 0.7], dtype=torch.float64), "truncate"),
           [-1.4, -1.4], rtol=1e-12)


def test_error_messages_list_the_known_choices():
    z = torch.zeros(1, 3)
    with pytest.raises(ValueError) as e:
        divergence(z, z, "sampled_token")
    assert str(e.value) == ("'sampled_token' is not a full-distribution divergence; "
                            "known: ['reverse_kl', 'forward_kl', 'jsd', 'skew_kl', 'skew_reverse_kl']")
    with pytest.raises(ValueError) as e:
        topk_log_probs(z, z[:, :1], torch.zeros(1, 1, dtype=torch.long), "bogus")
    assert str(e.value) == "unknown top_k_support 'bogus'; known: ['tail', 'renormalize', 'truncate']"
    with pytest.raises(ValueError) as e:
        policy_gradient_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), "bogus")
    assert str(e.value) == "unknown correction 'bogus'; known: ['clip', 'truncate', 'none']"
    s, t, mask = _batch()
    with pytest.raises(ValueError) as e:
        chunked_objective(s, t, ID, ID, mask, Objective(loss="sft"))
    assert str(e.value) == "loss 'sft' needs the target tokens (targets_B_T)"


def test_extrapolated_head_on_batched_hidden_states_in_the_chunked_objective():
    # The merge passes it as the teacher head of chunked_objective, which calls heads on [B, C, H] chunks: the
    # log-softmaxes are over the vocabulary, never over the positions.
    from tasks.objectives.losses import ExtrapolatedHead

    g = torch.Generator().manual_seed(12)
    B, T, Ht, Hr, V = 2, 5, 4, 3, 6
    head_t, head_r = torch.nn.Linear(Ht, V), torch.nn.Linear(Hr, V)
    head = ExtrapolatedHead(head_t, head_r, Ht, 1.5)
    h_B_T_H = torch.randn(B, T, Ht + Hr, generator=g)
    with torch.no_grad():
        ref = 1.5 * torch.log_softmax(head_t(h_B_T_H[..., :Ht]), -1) - 0.5 * torch.log_softmax(head_r(h_B_T_H[..., Ht:]), -1)
        _close(head(h_B_T_H), ref, rtol=1e-6, atol=1e-6)
        _close(head(h_B_T_H), head(h_B_T_H.flatten(0, 1)).view(B, T, V), rtol=1e-6, atol=1e-6)
    zs_B_T_V = _randn(B, T, V, seed=13)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.float32)
    res = chunked_objective(zs_B_T_V, h_B_T_H, ID, head, mask, Objective(loss="forward_kl"), chunk_size=3)
    _close(res.loss, _direct(zs_B_T_V, ref, mask, Objective(loss="forward_kl")), rtol=1e-5, atol=1e-6)


class _RecordingHead(torch.nn.Module):
    """An identity head that records the shape of every input it is called on."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return x


def test_default_chunk_is_64_positions_and_empty_chunks_are_skipped():
    # Peak memory is O(B * chunk_size * V): with the default chunk_size each head sees at most 64 positions at once.
    B, T, V = 2, 130, 5
    s, t = _randn(B, T, V, seed=80), _randn(B, T, V, seed=81)
    mask = torch.ones(B, T)
    head_s, head_t = _RecordingHead(), _RecordingHead()
    res = chunked_objective(s, t, head_s, head_t, mask, Objective())
    assert head_s.shapes == head_t.shapes == [(B, 64, V), (B, 64, V), (B, 2, V)]
    _close(res.loss, _direct(s, t, mask, Objective()), rtol=1e-6, atol=1e-7)
    # A chunk without a masked position is skipped, the chunks after it still count.
    mask = torch.zeros(B, 7)
    mask[:, 4:] = 1
    mask[1, 5] = 0
    s, t = s[:, :7], t[:, :7]
    head_s = _RecordingHead()
    res = chunked_objective(s, t, head_s, ID, mask, Objective(loss="jsd"), chunk_size=2)
    assert head_s.shapes == [(B, 2, V), (B, 1, V)]  # positions 4-5 and 6; 0-1 and 2-3 have nothing to score
    _close(res.loss, _direct(s, t, mask, Objective(loss="jsd")), rtol=1e-6, atol=1e-7)
    assert res.tokens_B.tolist() == [3.0, 2.0]


def test_a_single_token_and_no_token_at_all():
    s, t, _ = _batch()
    obj = Objective(loss="reverse_kl")
    one = torch.zeros(3, 7)
    one[2, 4] = 1.0
    res = chunked_objective(s, t, ID, ID, one, obj, chunk_size=3)
    # One masked token: the loss is that token's divergence (normalised by 1 token, not by a floor above it).
    _close(res.loss, token_divergence(s[2, 4][None], t[2, 4][None], obj)[0], rtol=1e-6, atol=0)
    # None: zero loss and zero per-sequence sums and diagnostics, each still one row per sequence.
    empty = chunked_objective(s, t, ID, ID, torch.zeros(3, 7), obj)
    assert empty.loss.item() == 0.0
    for x, shape in ((empty.loss_sum_B, (3,)), (empty.reverse_kl_sum_B, (3,)), (empty.tokens_B, (3,)),
                     (empty.diagnostics_B_4, (3, 4))):
        assert x.shape == shape and not x.any()


def test_integer_masks_and_float64_weights_give_the_float_results():
    # The rollout's masks are integer tensors and weights or rewards may come in float64: the objective computes in
    # the float32 of the mask it converts, with the same values as all-float32 inputs.
    s, t, mask = _batch()
    tokens = _on_policy_tokens(s, seed=3)
    w, adv = torch.tensor([0.5, 3.0, 2.0]), torch.tensor([0.7, -1.3, 2.0])
    obj = Objective(loss="jsd", beta=0.3)
    ref = chunked_objective(s, t, ID, ID, mask, obj, tokens=tokens, seq_adv_B=adv, weight_B=w, chunk_size=3)
    got = chunked_objective(s, t, ID, ID, mask.long(), obj, tokens=tokens, seq_adv_B=adv.double(),
                            weight_B=w.double(), chunk_size=3)
    for a, b in ((got.loss, ref.loss), (got.loss_sum_B, ref.loss_sum_B), (got.tokens_B, ref.tokens_B),
                 (got.reverse_kl_sum_B, ref.reverse_kl_sum_B), (got.diagnostics_B_4, ref.diagnostics_B_4)):
        assert a.dtype == torch.float32
        _close(a, b, rtol=1e-6, atol=1e-7)


def test_teacher_nll_diagnostic_reads_the_targets():
    s, t, mask = _batch()
    tokens = _on_policy_tokens(s, seed=4)
    other = (tokens.targets_B_T + 1) % s.shape[-1]

    def nll_sum(targets):
        nll = -F.log_softmax(t, -1).gather(-1, targets[..., None]).squeeze(-1)
        return (nll * mask).sum(-1)

    pg = Objective(loss="sampled_token")
    # Without targets_B_T the diagnostic uses the tokens' targets ...
    res = chunked_objective(s, t, ID, ID, mask, pg, tokens=tokens, chunk_size=3)
    _close(res.diagnostics_B_4[:, 2], nll_sum(tokens.targets_B_T), rtol=1e-5, atol=1e-6)
    # ... and an explicit targets_B_T wins over them.
    res = chunked_objective(s, t, ID, ID, mask, pg, tokens=tokens, chunk_size=3, targets_B_T=other)
    _close(res.diagnostics_B_4[:, 2], nll_sum(other), rtol=1e-5, atol=1e-6)
    assert (nll_sum(other) - nll_sum(tokens.targets_B_T)).abs().max() > 0.1


def test_chunked_truncated_importance_sampling_uses_the_objectives_cap():
    # Stale behaviour log-probs (ratio 3 at every position) under truncate with cap 1.3: every token's loss is
    # policy_gradient_loss with that cap, the advantage log p(x) - log q_old(x) at the sampled token.
    s, t, mask = _batch()
    fresh = _on_policy_tokens(s, seed=5)
    stale = TokenInputs(fresh.targets_B_T, fresh.logq_behaviour_B_T - math.log(3.0), fresh.logq_old_B_T)
    obj = Objective(loss="sampled_token", correction="truncate", ratio_cap=1.3)
    res = chunked_objective(s, t, ID, ID, mask, obj, tokens=stale, chunk_size=3)
    x = stale.targets_B_T[..., None]
    logq_x = F.log_softmax(s, -1).gather(-1, x).squeeze(-1)
    adv = F.log_softmax(t, -1).gather(-1, x).squeeze(-1) - stale.logq_old_B_T
    per_tok = policy_gradient_loss(logq_x, stale.logq_behaviour_B_T, adv, "truncate", ratio_cap=1.3)
    _close(per_tok, -1.3 * adv, rtol=1e-5, atol=1e-6)  # the cap binds everywhere
    _close(res.loss, (per_tok * mask).sum() / mask.sum(), rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_only_when_a_gradient_is_needed(monkeypatch):
    import tasks.objectives.losses as losses

    calls = []
    real = losses.checkpoint
    monkeypatch.setattr(losses, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    s, t, mask = _batch()
    obj = Objective()
    ref = chunked_objective(s, t, ID, ID, mask, obj, chunk_size=3)  # no input needs a gradient
    with torch.no_grad():
        no_grad = chunked_objective(s.clone().requires_grad_(True), t, ID, ID, mask, obj, chunk_size=3)
    assert calls == []
    res = chunked_objective(s.clone().requires_grad_(True), t, ID, ID, mask, obj, chunk_size=3)
    assert len(calls) == 3  # one recomputable chunk per chunk with a masked position (7 positions by 3)
    _close(no_grad.loss, ref.loss, rtol=0, atol=0)
    _close(res.loss, ref.loss, rtol=1e-7, atol=0)


def test_spread_scales_bring_each_group_to_the_batch_spread_within_the_clip():
    """Hand-computed: group a's tokens {1, 3} (std 1), b's {0, 0, 0, 4} (std sqrt(3)), pooled {1, 3, 0, 0, 0, 4}
    (mean 4/3, E[x^2] = 26/6, std sqrt(26/6 - 16/9) = sqrt(23/9))."""
    from tasks.objectives.losses import spread_scales

    sums = {"a": (2.0, 4.0, 10.0), "b": (4.0, 4.0, 16.0)}
    whole = (23 / 9) ** 0.5
    assert spread_scales(sums, 4.0) == pytest.approx({"a": whole / 1.0, "b": whole / 3 ** 0.5})
    assert spread_scales(sums, 1.2) == pytest.approx({"a": 1.2, "b": whole / 3 ** 0.5})  # a clipped to 1.2
    assert spread_scales({**sums, "c": (3.0, 6.0, 12.0)}, 4.0)["c"] == 1.0  # c's tokens all 2: no spread, scale 1
    assert spread_scales({"a": (2.0, 4.0, 8.0)}, 4.0) == {"a": 1.0}  # no spread anywhere
    # a: {-1e-3, 1e-3} (std 1e-3), b: {-10, 10} (std 10), pooled std sqrt(50 + 5e-7): a's scale clipped to 4.
    tiny = spread_scales({"a": (2.0, 0.0, 2e-6), "b": (2.0, 0.0, 200.0)}, 4.0)
    assert tiny == pytest.approx({"a": 4.0, "b": (50.0 + 5e-7) ** 0.5 / 10.0})
