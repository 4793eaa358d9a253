import math
from dataclasses import dataclass

import ml_collections
import pytest
import torch
from torch.distributions import Normal, kl_divergence

from recam.engine.losses import (
    K3_LOG_RATIO_CLAMP,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    ClipSettings,
    StepLossInputs,
    gaussian_log_ratio,
    get_kl_estimator,
    get_policy_loss,
    grpo_clip,
    grpo_policy_loss,
    loss_settings,
    policy_loss_switches,
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


# ---------------------------------------------------------------- KL estimators
#
# Ground truth is torch.distributions: the per-element KL of N(mu_theta, std^2) to N(mu_ref, std^2),
# averaged over the D elements, and its gradient in mu_theta. The estimators are fed N on-policy draws
# x = mu_theta + std * eps, as the trainer feeds them the stored next states.

SAMPLED = ("k1", "k2", "k3")


def _on_policy_case(shape, draws, std, seed):
    """mu_ref, a mu_theta leaf at standardized gaps of RMS 0.25 from it, and `draws` on-policy samples."""
    g = torch.Generator().manual_seed(seed)
    mu_ref = torch.randn(shape, generator=g)
    std = torch.as_tensor(std, dtype=torch.float32)
    mu_theta = (mu_ref + 0.25 * std * torch.randn(shape, generator=g)).requires_grad_(True)
    sample = mu_theta.detach() + std * torch.randn((draws, *shape), generator=g)
    return mu_theta, mu_ref, std, sample


def _exact(mu_theta, mu_ref, std):
    """Per-element KL averaged over elements, and its gradient in mu_theta, from torch.distributions."""
    kl = kl_divergence(Normal(mu_theta, std), Normal(mu_ref, std)).mean()
    (grad,) = torch.autograd.grad(kl, mu_theta)
    return kl.detach(), grad


def _measure(per_draw_fn, mu_theta, mu_ref, std, sample):
    """Monte-Carlo value and gradient of mean_n per_draw_fn(...) against the exact KL.

    Each draw gets its own copy of mu_theta (rows of one leaf), so the per-draw gradients give the
    Monte-Carlo variance: `expected_rel_err` is sqrt(E||g_hat - g||^2) / ||g|| for an unbiased estimator.
    """
    draws = sample.shape[0]
    rows = mu_theta.detach().expand_as(sample).clone().requires_grad_(True)
    est = per_draw_fn(rows, mu_ref.expand_as(sample), std, sample)
    assert est.shape == (draws,)
    (row_grads,) = torch.autograd.grad(est.mean(), rows)
    grad = row_grads.sum(0)
    kl, true_grad = _exact(mu_theta, mu_ref, std)
    per_draw_grad = draws * row_grads
    cos = torch.nn.functional.cosine_similarity(grad.flatten(), true_grad.flatten(), dim=0).item()
    return {
        "value": est.mean().item(),
        "value_se": (est.std() / math.sqrt(draws)).item(),
        "kl": kl.item(),
        "value_ratio": est.mean().item() / kl.item(),
        "cos": cos,
        "grad_norm_ratio": (grad.norm() / true_grad.norm()).item(),
        "rel_err": ((grad - true_grad).norm() / true_grad.norm()).item(),
        "expected_rel_err": math.sqrt(per_draw_grad.var(0).sum().item() / draws) / true_grad.norm().item(),
    }


def _estimator(name):
    return lambda cur, ref, std, x: get_kl_estimator(name)(cur, ref, std, x)


@pytest.fixture(scope="module")
def image_case():
    # D = 3 * 32 * 32 = 3072 as in issue 15; a per-sample (N, 1, 1, 1) std as the step functions return it.
    mu_theta, mu_ref, _, sample = _on_policy_case((3, 32, 32), draws=4000, std=0.05, seed=0)
    return mu_theta, mu_ref, torch.full((4000, 1, 1, 1), 0.05), sample


@pytest.fixture(scope="module")
def small_case():
    # D = 16 with a different std per element, broadcast as a (16,) tensor.
    std = torch.linspace(0.02, 0.2, 16)
    return _on_policy_case((16,), draws=20000, std=std, seed=1)


def _check_unbiased(m, name):
    """Value within 4 Monte-Carlo standard errors of its expectation (a false failure has p < 1e-4), and
    the gradient within 3 times its expected Monte-Carlo error (generous for a chi-square over D >= 16)."""
    target = m["kl"] + (m["k2_bias"] if name == "k2" else 0.0)
    assert abs(m["value"] - target) <= 4 * m["value_se"], m
    assert m["rel_err"] <= 3 * m["expected_rel_err"] + 1e-6, m
    assert m["cos"] > 0.99 and m["rel_err"] < 0.1 and abs(m["grad_norm_ratio"] - 1) < 0.05, m


def _k2_bias(mu_theta, mu_ref, std):
    # Per element E[k2] = KL + KL^2 / 2 for equal-std Gaussians (log r is Gaussian with mean -KL, var 2 KL).
    kl_el = kl_divergence(Normal(mu_theta.detach(), std), Normal(mu_ref, std))
    return (0.5 * kl_el**2).mean().item()


@pytest.mark.parametrize("name", SAMPLED)
@pytest.mark.parametrize("case", ["image_case", "small_case"])
def test_sampled_estimators_match_torch_kl_value_and_gradient(name, case, request):
    mu_theta, mu_ref, std, sample = request.getfixturevalue(case)
    m = _measure(_estimator(name), mu_theta, mu_ref, std, sample)
    exact_std = std.flatten()[0] if case == "image_case" else std
    m["k2_bias"] = _k2_bias(mu_theta, mu_ref, exact_std)
    assert m["k2_bias"] < 0.05 * m["kl"]  # the k2 bias is small at these gaps (per-element KL about 0.03)
    _check_unbiased(m, name)


def test_gaussian_mean_is_exact_per_sample():
    g = torch.Generator().manual_seed(2)
    cur = torch.randn(4, 2, 3, 5, generator=g).requires_grad_(True)
    ref = cur.detach() + 0.1 * torch.randn(4, 2, 3, 5, generator=g)
    std = torch.tensor([0.3, 0.1, 0.05, 1.0]).reshape(4, 1, 1, 1)
    sample = torch.randn(4, 2, 3, 5, generator=g)  # unused by the closed form
    ours = get_kl_estimator("gaussian_mean")(cur, ref, std, sample)
    exact = kl_divergence(Normal(cur, std.expand_as(cur)), Normal(ref, std.expand_as(ref))).flatten(1).mean(1)
    torch.testing.assert_close(ours, exact)
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0])
    (g_ours,) = torch.autograd.grad((weights * ours).sum(), cur)
    (g_exact,) = torch.autograd.grad((weights * exact).sum(), cur)
    torch.testing.assert_close(g_ours, g_exact)


