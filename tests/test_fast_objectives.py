import copy
from types import SimpleNamespace

import pytest
import torch
from torch.distributions import Normal

from config.base import get_config
from config.validate import ConfigError, validate
from recam.engine.extensions.fast_objectives import (
    AWMObjective,
    GRPOGuardObjective,
    NFTObjective,
    _forward_keys,
    awm_matching_loss,
    forward_noise,
    guard_step_weights,
    nft_implicit_outputs,
    nft_loss,
    nft_optimality,
    output_mse,
    ratio_norm_log_ratio,
    sample_noise_levels,
    self_normalized_sq_error,
)
from recam.engine.objective import OBJECTIVES, GRPOObjective, step_weights
from recam.engine.rollout import rescore, rollout
from recam.engine.scheduler import DDIMScheduler, FlowMatchScheduler

SHAPE = (2, 3)


def train_config(**over):
    t = get_config().train
    fields = dict(old_policy_decay=0.0, fp_num_timesteps=3, fp_timestep_sampling="stratified", fp_min_noise=0.05,
                  fp_max_noise=0.95, nft_beta=1.0, awm_adv_scale=5.0, awm_clip_range=0.2, awm_old_kl_weight=0.1,
                  guard_dt_weighting=True)
    for k, v in {**fields, **over}.items():
        t[k] = v
    return t


def _col(u, like):
    return u.to(like.dtype).reshape((-1,) + (1,) * (like.dim() - 1))


class FlowForward:
    """The forward-process half of a flow-matching scheduler: x_u = (1 - u) x0 + u noise, output = velocity."""

    is_flow = True

    def noise_to(self, x0, noise, u):
        c = _col(u, x0)
        return (1 - c) * x0 + c * noise, u

    def x0_from_output(self, output, x_t, u):
        return x_t - _col(u, x_t) * output

    def output_target(self, x0, noise, u):
        return noise - x0


class SampleForward:
    """A DDPM-style forward process with an x0-predicting model: x_u = sqrt(1 - u) x0 + sqrt(u) noise."""

    is_flow = False

    def noise_to(self, x0, noise, u):
        return _col((1 - u).sqrt(), x0) * x0 + _col(u.sqrt(), x0) * noise, u

    def x0_from_output(self, output, x_t, u):
        return output

    def output_target(self, x0, noise, u):
        return x0


class Model(torch.nn.Module):
    """denoise(x, t) = a * x + b * t + c, one parameter per element: enough to get distinct per-element gradients."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(0.5 + 0.2 * torch.randn(SHAPE, generator=g))
        self.b = torch.nn.Parameter(0.3 * torch.randn(SHAPE, generator=g))
        self.c = torch.nn.Parameter(0.1 * torch.randn(SHAPE, generator=g))

    def forward(self, x, t):
        return self.a * x + self.b * _col(t.float(), x) + self.c


def perturbed(model, scale, seed):
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return out


def forward_mb(b=4, seed=0, policy=None, old=None, reference=None, advantages=None, weight=None, mask=None,
               sampler=None):
    g = torch.Generator().manual_seed(seed)
    final = torch.randn(b, *SHAPE, generator=g)
    adv = torch.randn(b, generator=g) * 2 if advantages is None else advantages
    weight = torch.full((b,), 1.0 / b) if weight is None else weight
    traj = torch.stack([torch.arange(b) + 10 * seed, torch.arange(b) % 2], 1)
    return SimpleNamespace(epoch=0, final=final, advantages=adv[:, None], sample_weight=weight, traj_ids=traj,
                           policy=policy, old_policy=old, reference=reference, inner_epoch=0, element_mask=mask,
                           sampling_policy=copy.deepcopy(policy) if sampler is None else sampler)


def run(objective, mb, params=(), per_piece=None):
    """Metrics per piece, the loss pieces' values and the gradient of their sum (per_piece: a list that gets each
    piece's own gradient)."""
    pieces, lasts = [], []

    def backward(loss, last):
        pieces.append(loss.detach())
        lasts.append(last)
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
        loss.backward()
        if per_piece is not None:
            per_piece.append([p.grad - b for p, b in zip(params, before, strict=True)])

    metrics = objective.accumulate(mb, backward)
    assert lasts == [False] * (len(lasts) - 1) + [True]
    assert len(metrics) == len(pieces)
    assert all(not v.requires_grad and v.dim() == 0 for m in metrics for v in m.values())
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    for p in params:
        p.grad = None
    return metrics, pieces, grads


