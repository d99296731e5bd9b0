"""The reverse-KL divergence: exact values, masking, chunking and where the gradient goes."""

import math

import pytest
import torch

from tasks.losses import chunked_reverse_kl, reverse_kl_per_token

ID = torch.nn.Identity()  # with identity heads the "hidden states" are the logits themselves


def _rand(B=3, T=7, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, V, generator=g), torch.randn(B, T, V, generator=g)


def test_identical_distributions_give_zero():
    s, _ = _rand()
    res = chunked_reverse_kl(s, s.clone(), ID, ID, torch.ones(3, 7), chunk_size=3)
    assert res.loss.item() == pytest.approx(0.0, abs=1e-6)
    assert torch.allclose(res.kl_sum_B, torch.zeros(3), atol=1e-6)


def test_hand_computed_two_token_case():
    # q = (0.5, 0.5), p = (0.25, 0.75): KL(q||p) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 ln 2 + 0.5 ln(2/3)
    q_logits = torch.log(torch.tensor([[0.5, 0.5]]))
    p_logits = torch.log(torch.tensor([[0.25, 0.75]]))
    expected = 0.5 * math.log(2) + 0.5 * math.log(2 / 3)
    assert reverse_kl_per_token(q_logits, p_logits).item() == pytest.approx(expected, rel=1e-6)
    # And through the chunked path with a second, masked-out position holding anything at all.
    s = torch.stack([q_logits[0], torch.tensor([9.0, -9.0])])[None]
    t = torch.stack([p_logits[0], torch.tensor([-9.0, 9.0])])[None]
    res = chunked_reverse_kl(s, t, ID, ID, torch.tensor([[1.0, 0.0]]), chunk_size=1)
    assert res.loss.item() == pytest.approx(expected, rel=1e-6)
    assert res.tokens_B.tolist() == [1.0]


def test_reverse_kl_is_not_forward_kl():
    # KL(q||p) with q=(0.9,0.1), p=(0.5,0.5) = 0.9 ln 1.8 + 0.1 ln 0.2 ; KL(p||q) would be 0.5 ln(0.5/0.9) + 0.5 ln 5.
    q = torch.log(torch.tensor([[0.9, 0.1]]))
    p = torch.log(torch.tensor([[0.5, 0.5]]))
    assert reverse_kl_per_token(q, p).item() == pytest.approx(0.9 * math.log(1.8) + 0.1 * math.log(0.2), rel=1e-6)


def test_masked_positions_contribute_nothing():
    s, t = _rand()
    mask = torch.ones(3, 7)
    mask[0, :2] = 0
    mask[2, 5:] = 0
    base = chunked_reverse_kl(s, t, ID, ID, mask, chunk_size=4)
    s2, t2 = s.clone(), t.clone()
    s2[0, :2] += 100 * torch.randn(2, 11)
    t2[2, 5:] -= 50
    other = chunked_reverse_kl(s2, t2, ID, ID, mask, chunk_size=4)
    assert other.loss.item() == pytest.approx(base.loss.item(), rel=1e-6)
    assert base.tokens_B.tolist() == [5.0, 7.0, 5.0]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_chunked_equals_unchunked_values_and_gradients(chunk):
    s, t = _rand(B=2, T=9, V=13, seed=1)
    mask = (torch.rand(2, 9, generator=torch.Generator().manual_seed(2)) > 0.3).float()
    ref_s = s.clone().requires_grad_(True)
    per_tok = reverse_kl_per_token(ref_s.flatten(0, 1), t.flatten(0, 1)).view(2, 9)
    ref = (per_tok * mask).sum() / mask.sum()
    ref.backward()
    got_s = s.clone().requires_grad_(True)
    res = chunked_reverse_kl(got_s, t, ID, ID, mask, chunk_size=chunk)
    res.loss.backward()
    assert res.loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.allclose(got_s.grad, ref_s.grad, atol=1e-7)


def test_gradient_flows_only_to_student():
    torch.manual_seed(0)
    student_head, teacher_head = torch.nn.Linear(4, 6), torch.nn.Linear(5, 6)
    hs = torch.randn(2, 3, 4, requires_grad=True)
    ht = torch.randn(2, 3, 5, requires_grad=True)
    res = chunked_reverse_kl(hs, ht, student_head, teacher_head, torch.ones(2, 3), chunk_size=2)
    res.loss.backward()
    assert hs.grad is not None and hs.grad.abs().sum() > 0
    assert student_head.weight.grad is not None and student_head.weight.grad.abs().sum() > 0
    assert ht.grad is None
    assert teacher_head.weight.grad is None and teacher_head.bias.grad is None


def test_gradient_matches_analytic_form():
    # d KL(q||p) / d z_q[k] = q_k * ((log q_k - log p_k) - KL)
    zq = torch.tensor([[0.3, -1.0, 2.0]], requires_grad=True)
    zp = torch.tensor([[1.0, 0.0, -0.5]])
    kl = reverse_kl_per_token(zq, zp).sum()
    kl.backward()
    q, logq, logp = zq.softmax(-1).detach(), zq.log_softmax(-1).detach(), zp.log_softmax(-1)
    expected = q * ((logq - logp) - kl.detach())
    assert torch.allclose(zq.grad, expected, atol=1e-6)


def test_normalizer_and_shape_errors():
    s, t = _rand(B=1, T=4, V=5)
    res = chunked_reverse_kl(s, t, ID, ID, torch.ones(1, 4), normalizer=8.0)
    assert res.loss.item() == pytest.approx(res.kl_sum_B.sum().item() / 8.0, rel=1e-6)
    with pytest.raises(ValueError, match="shape mismatch"):
        chunked_reverse_kl(s, t[:, :3], ID, ID, torch.ones(1, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_reverse_kl(s, t, ID, ID, torch.ones(1, 4), chunk_size=0)


def test_chunking_bounds_logit_memory():
    # Between forward and backward the chunked path keeps only hidden-state slices, never the [B, T, V] logits
    # (an un-checkpointed loop would keep every chunk's logits alive: B*T*V numbers or more in total).
    B, T, H, V = 2, 64, 8, 512
    head = torch.nn.Linear(H, V)
    hs = torch.randn(B, T, H, requires_grad=True)
    ht = torch.randn(B, T, H)
    sizes = []

    def pack(x):
        sizes.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = chunked_reverse_kl(hs, ht, head, head, torch.ones(B, T), chunk_size=8).loss
    assert sum(sizes) < B * T * V / 4
    loss.backward()
    assert hs.grad is not None