def test_element_averaged_log_probs_fail_the_same_checks(image_case):
    """Issue 15's form: the estimator applied to element-averaged log-probs, which the tests above reject."""
    mu_theta, mu_ref, std, sample = image_case

    def log_ratio_of_means(cur, ref, std, x):
        return Normal(ref, std).log_prob(x).flatten(1).mean(1) - Normal(cur, std).log_prob(x).flatten(1).mean(1)

    old = {
        "k1": lambda *a: -log_ratio_of_means(*a),
        "k2": lambda *a: 0.5 * log_ratio_of_means(*a) ** 2,
        "k3": lambda *a: torch.exp(log_ratio_of_means(*a)) - 1.0 - log_ratio_of_means(*a),
    }
    d = 3 * 32 * 32
    for name, fn in old.items():
        m = _measure(fn, mu_theta, mu_ref, std, sample)
        assert m["rel_err"] > 0.9 and m["cos"] < 0.99, m  # the gradient misses the KL gradient entirely
        if name == "k1":
            assert abs(m["cos"]) < 0.1, m  # the score has mean zero: the gradient is noise
        else:
            # The element mean of log r has mean -KL and variance 2 KL / D, so E[k2] = KL^2 / 2 + KL / D:
            # a ratio KL / 2 + 1 / D (k3 agrees to higher order), about 1 / D of the KL when the KL is small.
            assert m["value_ratio"] == pytest.approx(m["kl"] / 2 + 1 / d, rel=0.05), m


def test_log_ratio_matches_torch_distributions_and_hand_values():
    g = torch.Generator().manual_seed(3)
    cur, ref, x = (torch.randn(3, 7, generator=g) for _ in range(3))
    std = torch.rand(3, 1, generator=g) + 0.5
    exact = Normal(ref, std).log_prob(x) - Normal(cur, std).log_prob(x)
    for pathwise in (False, True):
        torch.testing.assert_close(gaussian_log_ratio(cur, ref, std, x, pathwise), exact)
    # mu_theta = 1, mu_ref = 0, std = 1, x = 1.5: log r = -1.5^2 / 2 + 0.5^2 / 2 = -1.
    one = [torch.tensor([[v]]) for v in (1.0, 0.0, 1.0, 1.5)]
    expected = {"k1": 1.0, "k2": 0.5, "k3": math.exp(-1.0), "gaussian_mean": 0.5}
    for name, value in expected.items():
        torch.testing.assert_close(get_kl_estimator(name)(*one), torch.tensor([value]))


