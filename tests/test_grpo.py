"""GRPO advantages and the decoupled PPO loss, against hand-worked float64 numbers."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from sparserl.config.corrections import CorrectionConfig
from sparserl.learner.corrections import compute_corrections
from sparserl.learner.grpo import group_advantages, kl_k3, ppo_loss, token_coefficients

D = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


# ----------------------------------------------------------------------------- advantages
def test_group_advantages_hand_example():
    # Group 1: rewards [1, 0, 0, 1]: mean 0.5, unbiased var = 4 * 0.25 / 3 = 1/3,
    #   std = 0.5773502691896257; A = ±0.5 / (0.5773502691896257 + 1e-6) = ±0.8660239037870368.
    # Group 2: rewards [1, 1, 1, 1]: every R - mean is 0, so all zero.
    rewards = t([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    a = 0.8660239037870368
    expected = t([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0])
    got = group_advantages(rewards, 4)
    assert got.dtype == D
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_group_advantages_float32_and_general_groups():
    random.seed(0)
    rewards = [random.random() for _ in range(12)]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float32), 3)
    assert got.dtype == torch.float32 and got.shape == (12,)
    for g in range(4):
        group = rewards[3 * g:3 * g + 3]
        mu, sd = statistics.fmean(group), statistics.stdev(group)
        for j, r in enumerate(group):
            assert got[3 * g + j].item() == pytest.approx((r - mu) / (sd + 1e-6), rel=1e-5, abs=1e-6)


def test_group_advantages_with_included_mask():
    # Group 1: rewards [1, 0, 0, 1], member 2 excluded. Included rewards 1, 0, 1:
    #   mean 2/3; unbiased var = ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = (6/9) / 2 = 1/3;
    #   std = 0.5773502691896257.
    #   A(R=1) = (1/3) / (0.5773502691896257 + 1e-6) = 0.5773492691913579
    #   A(R=0) = -(2/3) / (0.5773502691896257 + 1e-6) = -1.1546985383827158
    # Group 2: rewards [1, 0, 1, 0] with only member 0 included: fewer than 2 -> all zeros.
    # Group 3: rewards [0, 1, 1, 1], nobody included -> all zeros.
    rewards = t([1, 0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1])
    included = torch.tensor([1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    got = group_advantages(rewards, 4, included)
    a_one, a_zero = 0.5773492691913579, -1.1546985383827158
    for index, value in ((0, a_one), (1, a_zero), (3, a_one)):
        assert got[index].item() == pytest.approx(value, rel=1e-12)
    assert torch.all(got[4:] == 0)
    # The excluded member did not enter the statistics: the included advantages sum to zero.
    assert (got[0] + got[1] + got[3]).item() == pytest.approx(0.0, abs=1e-12)
    # All included equals no mask.
    torch.testing.assert_close(group_advantages(rewards, 4, torch.ones(12, dtype=torch.bool)),
                               group_advantages(rewards, 4))


# ----------------------------------------------------------------------------- hand example
# B=2, T=3; ε = 0.2, ε_high = 0.28, so clip(r) = clamp(r, 0.8, 1.28).
# ratios r (logp_new = logp_old + log r), advantages A = [1, -2], weights w, mask m:
#   row 0 (A = +1): r = 1.5, 0.7, 1.1   w = 1.2, 0.8, 1.0   m = 1, 1, 1
#   row 1 (A = -2): r = 0.6, 1.4, 0.5   w = 0.5, 1.5, 2.0   m = 1, 1, 0
# ℓ = max(-rA, -clip(r)A) · w:
#   (0,0): max(-1.5, -1.28) = -1.28 (clipped)  · 1.2 = -1.536
#   (0,1): max(-0.7, -0.8)  = -0.7             · 0.8 = -0.56
#   (0,2): max(-1.1, -1.1)  = -1.1             · 1.0 = -1.1
#   (1,0): max( 1.2,  1.6)  =  1.6 (clipped)   · 0.5 =  0.8
#   (1,1): max( 2.8,  2.56) =  2.8             · 1.5 =  4.2
#   (1,2): masked out (would be max(1.0, 1.6) · 2 = 3.2)
# seq-mean-token-mean: row means -3.196/3 = -1.0653333..., 5.0/2 = 2.5;
#   loss = (-1.0653333333 + 2.5) / 2 = 0.7173333333...
# token-mean: (-3.196 + 5.0) / 5 = 0.3608
# clip_frac: 2 clipped of 5 kept tokens = 0.4.
# ratio_mean over kept tokens: (1.5 + 0.7 + 1.1 + 0.6 + 1.4) / 5 = 1.06
LOGP_OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
RATIOS = [[1.5, 0.7, 1.1], [0.6, 1.4, 0.5]]
ADV = [1.0, -2.0]
WEIGHTS = [[1.2, 0.8, 1.0], [0.5, 1.5, 2.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
# k3 with d = logp_ref - logp_new = [[0.1, -0.2, 0.0], [0.3, -0.1, 5.0]]; k3 = e^d - 1 - d:
#   0.1 -> 0.005170918075647707, -0.2 -> 0.018730753077981832, 0 -> 0,
#   0.3 -> 0.049858807576003195, -0.1 -> 0.004837418035959523, 5 -> e^5 - 6 = 142.4 -> clamped 10 (masked)
D_REF = [[0.1, -0.2, 0.0], [0.3, -0.1, 5.0]]
K3 = [[0.005170918075647707, 0.018730753077981832, 0.0], [0.049858807576003195, 0.004837418035959523, 10.0]]


def _hand_inputs():
    old = t(LOGP_OLD)
    new = old + torch.log(t(RATIOS))
    ref = new + t(D_REF)
    return new, old, t(ADV), t(WEIGHTS), t(MASK), ref


@pytest.mark.parametrize("agg, expected", [
    ("seq-mean-token-mean", (-3.196 / 3 + 5.0 / 2) / 2),
    ("token-mean", (-3.196 + 5.0) / 5),
])
def test_ppo_loss_hand_example(agg, expected):
    new, old, adv, w, mask, _ = _hand_inputs()
    coef = token_coefficients(mask, agg)
    terms = ppo_loss(new, old, adv, w, coef, clip_eps=0.2, clip_eps_high=0.28)
    assert terms.loss.item() == pytest.approx(expected, rel=1e-6)
    assert terms.pg_loss == pytest.approx(expected, rel=1e-6)
    assert terms.clip_frac == pytest.approx(0.4)
    assert terms.ratio_mean == pytest.approx(1.06, rel=1e-6)
    assert terms.kl == 0.0


def test_token_coefficients_hand_values():
    mask = t([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    # seq-mean-token-mean over 3 sequences: 1/(3*3) on row 0, 1/(2*3) on row 1, 0 on the empty row.
    expected = t([[1 / 9, 1 / 9, 1 / 9], [1 / 6, 1 / 6, 0], [0, 0, 0]])
    torch.testing.assert_close(token_coefficients(mask, "seq-mean-token-mean").double(), expected,
                               rtol=1e-6, atol=1e-8)
    # token-mean: 1/5 on the 5 kept tokens.
    expected = t([[0.2, 0.2, 0.2], [0.2, 0.2, 0], [0, 0, 0]])
    torch.testing.assert_close(token_coefficients(mask, "token-mean").double(), expected, rtol=1e-6, atol=1e-8)
    # Nothing kept: all zeros, no NaN.
    for agg in ("seq-mean-token-mean", "token-mean"):
        assert torch.all(token_coefficients(torch.zeros(2, 3), agg) == 0)
    with pytest.raises(ValueError):
        token_coefficients(mask, "sum")


def test_fully_rejected_sequence_counts_in_the_sequence_mean():
    # Add a third row whose tokens are all masked: it adds 0 to the sum and 1 to the count:
    # (-3.196/3 + 5.0/2 + 0) / 3.
    new, old, adv, w, mask, _ = _hand_inputs()
    new = torch.cat([new, t([[-0.1, -0.2, -0.3]])])
    old = torch.cat([old, t([[-1.0, -1.0, -1.0]])])
    adv = torch.cat([adv, t([3.0])])
    w = torch.cat([w, t([[1.0, 1.0, 1.0]])])
    mask = torch.cat([mask, t([[0.0, 0.0, 0.0]])])
    coef = token_coefficients(mask, "seq-mean-token-mean")
    terms = ppo_loss(new, old, adv, w, coef, 0.2, 0.28)
    assert terms.loss.item() == pytest.approx((-3.196 / 3 + 5.0 / 2) / 3, rel=1e-6)
    assert terms.clip_frac == pytest.approx(0.4)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_kl_term_hand_example(agg):
    new, old, adv, w, mask, ref = _hand_inputs()
    torch.testing.assert_close(kl_k3(new, ref), t(K3), rtol=1e-9, atol=1e-12)
    if agg == "seq-mean-token-mean":
        pg = (-3.196 / 3 + 5.0 / 2) / 2
        kl = ((K3[0][0] + K3[0][1] + K3[0][2]) / 3 + (K3[1][0] + K3[1][1]) / 2) / 2
    else:
        pg = (-3.196 + 5.0) / 5
        kl = (K3[0][0] + K3[0][1] + K3[0][2] + K3[1][0] + K3[1][1]) / 5
    beta = 0.1
    coef = token_coefficients(mask, agg)
    terms = ppo_loss(new, old, adv, w, coef, 0.2, 0.28, kl_coef=beta, logp_ref=ref)
    assert terms.kl == pytest.approx(kl, rel=1e-6)
    assert terms.pg_loss == pytest.approx(pg, rel=1e-6)
    assert terms.loss.item() == pytest.approx(pg + beta * kl, rel=1e-6)
    with pytest.raises(ValueError):
        ppo_loss(new, old, adv, w, coef, 0.2, 0.28, kl_coef=beta, logp_ref=None)


def test_k3_is_clamped_and_non_negative():
    logp = t([0.0, 0.0, 0.0, 0.0])
    ref = t([5.0, -30.0, 0.0, 1e-3])
    # 5 -> e^5 - 6 = 142.4 -> 10; -30 -> e^-30 - 1 + 30 = 29.0 -> 10; 0 -> 0; 1e-3 -> ~ 5e-7
    got = kl_k3(logp, ref)
    assert got[0].item() == 10.0 and got[1].item() == 10.0 and got[2].item() == 0.0
    assert got[3].item() == pytest.approx(math.exp(1e-3) - 1 - 1e-3, rel=1e-6)


def test_entropy_term():
    new, old, adv, w, mask, _ = _hand_inputs()
    entropy = t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    coef = token_coefficients(mask, "token-mean")
    terms = ppo_loss(new, old, adv, w, coef, 0.2, 0.28, entropy_coef=0.01, entropy=entropy)
    # token mean of the kept entropies: (1+2+3+4+5)/5 = 3; the masked 100 is ignored.
    assert terms.entropy == pytest.approx(3.0)
    assert terms.loss.item() == pytest.approx((-3.196 + 5.0) / 5 - 0.01 * 3.0, rel=1e-6)


# ----------------------------------------------------------------------------- gradient
def _reference_loss(new, old, adv, w, mask, ref, eps, eps_high, beta, agg):
    """Independent float64 formula: -min(r A, clip(r) A) per token, masked, aggregated."""
    r = torch.exp(new - old)
    a = adv[:, None]
    lo, hi = 1 - eps, 1 + eps_high
    r_clip = torch.where(r < lo, torch.full_like(r, lo), torch.where(r > hi, torch.full_like(r, hi), r))
    surrogate = -torch.minimum(r * a, r_clip * a) * w
    d = ref - new
    kl = torch.clamp(torch.exp(d) - 1 - d, max=10.0)
    per_token = surrogate + beta * kl
    if agg == "token-mean":
        return (per_token * mask).sum() / max(mask.sum().item(), 1.0)
    rows = [(per_token[i] * mask[i]).sum() / max(mask[i].sum().item(), 1.0) for i in range(mask.shape[0])]
    return torch.stack(rows).mean()


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_gradient_matches_independent_autograd(agg):
    new, old, adv, w, mask, ref = _hand_inputs()
    mine = new.clone().requires_grad_(True)
    expected = _reference_loss(mine, old, adv, w, mask, ref, 0.2, 0.28, 0.1, agg)
    expected.backward()
    theirs = new.clone().requires_grad_(True)
    terms = ppo_loss(theirs, old, adv, w, token_coefficients(mask, agg), 0.2, 0.28, kl_coef=0.1, logp_ref=ref)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(theirs.grad, mine.grad, rtol=1e-6, atol=1e-9)
    # Clipped tokens (0,0) and (1,0) get only the KL gradient, β·coef·dk3/dlogp with
    # dk3/dlogp = 1 - e^d (d = logp_ref - logp); the masked token gets none.
    coef = 1 / 6 if agg == "seq-mean-token-mean" else 1 / 5  # (0,0): 1/(3 tokens * 2 rows) or 1/5
    assert theirs.grad[0, 0].item() == pytest.approx(0.1 * coef * (1 - math.exp(0.1)), rel=1e-6)
    coef = 1 / 4 if agg == "seq-mean-token-mean" else 1 / 5  # (1,0): 1/(2 tokens * 2 rows) or 1/5
    assert theirs.grad[1, 0].item() == pytest.approx(0.1 * coef * (1 - math.exp(0.3)), rel=1e-6)
    assert theirs.grad[1, 2].item() == 0.0


def test_gradient_random_batch_and_weights_detached():
    g = torch.Generator().manual_seed(0)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g, dtype=D) * 3
    new = old + (torch.rand(B, T, generator=g, dtype=D) - 0.5) * 0.8
    ref = new + (torch.rand(B, T, generator=g, dtype=D) - 0.5)
    adv = torch.randn(B, generator=g, dtype=D)
    w = torch.rand(B, T, generator=g, dtype=D) + 0.5
    mask = (torch.rand(B, T, generator=g) < 0.7).to(D)
    mask[2] = 0
    w_param = w.clone().requires_grad_(True)
    for agg in ("seq-mean-token-mean", "token-mean"):
        mine = new.clone().requires_grad_(True)
        _reference_loss(mine, old, adv, w, mask, ref, 0.2, 0.3, 0.05, agg).backward()
        theirs = new.clone().requires_grad_(True)
        loss = ppo_loss(theirs, old, adv, w_param, token_coefficients(mask, agg), 0.2, 0.3,
                        kl_coef=0.05, logp_ref=ref).loss
        loss.backward()
        torch.testing.assert_close(theirs.grad, mine.grad, rtol=1e-6, atol=1e-9)
    assert w_param.grad is None  # weights are detached


# ----------------------------------------------------------------------------- micro-batches
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_micro_batch_accumulation_equals_whole(agg):
    g = torch.Generator().manual_seed(1)
    B, T = 6, 5
    old = -torch.rand(B, T, generator=g, dtype=D) * 2
    new = old + (torch.rand(B, T, generator=g, dtype=D) - 0.5)
    ref = new + (torch.rand(B, T, generator=g, dtype=D) - 0.5)
    adv = torch.randn(B, generator=g, dtype=D)
    w = torch.rand(B, T, generator=g, dtype=D) + 0.5
    mask = (torch.rand(B, T, generator=g) < 0.6).to(D)
    mask[4] = 0  # a fully rejected row
    coef = token_coefficients(mask, agg)  # from the WHOLE minibatch

    whole_new = new.clone().requires_grad_(True)
    whole = ppo_loss(whole_new, old, adv, w, coef, 0.2, 0.28, kl_coef=0.1, logp_ref=ref).loss
    whole.backward()

    parts_new = new.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        part = ppo_loss(parts_new[rows], old[rows], adv[rows], w[rows], coef[rows], 0.2, 0.28,
                        kl_coef=0.1, logp_ref=ref[rows]).loss
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(parts_new.grad, whole_new.grad, rtol=1e-12, atol=1e-14)
    # And the whole equals the independent formula.
    assert whole.item() == pytest.approx(
        _reference_loss(new, old, adv, w, mask, ref, 0.2, 0.28, 0.1, agg).item(), rel=1e-6)


# ----------------------------------------------------------------------------- dense GRPO
def _plain_dense_grpo(logp_new, logp_old, rewards, lengths, group, eps):
    """Textbook GRPO in plain Python floats: group-normalised rewards, clipped surrogate,
    mean over each response's tokens, then mean over responses."""
    n = len(rewards)
    adv = []
    for g in range(0, n, group):
        rs = rewards[g:g + group]
        mu, sd = statistics.fmean(rs), statistics.stdev(rs)
        adv += [(r - mu) / (sd + 1e-6) for r in rs]
    total = 0.0
    for i in range(n):
        terms = []
        for j in range(lengths[i]):
            r = math.exp(logp_new[i][j] - logp_old[i][j])
            terms.append(-min(r * adv[i], min(max(r, 1 - eps), 1 + eps) * adv[i]))
        total += sum(terms) / len(terms)
    return total / n


