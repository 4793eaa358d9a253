"""Element masks (padded motion frames): log-probs, KLs and the log-prob gradient average over the real elements only,
checked against torch.distributions, autograd and plain masked means; no mask stays bit-identical to before."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import Normal

from recam.engine.extensions.variants import log_prob_output_gradient
from recam.engine.losses import KL_ESTIMATORS
from recam.engine.rollout import rescore, rollout
from recam.engine.scheduler import DDIMScheduler, FlowMatchScheduler
from recam.engine.sde import ddim_step_with_logprob, reduce_elements

SHAPE = (3, 5, 1, 8)  # (B, features, 1, frames): motion's layout, small


def lengths_mask(lengths, frames=SHAPE[-1]) -> torch.Tensor:
    return (torch.arange(frames)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, frames)


def alphas(n=50):
    return torch.cumprod(1 - torch.linspace(1e-4, 0.05, n), 0)


def test_reduce_elements_is_the_mean_over_real_elements():
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    mask = lengths_mask([8, 3, 5])
    got = reduce_elements(x, mask)
    for b, n in enumerate([8, 3, 5]):
        assert got[b] == pytest.approx(float(x[b, :, :, :n].mean()), abs=1e-6)
    torch.testing.assert_close(reduce_elements(x, torch.ones(SHAPE, dtype=torch.bool)), x.mean(dim=(1, 2, 3)))
    assert torch.equal(reduce_elements(x), x.mean(dim=(1, 2, 3)))
    summed = reduce_elements(x, mask, "sum")
    assert summed[1] == pytest.approx(float(x[1, :, :, :3].sum()), abs=1e-5)
    with pytest.raises(ValueError, match="reduction"):
        reduce_elements(x, mask, "max")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ddim_log_prob_with_a_mask_matches_torch_distributions(reduction):
    g = torch.Generator().manual_seed(1)
    x, out, prev = (torch.randn(SHAPE, generator=g) for _ in range(3))
    mask = lengths_mask([8, 2, 6])
    step = ddim_step_with_logprob(out, 30, 20, x, alphas(), 1.0, "sample", prev_sample=prev, mask=mask,
                                  reduction=reduction)
    dens = Normal(step.mean.double(), step.std.double()).log_prob(prev.double())
    for b, n in enumerate([8, 2, 6]):
        real = dens[b, :, :, :n]
        expected = real.mean() if reduction == "mean" else real.sum()
        assert float(step.log_prob[b]) == pytest.approx(float(expected), rel=1e-5)
    # what a padded element holds does not matter
    prev2 = prev.clone()
    prev2[1, :, :, 2:] += 100.0
    again = ddim_step_with_logprob(out, 30, 20, x, alphas(), 1.0, "sample", prev_sample=prev2, mask=mask,
                                   reduction=reduction)
    assert float(again.log_prob[1]) == pytest.approx(float(step.log_prob[1]), rel=1e-6)


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_kl_estimators_average_over_real_elements(name):
    g = torch.Generator().manual_seed(2)
    cur, ref, sample = (torch.randn(SHAPE, generator=g) * 0.1 for _ in range(3))
    std = torch.full((SHAPE[0], 1, 1, 1), 0.3)
    mask = lengths_mask([8, 4, 1])
    got = KL_ESTIMATORS[name](cur, ref, std, sample, mask)
    full = KL_ESTIMATORS[name](cur, ref, std, sample)
    for b, n in enumerate([8, 4, 1]):
        # the estimator on the real frames alone, as its own smaller sample
        alone = KL_ESTIMATORS[name](cur[b:b + 1, :, :, :n], ref[b:b + 1, :, :, :n], std[b:b + 1],
                                    sample[b:b + 1, :, :, :n])
        assert float(got[b]) == pytest.approx(float(alone[0]), rel=1e-5)
    assert float(got[0]) == pytest.approx(float(full[0]), rel=1e-6)


def test_log_prob_output_gradient_with_a_mask_matches_autograd():
    g = torch.Generator().manual_seed(3)
    prev = torch.randn(SHAPE, generator=g)
    mean = torch.randn(SHAPE, generator=g).requires_grad_()
    std = torch.full((SHAPE[0], 1, 1, 1), 0.5)
    mask = lengths_mask([8, 3, 5])
    logp = reduce_elements(Normal(mean, std).log_prob(prev), mask)
    (grad,) = torch.autograd.grad(logp.sum(), mean)
    torch.testing.assert_close(log_prob_output_gradient(prev, mean.detach(), std, 1.0, mask), grad)


@pytest.mark.parametrize("make", [
    lambda: DDIMScheduler(alphas(), 6, 1.0, "sample", num_train_steps=4),
    lambda: FlowMatchScheduler(6, 1.0, 0.7, "sde", num_train_steps=4),
])
def test_masked_rollout_rescored_on_policy_gives_ratio_one(make):
    scheduler = make()
    weight = torch.randn(SHAPE[1:], generator=torch.Generator().manual_seed(4)) * 0.1

    def denoise(x, t):
        return x * 0.5 + weight

    noise = torch.randn((SHAPE[0], scheduler.num_steps + 1, *SHAPE[1:]), generator=torch.Generator().manual_seed(5))
    mask = lengths_mask([8, 3, 6])
    out = rollout(denoise, noise, scheduler, mask)
    for j in range(scheduler.num_train_steps):
        again = rescore(denoise, out.states, scheduler, j, mask)
        assert torch.equal(again.log_prob, out.log_probs[:, j])
    unmasked = rollout(denoise, noise, scheduler)
    assert torch.equal(unmasked.states, out.states)  # the mask changes what is averaged, never what is drawn
    assert not torch.equal(unmasked.log_probs[1], out.log_probs[1])


def test_summed_log_probs_scale_with_the_element_count():
    # The blown-up run's arithmetic: summed over 263 x 196 elements a log-ratio is that many times the mean's.
    g = torch.Generator().manual_seed(6)
    x, out, prev = (torch.randn(2, 263, 1, 196, generator=g) for _ in range(3))
    mean_lp = ddim_step_with_logprob(out, 30, 20, x, alphas(), 1.0, "sample", prev_sample=prev).log_prob
    sum_lp = ddim_step_with_logprob(out, 30, 20, x, alphas(), 1.0, "sample", prev_sample=prev, reduction="sum").log_prob
    torch.testing.assert_close(sum_lp, mean_lp * 263 * 196, rtol=1e-4, atol=1e-2)