def test_objectives_are_registered_with_their_needs():
    assert OBJECTIVES["grpo_guard"] is GRPOGuardObjective
    assert OBJECTIVES["nft"] is NFTObjective and OBJECTIVES["awm"] is AWMObjective
    assert GRPOGuardObjective.needs_log_probs and GRPOGuardObjective.needs_old_means
    assert not GRPOGuardObjective.needs_old_policy
    for cls in (NFTObjective, AWMObjective):
        assert not cls.needs_log_probs and cls.needs_old_policy and not cls.needs_old_means
    for cls in (GRPOGuardObjective, NFTObjective, AWMObjective):
        assert cls.__doc__ and "(" in cls.__doc__


# ---------------------------------------------------------------- GRPO-Guard


def test_ratio_norm_is_the_raw_log_ratio_minus_its_bias_times_std():
    g = torch.Generator().manual_seed(1)
    b = 5
    mu_old = torch.randn(b, *SHAPE, generator=g)
    mu = mu_old + 0.3 * torch.randn(b, *SHAPE, generator=g)
    std = torch.tensor([0.2, 0.5, 1.0, 0.05, 0.3]).reshape(b, 1, 1)
    eps = torch.randn(b, *SHAPE, generator=g)
    x = mu_old + std * eps
    mask = torch.ones(b, *SHAPE)
    mask[0, 1] = 0
    for m in (None, mask):
        w = torch.ones(b, *SHAPE) if m is None else m
        lp = (Normal(mu, std).log_prob(x) * w).sum((1, 2)) / w.sum((1, 2))
        lp_old = (Normal(mu_old, std).log_prob(x) * w).sum((1, 2)) / w.sum((1, 2))
        bias = FlowMatchScheduler(4, 1.0, 0.7).transition_kl(mu_old, mu, std, m)
        d = mu_old - mu
        expected_bias = ((d**2) * w).sum((1, 2)) / w.sum((1, 2)) / (2 * std.reshape(b) ** 2)
        torch.testing.assert_close(bias, expected_bias)
        norm = ratio_norm_log_ratio(lp, lp_old, bias, std, mu)
        # raw log-ratio + bias = -mean(eps d) / s, so the normalised one is mean(eps (mu - mu_old))
        torch.testing.assert_close((lp - lp_old + bias) * std.reshape(b), norm)
        torch.testing.assert_close(norm, ((eps * (mu - mu_old)) * w).sum((1, 2)) / w.sum((1, 2)), atol=1e-5, rtol=1e-4)


def test_ratio_norm_hand_computed():
    # mu_old = 0, mu = [0.1, -0.2], s = 0.5, eps = [1, -1] -> x = [0.5, -0.5]
    # per-element log-ratios: -((0.4)^2 - 0.25) / 0.5 = 0.18 and -((-0.3)^2 - 0.25) / 0.5 = 0.32 -> mean 0.25
    # bias = mean(0.01, 0.04) / (2 * 0.25) = 0.05; normalised = (0.25 + 0.05) * 0.5 = 0.15 = mean(1 * 0.1, -1 * -0.2)
    bias = FlowMatchScheduler(4, 1.0, 0.7).transition_kl(torch.zeros(1, 2), torch.tensor([[0.1, -0.2]]),
                                                        torch.tensor([[0.5]]))
    torch.testing.assert_close(bias, torch.tensor([0.05]))
    norm = ratio_norm_log_ratio(torch.tensor([0.25]), torch.tensor([0.0]), bias, torch.tensor([[0.5]]),
                                torch.zeros(1, 2))
    torch.testing.assert_close(norm, torch.tensor([0.15]))
    with pytest.raises(ValueError, match="one std per sample"):
        ratio_norm_log_ratio(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.tensor([[0.5, 0.4]]),
                             torch.zeros(1, 2))


