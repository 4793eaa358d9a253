import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from recam.losses import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    get_kl_estimator,
    get_policy_loss,
    grpo_policy_loss,
    kl_estimate,
    register_kl_estimator,
    register_policy_loss,
)

METRIC_KEYS = {
    "loss",
    "policy_loss",
    "kl_penalty",
    "mean_ratio",
    "ratio_min",
    "ratio_max",
    "clipfrac_high",
    "clipfrac_low",
    "clipfrac",
    "approx_kl",
    "mean_log_prob_current",
    "mean_log_prob_old",
    "mean_advantage",
}


def test_on_policy_loss_is_minus_mean_advantage_exactly():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(16, generator=g)
    adv = torch.randn(16, generator=g).clamp(-4.9, 4.9)
    loss, m = grpo_policy_loss(logp, logp.clone(), adv, clip_range=1e-3, adv_clip_max=5.0)
    assert torch.equal(loss, -adv.mean())
    assert set(m) == METRIC_KEYS
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad for v in m.values())
    assert m["mean_ratio"].item() == 1.0 and m["clipfrac"].item() == 0.0 and m["approx_kl"].item() == 0.0
    assert m["kl_penalty"].item() == 0.0


def _four_element_case():
    # r = [1.5, 0.5, 1.1, 0.5], eps = 0.2
    #   A = +1,  r > 1 + eps -> clipped branch:   max(-1.5, -1.2) = -1.2
    #   A = -2,  r < 1 - eps -> clipped branch:   max( 1.0,  1.6) =  1.6
    #   A = 0.5, r inside    -> unclipped:        -0.55
    #   A = +1,  r < 1 - eps -> unclipped binds:  max(-0.5, -0.8) = -0.5
    old = torch.tensor([0.3, -1.0, 2.0, 0.0])
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.5])
    logp = (old + torch.log(ratios)).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0, 0.5, 1.0])
    return logp, old, adv, ratios


def test_clipping_against_hand_computed_values():
    logp, old, adv, ratios = _four_element_case()
    loss, m = grpo_policy_loss(logp, old, adv, clip_range=0.2, adv_clip_max=5.0)
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 1.6 - 0.55 - 0.5) / 4))
    torch.testing.assert_close(m["clipfrac_high"], torch.tensor(0.25))
    torch.testing.assert_close(m["clipfrac_low"], torch.tensor(0.5))
    torch.testing.assert_close(m["clipfrac"], torch.tensor(0.75))
    torch.testing.assert_close(m["mean_ratio"], torch.tensor(0.9))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(1.5))
    torch.testing.assert_close(m["approx_kl"], 0.5 * (torch.log(ratios) ** 2).mean())
    torch.testing.assert_close(m["mean_log_prob_old"], old.mean())
    torch.testing.assert_close(m["mean_log_prob_current"], logp.detach().mean())


def test_gradient_is_zero_for_clipped_entries():
    logp, old, adv, ratios = _four_element_case()
    loss, _ = grpo_policy_loss(logp, old, adv, clip_range=0.2, adv_clip_max=5.0)
    (grad,) = torch.autograd.grad(loss, logp)
    # d(-A r)/d logp = -A r for the unclipped entries, divided by N = 4 from the mean.
    expected = torch.tensor([0.0, 0.0, -0.5 * 1.1 / 4, -1.0 * 0.5 / 4])
    torch.testing.assert_close(grad, expected)


