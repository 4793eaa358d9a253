import math

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from recam.engine.sde import (
    StepOutput,
    cps_step,
    ddim_step_with_logprob,
    flow_sde_step,
    flow_sigmas,
    gaussian_kl_between_means,
    ode_step,
)

VIDEO_SHAPE = (2, 3, 8, 32, 32)
MOTION_SHAPE = (2, 263, 1, 196)


def _video_pair(seed: int = 0, shape=VIDEO_SHAPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _normal_mean_log_prob(x, mean, std):
    """Reference log-prob: torch.distributions per element, then mean over non-batch dims."""
    lp = Normal(mean.double(), std.double().expand_as(mean)).log_prob(x.double())
    return lp.flatten(1).mean(1)


# ---------------------------------------------------------------- schedule


def test_flow_sigmas_endpoints_and_shift_formula():
    s = flow_sigmas(4)
    assert s.dtype == torch.float32 and s.shape == (5,)
    torch.testing.assert_close(s, torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted = flow_sigmas(4, shift=3.0)
    # hand values: 3 s / (1 + 2 s) at s = 0.75, 0.5, 0.25
    torch.testing.assert_close(shifted, torch.tensor([1.0, 2.25 / 2.5, 1.5 / 2.0, 0.75 / 1.5, 0.0]))
    assert bool((shifted[1:] < shifted[:-1]).all())


@pytest.mark.parametrize("bad", [dict(num_steps=0), dict(num_steps=2.5), dict(num_steps=3, shift=0.0)])
def test_flow_sigmas_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        flow_sigmas(**bad)


# ---------------------------------------------------------------- flow SDE


def _flow_sde_reference(x, v, sigma, sigma_next, a):
    """float64 re-derivation of the Flow-GRPO mean and std, with sigmas[1] substituted at sigma = 1."""
    x, v = x.double(), v.double()
    dt = sigma_next - sigma
    denom_sigma = sigma_next if sigma == 1.0 else sigma
    sigma_t = a * math.sqrt(sigma / (1.0 - denom_sigma))
    mean = x * (1 + sigma_t**2 / (2 * sigma) * dt) + v * (1 + sigma_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, sigma_t * math.sqrt(-dt)


@pytest.mark.parametrize("sigma,sigma_next", [(0.8, 0.7), (1.0, 0.9), (0.1, 0.0)])
def test_flow_sde_mean_std_and_log_prob_match_reference(sigma, sigma_next):
    x, v = _video_pair(1)
    out = flow_sde_step(v, sigma, sigma_next, x, 0.7, generator=torch.Generator().manual_seed(5))
    assert isinstance(out, StepOutput)
    ref_mean, ref_std = _flow_sde_reference(x, v, sigma, sigma_next, 0.7)
    torch.testing.assert_close(out.mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double().flatten(), torch.full((2,), ref_std, dtype=torch.float64))
    assert out.log_prob.shape == (2,) and out.log_prob.dtype == torch.float32
    expected = _normal_mean_log_prob(out.prev_sample, out.mean, out.std)
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


def test_flow_sde_samples_are_standard_normal_around_mean():
    x, v = _video_pair(2)
    out = flow_sde_step(v, 0.6, 0.5, x, 0.7, generator=torch.Generator().manual_seed(0))
    z = (out.prev_sample - out.mean) / out.std
    assert abs(z.mean().item()) < 0.02
    assert abs(z.std().item() - 1.0) < 0.02


def test_flow_sde_recompute_is_exactly_on_policy():
    x, v = _video_pair(3)
    rollout = flow_sde_step(v, 0.9, 0.8, x, 0.7, generator=torch.Generator().manual_seed(1))
    again = flow_sde_step(v, 0.9, 0.8, x, 0.7, prev_sample=rollout.prev_sample)
    assert torch.equal(again.log_prob, rollout.log_prob)
    assert torch.equal(torch.exp(again.log_prob - rollout.log_prob), torch.ones(2))


def test_flow_sde_noise_level_zero_is_ode_step_exactly():
    x, v = _video_pair(4)
    sig, sig_next = torch.tensor([0.9, 0.4]), torch.tensor([0.8, 0.1])
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    out = flow_sde_step(v, sig, sig_next, x, 0.0, generator=g)
    assert torch.equal(out.prev_sample, ode_step(v, sig, sig_next, x))
    assert torch.equal(out.log_prob, torch.zeros(2))
    assert torch.equal(out.std.flatten(), torch.zeros(2))
    assert torch.equal(g.get_state(), state)


def test_ode_step_hand_value():
    x = torch.tensor([[1.0, 2.0]])
    v = torch.tensor([[4.0, -2.0]])
    torch.testing.assert_close(ode_step(v, 0.75, 0.5, x), torch.tensor([[0.0, 2.5]]))


def test_flow_sde_batched_sigmas_match_per_sample_loop():
    x, v = _video_pair(5)
    prev = torch.randn(VIDEO_SHAPE, generator=torch.Generator().manual_seed(9))
    sig, sig_next = torch.tensor([1.0, 0.5]), torch.tensor([0.95, 0.3])
    batched = flow_sde_step(v, sig, sig_next, x, 0.7, prev_sample=prev)
    for i in range(2):
        single = flow_sde_step(
            v[i : i + 1], sig[i].item(), sig_next[i].item(), x[i : i + 1], 0.7, prev[i : i + 1]
        )
        torch.testing.assert_close(batched.mean[i : i + 1], single.mean)
        torch.testing.assert_close(batched.log_prob[i : i + 1], single.log_prob)


def test_flow_sde_bf16_inputs_give_float32_log_prob_and_on_policy_ratio():
    x, v = _video_pair(6)
    x, v = x.bfloat16(), v.bfloat16()
    out = flow_sde_step(v, 0.7, 0.6, x, 0.7, generator=torch.Generator().manual_seed(2))
    assert out.prev_sample.dtype == torch.bfloat16
    assert out.log_prob.dtype == torch.float32 and out.mean.dtype == torch.float32
    again = flow_sde_step(v, 0.7, 0.6, x, 0.7, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)
    expected = _normal_mean_log_prob(out.prev_sample.float(), out.mean, out.std)
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


def _euler_plus_noise(v, sigma, sigma_next, x, a):
    """A deliberately wrong SDE step: Euler mean with the Flow-GRPO std but no drift correction."""
    out = flow_sde_step(v, sigma, sigma_next, x, a)
    return out._replace(mean=ode_step(v, sigma, sigma_next, x))


def _gaussian_data_variance_error(step, sigma, dt, a, c=0.5):
    """One step on data x0 ~ N(0, c^2) with the exact (linear) velocity; returns |Var(x') - Var_target|.

    x_s = (1 - s) x0 + s n has variance (1 - s)^2 c^2 + s^2 and E[n - x0 | x_s] = k x_s with
    k = (s - (1 - s) c^2) / var_s. A correct marginal-preserving step has local error O(dt^2).
    """
    var = (1 - sigma) ** 2 * c**2 + sigma**2
    k = (sigma - (1 - sigma) * c**2) / var
    sigma_next = sigma - dt
    out = step(torch.full((1, 1), k), sigma, sigma_next, torch.ones(1, 1), a)
    alpha = out.mean.double().item()  # mean = alpha * x for x = 1
    var_next = alpha**2 * var + out.std.double().item() ** 2
    return abs(var_next - ((1 - sigma_next) ** 2 * c**2 + sigma_next**2))


@pytest.mark.parametrize("sigma", [0.9, 0.6, 0.2])
def test_flow_sde_preserves_marginal_variance_to_second_order(sigma):
    # CPS is left out on purpose: its injected noise s' sin(a pi / 2) does not shrink with dt, so it is not
    # a discretised SDE and only preserves the forward coefficients (tested below), not this local error.
    e1 = _gaussian_data_variance_error(flow_sde_step, sigma, 0.02, 0.7)
    e2 = _gaussian_data_variance_error(flow_sde_step, sigma, 0.01, 0.7)
    assert 3.5 < e1 / e2 < 4.5  # local error O(dt^2): halving dt divides it by 4
    # Without the sigma_t^2 drift corrections the error is only first order: halving dt halves it.
    w1 = _gaussian_data_variance_error(_euler_plus_noise, sigma, 0.02, 0.7)
    w2 = _gaussian_data_variance_error(_euler_plus_noise, sigma, 0.01, 0.7)
    assert w1 / w2 < 2.5


@pytest.mark.parametrize("step", [flow_sde_step, cps_step])
def test_flow_steps_reject_bad_input(step):
    x, v = _video_pair(7)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        step(v, 0.5, 0.5, x, 0.5)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        step(v, 1.2, 0.5, x, 0.5)
    with pytest.raises(ValueError, match="velocity shape"):
        step(v[:, :2], 0.5, 0.4, x, 0.5)
    with pytest.raises(ValueError, match="prev_sample"):
        step(v, 0.5, 0.4, x, 0.5, prev_sample=x[:1])
    with pytest.raises(ValueError, match="noise_level"):
        step(v, 0.5, 0.4, x, -0.1)
    with pytest.raises(ValueError, match="sigma must be"):
        step(v, torch.tensor([0.5, 0.4, 0.3]), 0.2, x, 0.5)
    with pytest.raises(TypeError, match="sigma_next"):
        step(v, 0.5, "0.4", x, 0.5)


# ---------------------------------------------------------------- CPS


def _cps_reference(x, v, sigma, sigma_next, a):
    x, v = x.double(), v.double()
    std = sigma_next * math.sin(a * math.pi / 2)
    x0_hat, x1_hat = x - sigma * v, x + (1 - sigma) * v
    return x0_hat * (1 - sigma_next) + x1_hat * math.sqrt(sigma_next**2 - std**2), std


def test_cps_mean_std_and_log_prob_match_reference():
    x, v = _video_pair(8)
    out = cps_step(v, 0.7, 0.5, x, 0.6, generator=torch.Generator().manual_seed(3))
    ref_mean, ref_std = _cps_reference(x, v, 0.7, 0.5, 0.6)
    torch.testing.assert_close(out.mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std.double().flatten(), torch.full((2,), ref_std, dtype=torch.float64))
    expected = _normal_mean_log_prob(out.prev_sample, out.mean, out.std)
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)


def test_cps_preserves_forward_coefficients_with_exact_velocity():
    x0, noise = _video_pair(9)
    sigma, sigma_next, a = 0.8, 0.6, 0.4
    x = (1 - sigma) * x0 + sigma * noise
    out = cps_step(noise - x0, sigma, sigma_next, x, a)
    # mean = (1 - s') x0 + s' cos(a pi / 2) noise; the noise coefficient grows back to s' with the std.
    expected = (1 - sigma_next) * x0 + sigma_next * math.cos(a * math.pi / 2) * noise
    torch.testing.assert_close(out.mean, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(math.cos(a * math.pi / 2) ** 2 + (out.std[0].item() / sigma_next) ** 2, 1.0)


def test_cps_on_policy_zero_noise_and_last_step():
    x, v = _video_pair(10)
    rollout = cps_step(v, 0.5, 0.25, x, 0.8, generator=torch.Generator().manual_seed(4))
    again = cps_step(v, 0.5, 0.25, x, 0.8, prev_sample=rollout.prev_sample)
    assert torch.equal(again.log_prob, rollout.log_prob)
    zero = cps_step(v, 0.5, 0.25, x, 0.0)
    assert torch.equal(zero.prev_sample, ode_step(v, 0.5, 0.25, x))
    assert torch.equal(zero.log_prob, torch.zeros(2))
    last = cps_step(v, 0.25, 0.0, x, 0.8, generator=torch.Generator().manual_seed(4))
    assert torch.equal(last.std.flatten(), torch.zeros(2))
    assert torch.equal(last.log_prob, torch.zeros(2))
    torch.testing.assert_close(last.prev_sample, x - 0.25 * v)


def test_cps_bf16_and_noise_level_range():
    x, v = _video_pair(11)
    out = cps_step(v.half(), 0.5, 0.25, x.half(), 0.5, generator=torch.Generator().manual_seed(0))
    assert out.prev_sample.dtype == torch.float16 and out.log_prob.dtype == torch.float32
    assert torch.equal(cps_step(v.half(), 0.5, 0.25, x.half(), 0.5, out.prev_sample).log_prob, out.log_prob)
    with pytest.raises(ValueError, match="noise_level"):
        cps_step(v, 0.5, 0.25, x, 1.5)


# ---------------------------------------------------------------- DDIM


def _cosine_alphas_cumprod(num: int = 1000) -> torch.Tensor:
    steps = torch.arange(num + 1, dtype=torch.float64) / num
    f = torch.cos((steps + 0.008) / 1.008 * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0).float()


def _ddim_reference(model_output, t, t_prev, x, alphas, eta, prediction_type):
    """Loop over samples with python floats: closed-form DDIM mean and std in float64."""
    means, stds = [], []
    for i in range(x.shape[0]):
        a_t = alphas[t[i]].item()
        a_s = alphas[t_prev[i]].item() if t_prev[i] >= 0 else 1.0
        xi, oi = x[i].double(), model_output[i].double()
        if prediction_type == "epsilon":
            eps, x0 = oi, (xi - math.sqrt(1 - a_t) * oi) / math.sqrt(a_t)
        else:
            x0, eps = oi, (xi - math.sqrt(a_t) * oi) / math.sqrt(1 - a_t)
        std = eta * math.sqrt((1 - a_s) / (1 - a_t)) * math.sqrt(1 - a_t / a_s)
        means.append(math.sqrt(a_s) * x0 + math.sqrt(1 - a_s - std**2) * eps)
        stds.append(std)
    return torch.stack(means), stds


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample"])
def test_ddim_closed_form_batched_timesteps_and_log_prob(prediction_type):
    alphas = _cosine_alphas_cumprod()
    x, out_ = _video_pair(12, MOTION_SHAPE)
    t, t_prev = torch.tensor([980, 40]), torch.tensor([960, 20])
    out = ddim_step_with_logprob(
        out_, t, t_prev, x, alphas, 0.8, prediction_type, generator=torch.Generator().manual_seed(0)
    )
    assert out.prev_sample.shape == MOTION_SHAPE and out.log_prob.shape == (2,)
    ref_mean, ref_std = _ddim_reference(out_, t, t_prev, x, alphas, 0.8, prediction_type)
    torch.testing.assert_close(out.mean.double(), ref_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.std.double().flatten(), torch.tensor(ref_std, dtype=torch.float64))
    expected = _normal_mean_log_prob(out.prev_sample, out.mean, out.std)
    torch.testing.assert_close(out.log_prob.double(), expected, rtol=1e-5, atol=1e-5)
    again = ddim_step_with_logprob(
        out_, t, t_prev, x, alphas, 0.8, prediction_type, prev_sample=out.prev_sample
    )
    assert torch.equal(again.log_prob, out.log_prob)


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample"])
@pytest.mark.parametrize("eta", [0.0, 0.5])
def test_ddim_mean_matches_diffusers_scheduler(prediction_type, eta):
    from diffusers import DDIMScheduler

    sched = DDIMScheduler(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        clip_sample=False,
        prediction_type=prediction_type,
    )
    sched.set_timesteps(20)
    x, model_output = _video_pair(13)
    t = int(sched.timesteps[3])
    ref = sched.step(model_output, t, x, eta=eta, variance_noise=torch.zeros_like(x)).prev_sample
    out = ddim_step_with_logprob(
        model_output, t, t - 50, x, sched.alphas_cumprod, eta, prediction_type, generator=torch.Generator()
    )
    torch.testing.assert_close(out.mean, ref, rtol=1e-4, atol=1e-4)
    if eta == 0.0:
        assert torch.equal(out.prev_sample, out.mean) and torch.equal(out.log_prob, torch.zeros(2))


def test_ddim_eta_to_zero_approaches_deterministic_and_final_step():
    alphas = _cosine_alphas_cumprod()
    x, eps = _video_pair(14, MOTION_SHAPE)
    det = ddim_step_with_logprob(eps, 500, 450, x, alphas, 0.0)
    tiny = ddim_step_with_logprob(eps, 500, 450, x, alphas, 1e-4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tiny.mean, det.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiny.prev_sample, det.prev_sample, rtol=1e-3, atol=1e-3)
    final = ddim_step_with_logprob(eps, 10, -1, x, alphas, 1.0, generator=torch.Generator().manual_seed(0))
    a_t = alphas[10].double()
    expected = (x.double() - (1 - a_t).sqrt() * eps.double()) / a_t.sqrt()
    torch.testing.assert_close(final.prev_sample.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(final.log_prob, torch.zeros(2))


def test_ddim_bf16_and_bad_input():
    alphas = _cosine_alphas_cumprod()
    x, eps = _video_pair(15, MOTION_SHAPE)
    out = ddim_step_with_logprob(
        eps.bfloat16(), 300, 250, x.bfloat16(), alphas, 1.0, generator=torch.Generator().manual_seed(0)
    )
    assert out.log_prob.dtype == torch.float32 and out.prev_sample.dtype == torch.bfloat16
    again = ddim_step_with_logprob(
        eps.bfloat16(), 300, 250, x.bfloat16(), alphas, 1.0, prev_sample=out.prev_sample
    )
    assert torch.equal(again.log_prob, out.log_prob)
    with pytest.raises(ValueError, match="prediction_type"):
        ddim_step_with_logprob(eps, 300, 250, x, alphas, 1.0, "v_prediction")
    with pytest.raises(ValueError, match="eta"):
        ddim_step_with_logprob(eps, 300, 250, x, alphas, 1.5)
    with pytest.raises(ValueError, match="prev_timestep < timestep"):
        ddim_step_with_logprob(eps, 300, 300, x, alphas, 0.5)
    with pytest.raises(ValueError, match="timestep < 1000"):
        ddim_step_with_logprob(eps, 1000, 900, x, alphas, 0.5)
    with pytest.raises(TypeError, match="timestep"):
        ddim_step_with_logprob(eps, torch.tensor([3.0, 2.0]), 1, x, alphas, 0.5)


# ---------------------------------------------------------------- KL


def test_gaussian_kl_matches_torch_distributions():
    a, b = _video_pair(16)
    std = torch.tensor([0.3, 0.05]).reshape(2, 1, 1, 1, 1)
    ours = gaussian_kl_between_means(a, b, std)
    ref = kl_divergence(
        Normal(a.double(), std.double().expand_as(a)), Normal(b.double(), std.double().expand_as(b))
    )
    torch.testing.assert_close(ours.double(), ref.flatten(1).mean(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gaussian_kl_between_means(a, b, 0.3)[0], ours[0])


def test_gaussian_kl_relation_to_flow_grpo_term():
    x, v = _video_pair(17)
    v_ref = v + 0.1 * torch.randn(VIDEO_SHAPE, generator=torch.Generator().manual_seed(1))
    sigma, sigma_next = 0.7, 0.6
    pol = flow_sde_step(v, sigma, sigma_next, x, 0.7, generator=torch.Generator().manual_seed(2))
    ref = flow_sde_step(v_ref, sigma, sigma_next, x, 0.7, prev_sample=pol.prev_sample)
    ours = gaussian_kl_between_means(pol.mean, ref.mean, pol.std)
    sigma_t = 0.7 * math.sqrt(sigma / (1 - sigma))
    flow_grpo = ((pol.mean - ref.mean) ** 2).flatten(1).mean(1) / (2 * sigma_t**2)
    # Flow-GRPO omits |dt| from the variance, so its term is the exact KL times |dt| (far smaller).
    torch.testing.assert_close(ours * (sigma - sigma_next), flow_grpo, rtol=1e-4, atol=1e-10)


def test_gaussian_kl_rejects_bad_input():
    a, b = _video_pair(18)
    with pytest.raises(ValueError, match="std must be > 0"):
        gaussian_kl_between_means(a, b, torch.zeros(2, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="mean_b shape"):
        gaussian_kl_between_means(a, b[:1], 0.1)
    with pytest.raises(ValueError, match="broadcast"):
        gaussian_kl_between_means(a, b, torch.ones(2, 2, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="broadcast"):
        gaussian_kl_between_means(a, b, torch.ones(3))