def test_ratio_norm_with_subspace_noise_centres_the_log_ratio():
    """Noise in 3 cosine components of 8 frames: the log-probs average over those coordinates, so the bias must be
    the KL there. Independent computation: the normalised log-ratio equals mean over coordinates of
    z_old * B^T (mu_theta - mu_old), with z_old the draw's standard normal coordinates, and its mean over many
    draws is ~0 (the bias averaged over every element left it at about -0.04 on the motion job)."""
    from recam.engine.extensions.noise_subspace import SubspaceNoise, cosine_basis

    frames, m, n = 8, 3, 4000
    sched = SubspaceNoise(FlowMatchScheduler(4, 1.0, 0.7), m)
    g = torch.Generator().manual_seed(3)
    mu_old = torch.randn(1, 2, frames, generator=g).expand(n, 2, frames)
    mu = mu_old + 0.4 * torch.randn(1, 2, frames, generator=g).expand(n, 2, frames)
    std = torch.full((n, 1, 1), 0.3)
    basis = cosine_basis(torch.full((n,), frames), frames, m)  # (n, m, F)
    z_old = torch.randn(n, 2, m, generator=g)
    x = mu_old + std * torch.einsum("ncm,nmf->ncf", z_old, basis)

    def log_prob(mean):
        z = torch.einsum("ncf,nmf->ncm", x - mean, basis) / 0.3
        return Normal(0.0, 1.0).log_prob(z).mean((1, 2)) - torch.log(torch.tensor(0.3))

    bias = sched.transition_kl(mu_old, mu, std)
    norm = ratio_norm_log_ratio(log_prob(mu), log_prob(mu_old), bias, std, mu)
    proj = torch.einsum("ncf,nmf->ncm", mu - mu_old, basis)
    torch.testing.assert_close(norm, (z_old * proj).mean((1, 2)), atol=1e-5, rtol=1e-4)
    assert abs(float(norm.mean())) < 4 * float(norm.std()) / n**0.5
    everywhere = FlowMatchScheduler(4, 1.0, 0.7).transition_kl(mu_old, mu, std)
    # the element-mean bias leaves it off centre by far more than its sampling error
    assert abs(float(ratio_norm_log_ratio(log_prob(mu), log_prob(mu_old), everywhere, std, mu).mean())) > 0.01


def test_guard_step_weights_are_inverse_dt_with_mean_one():
    torch.testing.assert_close(guard_step_weights(torch.tensor([0.5, 0.25, 0.25])), torch.tensor([0.6, 1.2, 1.2]))
    torch.testing.assert_close(guard_step_weights(torch.tensor([0.1, 0.1])), torch.ones(2))
    with pytest.raises(ValueError):
        guard_step_weights(torch.tensor([0.1, 0.0]))


def guard_case(beta, reference_seed=None, perturb=0.0):
    sched = FlowMatchScheduler(num_steps=6, shift=3.0, noise_level=0.7, sde_type="sde", num_train_steps=3)
    sampler = Model(0)
    b = 4
    noise = torch.randn(b, sched.num_steps + 1, *SHAPE, generator=torch.Generator().manual_seed(2))
    ro = rollout(sampler, noise, sched)
    with torch.no_grad():
        old_means = torch.stack([rescore(sampler, ro.states, sched, j).mean for j in range(3)], 1)
    policy = perturbed(sampler, perturb, 3) if perturb else sampler
    reference = perturbed(sampler, 0.05, reference_seed) if reference_seed is not None else None
    adv = torch.tensor([1.5, -0.5, 0.7, -1.0])[:, None].expand(b, 3)
    mb = SimpleNamespace(states=ro.states, old_log_probs=ro.log_probs, advantages=adv,
                         sample_weight=torch.tensor([0.25, 0.25, 0.5, 0.0]),
                         traj_ids=torch.zeros(b, 2, dtype=torch.long),
                         policy=policy, reference=reference, inner_epoch=0, element_mask=None, old_means=old_means,
                         step_offset=0, old_policy=None, final=ro.final)
    return sched, policy, mb