def test_huge_log_ratio_is_clamped_and_finite():
    old = torch.zeros(3)
    logp = torch.tensor([197562.0, -197562.0, 0.0], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, m = grpo_policy_loss(logp, old, adv, clip_range=1e-3, adv_clip_max=5.0)
    assert torch.isfinite(loss)
    assert m["ratio_max"].item() == torch.exp(torch.tensor(10.0)).item()
    assert m["ratio_min"].item() == torch.exp(torch.tensor(-10.0)).item()
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.isfinite(grad).all()


def test_advantages_are_clamped():
    logp = torch.zeros(2)
    adv = torch.tensor([10.0, -7.0])
    loss, m = grpo_policy_loss(logp, logp, adv, clip_range=0.1, adv_clip_max=5.0)
    torch.testing.assert_close(loss, torch.tensor(0.0))  # -(5 + -5) / 2
    torch.testing.assert_close(m["mean_advantage"], torch.tensor(0.0))


def test_beta_adds_mean_kl():
    logp, old, adv, _ = _four_element_case()
    kl = torch.tensor([0.1, 0.4, 0.0, 0.3])
    base, _ = grpo_policy_loss(logp, old, adv, clip_range=0.2, adv_clip_max=5.0)
    loss, m = grpo_policy_loss(logp, old, adv, clip_range=0.2, adv_clip_max=5.0, kl=kl, beta=0.5)
    torch.testing.assert_close(loss, base + 0.5 * 0.2)
    torch.testing.assert_close(m["kl_penalty"], torch.tensor(0.2))
    torch.testing.assert_close(m["policy_loss"], base.detach())
    unweighted, m0 = grpo_policy_loss(logp, old, adv, clip_range=0.2, adv_clip_max=5.0, kl=kl)
    assert torch.equal(unweighted, base) and m0["kl_penalty"].item() == pytest.approx(0.2)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clip_range=0.0), "clip_range"),
        (dict(adv_clip_max=-1.0), "adv_clip_max"),
        (dict(log_ratio_clamp=0.0), "log_ratio_clamp"),
        (dict(beta=-0.1, kl=torch.zeros(4)), "beta"),
        (dict(beta=0.1), "needs a kl"),
    ],
)
def test_policy_loss_rejects_bad_input(kwargs, match):
    args = dict(clip_range=0.2, adv_clip_max=5.0) | kwargs
    with pytest.raises(ValueError, match=match):
        grpo_policy_loss(torch.zeros(4), torch.zeros(4), torch.zeros(4), **args)


def test_policy_loss_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="same shape"):
        grpo_policy_loss(torch.zeros(4), torch.zeros(4), torch.zeros(3), clip_range=0.2, adv_clip_max=5.0)


def test_kl_estimators_hand_values():
    logp = torch.tensor([0.0, -1.0])
    ref = torch.tensor([-1.0, 0.5])  # log r = [-1, 1.5]
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([1.0, -1.5]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5, 1.125]))
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k3"), torch.tensor([math.exp(-1.0), math.exp(1.5) - 2.5])
    )


def test_k1_and_k3_are_unbiased_for_gaussians():
    q, p = Normal(0.0, 1.0), Normal(0.6, 1.2)
    x = q.loc + q.scale * torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    true_kl = kl_divergence(q, p).item()
    for kind in ("k1", "k3"):
        est = kl_estimate(q.log_prob(x), p.log_prob(x), kind).mean().item()
        assert est == pytest.approx(true_kl, abs=0.01)
    assert bool((kl_estimate(q.log_prob(x), p.log_prob(x), "k3") >= 0).all())


def test_k3_clamps_before_exp():
    out = kl_estimate(torch.tensor([0.0, 0.0]), torch.tensor([1000.0, -1000.0]), "k3")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1], torch.tensor(math.exp(-20.0) - 1.0 + 1000.0))


def test_registries():
    assert POLICY_LOSSES["grpo_clip"] is grpo_policy_loss and get_policy_loss("grpo_clip") is grpo_policy_loss
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3"}
    with pytest.raises(KeyError, match="grpo_clip"):
        get_policy_loss("nope")
    with pytest.raises(KeyError, match="k1"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")

    @register_policy_loss("test_only_loss")
    def _custom(*args, **kwargs):
        return grpo_policy_loss(*args, **kwargs)

    @register_kl_estimator("test_only_kl")
    def _abs_kl(log_prob, log_prob_ref):
        return (log_prob_ref - log_prob).abs()

    try:
        assert get_policy_loss("test_only_loss") is _custom
        torch.testing.assert_close(kl_estimate(torch.zeros(1), -torch.ones(1), "test_only_kl"), torch.ones(1))
        assert get_kl_estimator("test_only_kl") is _abs_kl
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("grpo_clip")(_custom)
    finally:
        POLICY_LOSSES.pop("test_only_loss")
        KL_ESTIMATORS.pop("test_only_kl")


def test_kl_estimator_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="log_prob_ref shape"):
        kl_estimate(torch.zeros(3), torch.zeros(2), "k2")