def test_gradient_forms_match_autograd_of_torch_log_probs():
    """k2 and k3 hold the sample fixed (score function); k1 holds the noise fixed (x moves with mu_theta)."""
    g = torch.Generator().manual_seed(4)
    cur = torch.randn(5, 6, generator=g).requires_grad_(True)
    ref = cur.detach() + 0.3 * torch.randn(5, 6, generator=g)
    std = torch.tensor(0.7)
    x = cur.detach() + std * torch.randn(5, 6, generator=g)

    def log_r(x_):
        return Normal(ref, std).log_prob(x_) - Normal(cur, std).log_prob(x_)

    reparam = x + (cur - cur.detach())
    independent = {
        "k1": (-log_r(reparam)).mean(1),
        "k2": (0.5 * log_r(x) ** 2).mean(1),
        "k3": (torch.exp(log_r(x)) - 1.0 - log_r(x)).mean(1),
    }
    for name, exact in independent.items():
        ours = get_kl_estimator(name)(cur, ref, std, x)
        torch.testing.assert_close(ours, exact)
        (g_ours,) = torch.autograd.grad(ours.sum(), cur)
        (g_exact,) = torch.autograd.grad(exact.sum(), cur)
        torch.testing.assert_close(g_ours, g_exact)


def test_estimators_take_reduced_precision_inputs_and_return_float32():
    g = torch.Generator().manual_seed(5)
    cur = torch.randn(2, 8, generator=g)
    ref = cur + 0.01 * torch.randn(2, 8, generator=g)
    x = (cur + 0.1 * torch.randn(2, 8, generator=g)).bfloat16()
    for name in KL_ESTIMATORS:
        out = get_kl_estimator(name)(cur.bfloat16(), ref.bfloat16(), 0.1, x)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert bool((out >= 0).all()) or name == "k1"  # k1 is the only one that can go negative


def test_k3_clamps_before_exp():
    # gap 10, noise -55: log r = -10 * (-55 + 5) = 500, far past float32's exp range.
    cur, ref, x = torch.tensor([[10.0]]), torch.tensor([[0.0]]), torch.tensor([[-45.0]])
    out = get_kl_estimator("k3")(cur, ref, 1.0, x)
    torch.testing.assert_close(out, torch.tensor([math.exp(K3_LOG_RATIO_CLAMP) - 1.0 - 500.0]))


def test_registries():
    assert POLICY_LOSSES["grpo_clip"].fn is grpo_clip and get_policy_loss("grpo_clip") is grpo_clip
    assert POLICY_LOSSES["grpo_clip"].settings is ClipSettings
    assert set(KL_ESTIMATORS) >= {"gaussian_mean", "k1", "k2", "k3"}
    with pytest.raises(KeyError, match="grpo_clip"):
        get_policy_loss("nope")
    with pytest.raises(KeyError, match="gaussian_mean"):
        get_kl_estimator("k4")

    @register_policy_loss("test_only_loss", settings=ClipSettings)
    def _custom(*args, **kwargs):
        return grpo_policy_loss(*args, **kwargs)

    @register_kl_estimator("test_only_kl")
    def _abs_gap(cur_mean, ref_mean, std, sample):
        return (cur_mean - ref_mean).abs().flatten(1).mean(1)

    try:
        assert get_policy_loss("test_only_loss") is _custom
        assert get_kl_estimator("test_only_kl") is _abs_gap
        with pytest.raises(ValueError, match="already registered"):
            register_policy_loss("grpo_clip", settings=ClipSettings)(_custom)
        with pytest.raises(ValueError, match="already registered"):
            register_kl_estimator("k3")(_abs_gap)
    finally:
        POLICY_LOSSES.pop("test_only_loss")
        KL_ESTIMATORS.pop("test_only_kl")


@dataclass(frozen=True)
class _Sharpness:
    clip_range: float = 1e-3
    sharpness: float = 2.0
    use_sharpening: bool = False