@pytest.mark.parametrize("beta", [0.0, 0.02])
def test_guard_on_policy_ratio_is_one_and_loss_equals_grpo(beta):
    sched, policy, mb = guard_case(beta, reference_seed=5 if beta else None)
    t = train_config(beta=beta, guard_dt_weighting=False, clip_range=0.2)
    params = list(policy.parameters())
    guard_grads, grpo_grads = [], []
    gm, gp, _ = run(GRPOGuardObjective(t, sched), mb, params, guard_grads)
    rm, rp, _ = run(GRPOObjective(t, sched), mb, params, grpo_grads)
    for m in gm:
        assert m["mean_ratio"].item() == 1.0 and m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
        assert m["ratio_norm_bias"].item() == 0.0
    for a, b in zip(gp, rp, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(gm, rm, strict=True):
        torch.testing.assert_close(a["loss"], b["loss"])
        torch.testing.assert_close(a["kl_penalty"], b["kl_penalty"])
    # RatioNorm multiplies the log-ratio by the step's std s_j, so the policy term's gradient is s_j times grpo's
    # (the KL term's is the same)
    with torch.no_grad():
        stds = [float(rescore(policy, mb.states, sched, j).std.flatten()[0]) for j in range(3)]
    kl_grads = [[torch.zeros_like(p) for p in params] for _ in range(3)]
    if beta:  # with A = 0 grpo's policy term has no gradient: what is left is the KL's
        mb.advantages = torch.zeros_like(mb.advantages)
        kl_grads = []
        run(GRPOObjective(t, sched), mb, params, kl_grads)
    for j in range(3):
        for a, b, kl in zip(guard_grads[j], grpo_grads[j], kl_grads[j], strict=True):
            torch.testing.assert_close(a, stds[j] * (b - kl) + kl)


def test_guard_dt_weighting_scales_only_the_policy_term():
    sched, policy, mb = guard_case(0.0, perturb=0.02)
    params = list(policy.parameters())
    flat_m, flat_p, _ = run(GRPOGuardObjective(train_config(beta=0.0, guard_dt_weighting=False), sched), mb, params)
    weighted = GRPOGuardObjective(train_config(beta=0.0), sched)
    w_m, w_p, _ = run(weighted, mb, params)
    w = guard_step_weights(torch.tensor([sched.step_dt(j) for j in range(3)]))
    assert not torch.allclose(w, torch.ones(3))  # shift 3 spreads the steps' dt
    for j in range(3):
        torch.testing.assert_close(w_p[j], w[j] * flat_p[j])
        torch.testing.assert_close(w_m[j]["guard_step_weight"], w[j])
        torch.testing.assert_close(w_m[j]["policy_loss"], flat_m[j]["policy_loss"])
    # off-policy the raw log-ratio sits below 0 on average while the normalised ratio does not carry its bias
    assert all(m["ratio_norm_bias"].item() > 0 for m in w_m)


def test_guard_needs_flow_and_old_means():
    t = train_config()
    with pytest.raises(ValueError, match="flow"):
        GRPOGuardObjective(t, SampleForward())
    sched, _, mb = guard_case(0.0)
    mb.old_means = None
    with pytest.raises(ValueError, match="old_means"):
        GRPOGuardObjective(t, sched).accumulate(mb, lambda loss, last: None)


# ---------------------------------------------------------------- forward-process noise


def test_noise_levels_stratified_and_uniform():
    g = torch.Generator().manual_seed(0)
    u = sample_noise_levels(4, 0.2, 0.6, "stratified", g)
    edges = torch.linspace(0.2, 0.6, 5)
    assert bool(((u >= edges[:-1]) & (u < edges[1:])).all())
    v = sample_noise_levels(1000, 0.2, 0.6, "uniform", g)
    assert 0.2 <= v.min() and v.max() < 0.6 and abs(v.mean().item() - 0.4) < 0.02
    with pytest.raises(ValueError):
        sample_noise_levels(2, 0.6, 0.2, "uniform", g)
    with pytest.raises(ValueError):
        sample_noise_levels(2, 0.2, 0.6, "logit_normal", g)


def test_forward_noise_is_per_sample_and_reproducible():
    keys = [(1, 0, 0, 5, 0), (1, 0, 0, 5, 1), (1, 0, 0, 6, 0)]
    u, eps = forward_noise(keys, 3, SHAPE, 0.1, 0.9, "stratified")
    u2, eps2 = forward_noise(keys[1:], 3, SHAPE, 0.1, 0.9, "stratified")
    assert torch.equal(u[1:], u2) and torch.equal(eps[1:], eps2)
    assert u.shape == (3, 3) and eps.shape == (3, 3, *SHAPE)
    assert not torch.equal(eps[0], eps[1])
    epoch1, _ = forward_noise([(1, 1, 0, 5, 0)], 3, SHAPE, 0.1, 0.9, "stratified")
    assert not torch.equal(epoch1[0], u[0])


# ---------------------------------------------------------------- DiffusionNFT


def test_nft_optimality_clips():
    adv = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0])
    torch.testing.assert_close(nft_optimality(adv, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))
    torch.testing.assert_close(nft_optimality(torch.tensor([-1.0, 1.0, 3.0]), 2.0), torch.tensor([0.25, 0.75, 1.0]))