def test_xi_one_nothing_rejected_is_plain_dense_grpo():
    rng = random.Random(3)
    group, B, T = 4, 8, 6
    lengths = [rng.randint(1, T) for _ in range(B)]
    mask = t([[1.0 if j < lengths[i] else 0.0 for j in range(T)] for i in range(B)])
    rewards = [float(rng.random() < 0.5) for _ in range(B)]
    rewards[0], rewards[1] = 1.0, 0.0  # make sure group 1 is not constant
    logp_old = [[-rng.uniform(0.1, 3.0) for _ in range(T)] for _ in range(B)]
    logp_new = [[x + rng.uniform(-0.4, 0.4) for x in row] for row in logp_old]

    # ξ ≡ 1: the sampler's log-probs equal the dense old policy's.
    corrections = compute_corrections(t(logp_old), t(logp_old), mask, CorrectionConfig())
    torch.testing.assert_close(corrections.weights, mask)  # weights 1 on the response, 0 elsewhere
    torch.testing.assert_close(corrections.keep_mask, mask)
    adv = group_advantages(t(rewards), group)
    coef = token_coefficients(corrections.keep_mask, "seq-mean-token-mean")
    terms = ppo_loss(t(logp_new), t(logp_old), adv, corrections.weights, coef, 0.2, 0.2)
    expected = _plain_dense_grpo(logp_new, logp_old, rewards, lengths, group, 0.2)
    assert terms.loss.item() == pytest.approx(expected, rel=1e-6, abs=1e-9)