def test_a_loss_gets_its_settings_from_the_train_config_then_its_defaults_then_the_overrides():
    @register_policy_loss("test_sharp", settings=_Sharpness)
    def _sharp(x, s):
        return x.log_prob.mean() * s.sharpness, {}

    try:
        train = ml_collections.ConfigDict({"clip_range": 0.2, "beta": 0.5, "use_sharpening": True})
        assert loss_settings("test_sharp", train) == _Sharpness(0.2, 2.0, True)  # sharpness: the default
        # an override of a field the loss has wins; one it lacks (beta) is not its business
        assert loss_settings("test_sharp", train, sharpness=3.0, beta=0.0) == _Sharpness(0.2, 3.0, True)
        # the switches of every loss, each with the losses that read it
        assert policy_loss_switches()["use_sharpening"] == ["test_sharp"]
        assert loss_settings("grpo_clip", train) == ClipSettings(0.2, 5.0, 10.0, 0.5)
    finally:
        POLICY_LOSSES.pop("test_sharp")


@dataclass
class _Unfrozen:
    clip_range: float = 1e-3


@dataclass(frozen=True)
class _NoDefault:
    clip_range: float


@dataclass(frozen=True)
class _ListDefault:
    bounds: tuple = (0.1, 0.2)


@pytest.mark.parametrize(("settings", "match"), [
    (_Unfrozen, "frozen dataclass"), (dict, "frozen dataclass"), (_NoDefault, "'clip_range' needs a default"),
    (_ListDefault, "'bounds' needs a default of type bool, int, float or str"),
])
def test_a_loss_whose_settings_cannot_come_from_the_config_is_refused_at_registration(settings, match):
    with pytest.raises(TypeError, match=match):
        register_policy_loss("test_bad_settings", settings=settings)
    assert "test_bad_settings" not in POLICY_LOSSES


@pytest.mark.parametrize("name", ["gaussian_mean", "k1", "k2", "k3"])
def test_kl_estimators_reject_bad_input(name):
    fn = get_kl_estimator(name)
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        fn(a, torch.zeros(2, 4), 0.1, a)
    with pytest.raises(ValueError, match="same shape"):
        fn(a, a, 0.1, torch.zeros(1, 3))
    with pytest.raises(ValueError, match="batch axis"):
        fn(torch.zeros(3), torch.zeros(3), 0.1, torch.zeros(3))
    with pytest.raises(ValueError, match="broadcast"):
        fn(a, a, torch.ones(3, 1), a)
    with pytest.raises(ValueError, match="std must be > 0"):
        fn(a, a, torch.tensor([[0.1], [0.0]]), a)


def test_sample_weights_make_the_loss_a_weighted_sum_by_hand():
    """Two of four samples kept with weight 1/2 each: the loss is their mean, computed by hand; the excluded ones
    get no gradient; the logged terms are the kept samples' means."""
    logp = torch.tensor([0.1, -0.2, 0.3, 0.05], requires_grad=True)
    old = torch.tensor([0.1, -0.2001, 0.2995, 0.05])
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    kl = torch.tensor([0.01, 0.02, 0.03, 0.04])
    w = torch.tensor([0.5, 0.0, 0.5, 0.0])
    settings = ClipSettings(clip_range=1e-3, adv_clip_max=5.0, log_ratio_clamp=10.0, beta=0.1)
    loss, m = get_policy_loss("grpo_clip")(StepLossInputs(logp, old, adv, w, kl, 0, 1), settings)
    per = []
    for i in (0, 2):  # the kept samples, by hand
        r = math.exp(logp[i].item() - old[i].item())
        per.append(max(-adv[i].item() * r, -adv[i].item() * min(max(r, 1 - 1e-3), 1 + 1e-3)))
    want_policy = 0.5 * per[0] + 0.5 * per[1]
    want_kl = 0.5 * 0.01 + 0.5 * 0.03
    assert loss.item() == pytest.approx(want_policy + 0.1 * want_kl, rel=1e-6)
    assert m["policy_loss"].item() == pytest.approx(want_policy, rel=1e-6)
    assert m["kl_penalty"].item() == pytest.approx(want_kl, rel=1e-6)
    loss.backward()
    assert logp.grad[1] == 0 and logp.grad[3] == 0 and logp.grad[0] != 0


def test_equal_weights_reproduce_the_unweighted_mean():
    torch.manual_seed(0)
    logp, old, adv, kl = torch.randn(8) * 1e-3, torch.randn(8) * 1e-3, torch.randn(8), torch.rand(8)
    weighted, _ = grpo_policy_loss(logp, old, adv, 1e-3, 5.0, 10.0, kl, 0.02, sample_weight=torch.full((8,), 1 / 8))
    plain, _ = grpo_policy_loss(logp, old, adv, 1e-3, 5.0, 10.0, kl, 0.02)
    torch.testing.assert_close(weighted, plain)