def test_nft_loss_hand_computed_on_a_linear_model():
    # x0 = [1, 2], eps = [0.5, -1], u = 0.5 -> x_t = [0.75, 0.5]; o = 0.5 x_t = [0.375, 0.25];
    # o_old = 0.3 x_t = [0.225, 0.15]; beta = 0.5: o+ = [0.3, 0.2], o- = 1.5 o_old - 0.5 o = [0.15, 0.1]
    # x0+ = x_t - 0.5 o+ = [0.6, 0.4]: err [-0.4, -1.6], mean sq 1.36, mean |.| 1.0 -> L+ = 1.36
    # x0- = [0.675, 0.45]: err [-0.325, -1.55], mean sq 1.2540625, mean |.| 0.9375 -> L- = 1.3376667
    # A = 2.5 -> r = 0.75; loss = (0.75 * 1.36 + 0.25 * 1.3376667) / 0.5 = 2.7088333
    sched = FlowForward()
    x0 = torch.tensor([[1.0, 2.0]])
    u = torch.tensor([0.5])
    x_t, time = sched.noise_to(x0, torch.tensor([[0.5, -1.0]]), u)
    o_pos, o_neg = nft_implicit_outputs(0.5 * x_t, 0.3 * x_t, 0.5)
    r = nft_optimality(torch.tensor([2.5]), 5.0)
    loss, pos, neg = nft_loss(sched.x0_from_output(o_pos, x_t, u), sched.x0_from_output(o_neg, x_t, u), x0, r, 0.5)
    torch.testing.assert_close(pos, torch.tensor([1.36]))
    torch.testing.assert_close(neg, torch.tensor([4013 / 3000]))
    torch.testing.assert_close(loss, torch.tensor([(0.75 * 1.36 + 0.25 * 4013 / 3000) / 0.5]))


@pytest.mark.parametrize("r", [0.5, 0.8, 0.1])
def test_nft_output_gradient_matches_the_analytic_form(r):
    # d loss / d o = [r 2 e+ / w+ - (1 - r) 2 e- / w-] * (d x0 / d o) / D, with e+- = x0+- - x0, w+- the detached
    # mean |e+-| and D the element count (beta cancels: d o+- / d o = +-beta, loss / beta)
    g = torch.Generator().manual_seed(4)
    x0, x_t = torch.randn(3, *SHAPE, generator=g), torch.randn(3, *SHAPE, generator=g)
    u = torch.tensor([0.3, 0.6, 0.9])
    old = torch.randn(3, *SHAPE, generator=g)
    sched = FlowForward()
    for o in (old.clone(), old + 0.1 * torch.randn(3, *SHAPE, generator=g)):
        o = o.requires_grad_(True)
        pos, neg = nft_implicit_outputs(o, old, 0.7)
        x_pos, x_neg = sched.x0_from_output(pos, x_t, u), sched.x0_from_output(neg, x_t, u)
        loss, _, _ = nft_loss(x_pos, x_neg, x0, torch.full((3,), r), 0.7)
        (grad,) = torch.autograd.grad(loss.sum(), o)
        e_pos, e_neg = (x_pos - x0).detach(), (x_neg - x0).detach()
        w_pos, w_neg = e_pos.abs().mean((1, 2), keepdim=True), e_neg.abs().mean((1, 2), keepdim=True)
        expected = (r * 2 * e_pos / w_pos - (1 - r) * 2 * e_neg / w_neg) * -_col(u, x_t) / e_pos[0].numel()
        torch.testing.assert_close(grad, expected)
        if r == 0.5 and torch.equal(o, old):  # equal and opposite pulls
            torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-6, rtol=0)


def ddim(prediction_type):
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    return DDIMScheduler(torch.cumprod(1 - betas, 0), 10, 1.0, prediction_type)


FORWARD_SCHEDULERS = [FlowForward(), SampleForward(), FlowMatchScheduler(10, 3.0, 0.7), ddim("epsilon"), ddim("sample")]


@pytest.mark.parametrize("sched", FORWARD_SCHEDULERS)
def test_nft_neutral_case_has_zero_policy_gradient(sched):
    policy = Model(0)
    mb = forward_mb(policy=policy, old=copy.deepcopy(policy), advantages=torch.zeros(4))
    params = list(policy.parameters())
    metrics, pieces, grads = run(NFTObjective(train_config(beta=0.0), sched), mb, params)
    assert len(pieces) == 3
    for grad in grads:
        torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-6, rtol=0)
    assert all(m["mean_optimality"].item() == 0.5 for m in metrics)
    # a positive advantage pulls: the gradient is no longer zero
    mb.advantages = torch.ones(4, 1)
    _, _, grads = run(NFTObjective(train_config(beta=0.0), sched), mb, params)
    assert sum(float(g.abs().sum()) for g in grads) > 1e-3


def test_nft_objective_is_the_pure_loss_on_its_draws():
    sched = FlowForward()
    policy = Model(0)
    old, ref = perturbed(policy, 0.05, 1), perturbed(policy, 0.1, 2)
    weight = torch.tensor([0.5, 0.25, 0.25, 0.0])
    mask = torch.ones(4, *SHAPE)
    mask[1, :, 2] = 0
    mb = forward_mb(policy=policy, old=old, reference=ref, weight=weight, mask=mask)
    t = train_config(beta=0.03, nft_beta=0.5)
    metrics, pieces, _ = run(NFTObjective(t, sched), mb, list(policy.parameters()))
    levels, noise = forward_noise(_forward_keys(mb), 3, SHAPE, t.fp_min_noise, t.fp_max_noise, "stratified")
    r = nft_optimality(mb.advantages[:, 0], t.adv_clip_max)
    with torch.no_grad():
        for k in range(3):
            u = levels[:, k]
            x_t, time = sched.noise_to(mb.final, noise[:, k], u)
            o, o_old = policy(x_t, time), old(x_t, time)
            pos, neg = nft_implicit_outputs(o, o_old, 0.5)
            per, _, _ = nft_loss(sched.x0_from_output(pos, x_t, u), sched.x0_from_output(neg, x_t, u), mb.final, r,
                                 0.5, mask)
            kl = output_mse(o, ref(x_t, time), mask)
            torch.testing.assert_close(pieces[k], ((weight * per).sum() + 0.03 * (weight * kl).sum()) / 3)
            torch.testing.assert_close(metrics[k]["kl_penalty"], (weight * kl).sum() / weight.sum())
    # the same samples in two micro-batches draw the same noise: the losses add up
    halves = []
    for rows in (slice(0, 2), slice(2, 4)):
        part = forward_mb(policy=policy, old=old, reference=ref, weight=weight, mask=mask)
        for name in ("final", "advantages", "sample_weight", "traj_ids", "element_mask"):
            setattr(part, name, getattr(mb, name)[rows])
        halves.append(run(NFTObjective(t, sched), part, list(policy.parameters()))[1])
    for k in range(3):
        torch.testing.assert_close(halves[0][k] + halves[1][k], pieces[k])


def test_nft_self_normalized_error_floor_and_mask():
    x0 = torch.zeros(2, 4)
    x0_hat = torch.tensor([[1.0, -1.0, 2.0, 100.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    out = self_normalized_sq_error(x0_hat, x0, mask)
    torch.testing.assert_close(out, torch.tensor([2.0 / (4.0 / 3.0), 0.0]))


# ---------------------------------------------------------------- Advantage Weighted Matching


@pytest.mark.parametrize("sched", FORWARD_SCHEDULERS)
def test_awm_on_policy_ratio_is_one_and_gradient_is_advantage_weighted_matching(sched):
    policy = Model(0)
    weight = torch.tensor([0.25, 0.25, 0.5, 0.0])
    adv = torch.tensor([7.0, -1.0, 0.5, 2.0])
    mb = forward_mb(policy=policy, old=copy.deepcopy(policy), weight=weight, advantages=adv)
    t = train_config(beta=0.0)
    params = list(policy.parameters())
    metrics, pieces, grads = run(AWMObjective(t, sched), mb, params)
    for m in metrics:
        assert m["mean_ratio"].item() == 1.0 and m["ratio_min"].item() == 1.0 and m["ratio_max"].item() == 1.0
        assert m["clipfrac"].item() == 0.0 and m["old_kl_penalty"].item() == 0.0
    levels, noise = forward_noise(_forward_keys(mb), 3, SHAPE, t.fp_min_noise, t.fp_max_noise, "stratified")
    scaled = adv.clamp(-5, 5) / 5
    hand = 0
    for k in range(3):
        x_t, time = sched.noise_to(mb.final, noise[:, k], levels[:, k])
        fm = ((policy(x_t, time) - sched.output_target(mb.final, noise[:, k], levels[:, k])) ** 2).mean((1, 2))
        hand = hand + (weight * scaled * fm).sum() / 3
        torch.testing.assert_close(pieces[k], -(weight * scaled).sum() / 3)
    expected = torch.autograd.grad(hand, params)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_awm_ratio_is_against_the_sampler_not_the_old_policy():
    """The old policy (an average of earlier policies) differs from the weights that sampled: the ratio is still
    exactly 1 before any update, and the average only enters as the velocity pull (measured before the fix:
    |ratio - 1| 2e-3 from the second epoch of smoke+awm, positive-advantage samples clipping first)."""
    sched = FlowForward()
    policy = Model(0)
    old = perturbed(policy, 0.2, 4)
    mb = forward_mb(policy=policy, old=old, advantages=torch.tensor([3.0, -2.0, 1.0, -1.0]))
    t = train_config(beta=0.0, awm_old_kl_weight=0.1)
    metrics, _, _ = run(AWMObjective(t, sched), mb, list(policy.parameters()))
    for m in metrics:
        assert m["mean_ratio"].item() == 1.0 and m["clipfrac"].item() == 0.0
        assert m["old_kl_penalty"].item() > 1e-4
    # the sampler is what the ratio divides by: a sampler two updates behind gives ratios away from 1
    mb.sampling_policy = old
    metrics, _, _ = run(AWMObjective(t, sched), mb, list(policy.parameters()))
    assert any(abs(m["mean_ratio"].item() - 1.0) > 1e-3 for m in metrics)
    mb.sampling_policy = None
    with pytest.raises(ValueError, match="sampling_policy"):
        AWMObjective(t, sched).accumulate(mb, lambda loss, last: None)


def test_awm_clipping_matches_a_loop():
    g = torch.Generator().manual_seed(7)
    n = 64
    l_old = torch.rand(n, generator=g)
    l_cur = (l_old + 0.4 * torch.randn(n, generator=g)).requires_grad_(True)
    adv = 4 * torch.randn(n, generator=g)
    w = torch.rand(n, generator=g)
    loss, m = awm_matching_loss(-l_cur, -l_old, adv, 5.0, 5.0, 0.2, 10.0, w)
    total, clipped = 0.0, 0
    for i in range(n):
        ratio = torch.exp(-(l_cur[i] - l_old[i]))
        a = max(-5.0, min(5.0, adv[i].item())) / 5.0
        unclipped, clip = -a * ratio, -a * ratio.clamp(0.8, 1.2)
        total = total + w[i] * (unclipped if unclipped.item() >= clip.item() else clip)
        clipped += not 0.8 <= ratio.item() <= 1.2
    torch.testing.assert_close(loss, total)
    torch.testing.assert_close(torch.autograd.grad(loss, l_cur)[0], torch.autograd.grad(total, l_cur)[0])
    assert abs(m["clipfrac"].item() - clipped / n) < 1e-6 and 0 < clipped < n


def test_awm_penalties_and_neutral_case():
    sched = FlowForward()
    policy = Model(0)
    old, ref = perturbed(policy, 0.05, 1), perturbed(policy, 0.1, 2)
    params = list(policy.parameters())
    mb = forward_mb(policy=policy, old=old, reference=ref, advantages=torch.zeros(4))
    _, _, grads = run(AWMObjective(train_config(beta=0.0, awm_old_kl_weight=0.0), sched), mb, params)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    # with A = 0 the loss is the two velocity pulls alone
    t = train_config(beta=0.02, awm_old_kl_weight=0.1)
    metrics, pieces, _ = run(AWMObjective(t, sched), mb, params)
    for m, piece in zip(metrics, pieces, strict=True):
        torch.testing.assert_close(piece * 3, 0.02 * m["kl_penalty"] + 0.1 * m["old_kl_penalty"])
        torch.testing.assert_close(m["loss"], 0.02 * m["kl_penalty"] + 0.1 * m["old_kl_penalty"])
        assert m["old_kl_penalty"].item() > 0


def test_forward_objectives_validate():
    with pytest.raises(ValueError):
        NFTObjective(train_config(nft_beta=0.0), FlowForward())
    with pytest.raises(ValueError):
        AWMObjective(train_config(fp_min_noise=0.9, fp_max_noise=0.1), FlowForward())
    with pytest.raises(ValueError):
        AWMObjective(train_config(fp_num_timesteps=0), FlowForward())
    mb = forward_mb(policy=Model(0), old=None)
    with pytest.raises(ValueError, match="old policy"):
        NFTObjective(train_config(beta=0.0), FlowForward()).accumulate(mb, lambda loss, last: None)


# ---- GRPO's step weighting (train.step_weighting) ----

def test_step_std_matches_hand_formulas():
    # DDIM: std_j = eta sqrt((1 - a_prev) / (1 - a_t)) sqrt(1 - a_t / a_prev); flow SDE: a sqrt(s / (1 - s)) sqrt(dt),
    # with s_next for s inside (1 - s) at s = 1 (Flow-GRPO's substitution at the first step)
    ac = torch.linspace(0.999, 0.01, 100, dtype=torch.float64)
    sched = DDIMScheduler(ac.float(), 10, 0.8, "sample", 4)
    for j in range(9):
        a_t, a_prev = float(ac[int(sched.timesteps[j])]), float(ac[int(sched.prev[j])])
        expected = 0.8 * ((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)) ** 0.5
        assert sched.step_std(j) == pytest.approx(expected, rel=1e-5)
    flow = FlowMatchScheduler(num_steps=6, shift=3.0, noise_level=0.7, sde_type="sde")
    for j in range(5):
        s, s_next = float(flow.sigmas[j]), float(flow.sigmas[j + 1])
        one_minus = 1 - (s_next if s == 1 else s)
        assert flow.step_std(j) == pytest.approx(0.7 * (s / one_minus) ** 0.5 * (s - s_next) ** 0.5, rel=1e-5)


@pytest.mark.parametrize("sched", [DDIMScheduler(torch.linspace(0.999, 0.01, 100), 10, 1.0, "sample", 8),
                                   FlowMatchScheduler(num_steps=8, shift=3.0, noise_level=0.7, sde_type="sde"),
                                   FlowMatchScheduler(num_steps=8, shift=3.0, noise_level=0.7, sde_type="cps")],
                         ids=["ddim", "flow_sde", "cps"])
def test_score_balanced_weights_equalise_the_log_prob_gradient_per_unit_output(sched):
    """Independent of the weights' formula: autograd's d log p_j / d output, with next states drawn from step j,
    has RMS c_j / std_j per element; times the weight it must be the same at every step (and the weights mean 1)."""
    T = 6
    w = step_weights(sched, 1, T, "score_balanced")
    assert w.mean().item() == pytest.approx(1.0) and step_weights(sched, 1, T, "uniform").tolist() == [1.0] * T
    g = torch.Generator().manual_seed(0)
    rms = []
    for j in range(1, 1 + T):
        x = torch.randn(4000, 8, generator=g)
        out = torch.randn(4000, 8, generator=g).requires_grad_(True)
        drawn = sched.transition(j, out.detach(), x, noise=torch.randn(4000, 8, generator=g)).prev_sample
        step = sched.transition(j, out, x, next_state=drawn)
        (grad,) = torch.autograd.grad(step.log_prob.sum(), out)
        rms.append(float(grad.pow(2).mean().sqrt()) * 8)  # log_prob averages the 8 elements
    weighted = torch.tensor(rms, dtype=torch.float64) * w
    assert float(weighted.std() / weighted.mean()) < 0.03, (rms, w)
    assert max(rms) / min(rms) > 2  # the unweighted gradients do differ


def test_grpo_step_weighting_scales_each_steps_gradient():
    sched, policy, mb = guard_case(0.02, reference_seed=5, perturb=0.02)
    params = list(policy.parameters())
    uniform, balanced = [], []
    _, pieces_u, _ = run(GRPOObjective(train_config(beta=0.02), sched), mb, params, uniform)
    metrics, pieces_b, _ = run(GRPOObjective(train_config(beta=0.02, step_weighting="score_balanced"), sched), mb,
                               params, balanced)
    w = step_weights(sched, 0, 3, "score_balanced")
    assert float((w - 1).abs().max()) > 0.05
    for j in range(3):
        assert metrics[j]["step_weight"].item() == pytest.approx(float(w[j]))
        torch.testing.assert_close(pieces_b[j], pieces_u[j] * float(w[j]))
        for a, b in zip(balanced[j], uniform[j], strict=True):
            torch.testing.assert_close(a, b * float(w[j]))


def test_step_weighting_is_validated():
    with pytest.raises(ValueError, match="score_balanced"):
        step_weights(DDIMScheduler(torch.linspace(0.999, 0.01, 100), 10, 1.0, "sample", 3), 0, 3, "noisy")
    with pytest.raises(ValueError, match="std > 0"):  # eta 0: no step is stochastic, nothing to balance
        step_weights(DDIMScheduler(torch.linspace(0.999, 0.01, 100), 10, 0.0, "sample", 3), 0, 3, "score_balanced")
    c = get_config()
    c.train.step_weighting = "noise"
    with pytest.raises(ConfigError, match="train.step_weighting"):
        validate(c, 1)
    c.train.step_weighting, c.train.objective = "score_balanced", "awm"
    with pytest.raises(ConfigError, match="train.step_weighting='score_balanced' weights GRPO"):
        validate(c, 1)


def test_step_gradients_script_tables_every_trained_step():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "scripts/measure/step_gradients.py", "--config", "config/grpo.py:toy",
                        "--config.toy.pretrain_steps=20", "--conditions", "4"], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [[float(x) for x in line.strip("|").split("|")] for line in p.stdout.splitlines()
            if re.match(r"^\| \d", line)]
    from config.grpo import toy

    c = toy()
    assert [int(r[0]) for r in rows] == list(range(round(c.train.timestep_fraction * c.sample.num_steps)))
    assert sum(r[5] for r in rows) / len(rows) == pytest.approx(1.0, abs=0.01)  # weights printed to 3 digits
    for r in rows:
        assert r[4] > 0 and r[6] == pytest.approx(r[4] * r[5], rel=0.01)
    assert "largest / smallest step" in p.stdout
