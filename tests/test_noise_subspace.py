"""sample.noise_frequencies: stochastic steps with noise in the lowest cosine components along the frames."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from config import grpo  # noqa: E402
from config.validate import validate  # noqa: E402
from recam.domains.motion.domain import cosine_alphas_cumprod  # noqa: E402
from recam.engine.extensions.noise_subspace import SubspaceNoise, cosine_basis, frame_lengths  # noqa: E402
from recam.engine.scheduler import DDIMScheduler  # noqa: E402


def _scheduler(num_train_steps: int = 3) -> DDIMScheduler:
    return DDIMScheduler(cosine_alphas_cumprod(100), 10, 1.0, "sample", num_train_steps)


def test_the_basis_is_scipy_s_orthonormal_dct_over_each_sample_s_real_frames():
    fft = pytest.importorskip("scipy.fft")
    import numpy as np

    basis = cosine_basis(torch.tensor([12, 7]), 12, 5)
    for i, length in enumerate((12, 7)):
        # column n of dct(I, norm="ortho") holds basis vector n's ... row k of the DCT-II matrix is component k
        dct = fft.dct(np.eye(length), norm="ortho", axis=0)[:5]
        torch.testing.assert_close(basis[i, :, :length], torch.tensor(dct, dtype=torch.float32), atol=1e-6, rtol=0)
        assert bool((basis[i, :, length:] == 0).all())
    with pytest.raises(ValueError, match="fewer than the 5 noise components"):
        cosine_basis(torch.tensor([4]), 12, 5)


def test_frame_lengths_read_a_prefix_mask_and_reject_others():
    x = torch.zeros(2, 3, 1, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)[:, None, None, :]
    assert frame_lengths(mask, x).tolist() == [6, 3]
    assert frame_lengths(None, x).tolist() == [6, 6]
    with pytest.raises(ValueError, match="real frames to come first"):
        frame_lengths(torch.tensor([[0, 1, 1, 1, 1, 1]] * 2, dtype=torch.bool)[:, None, None, :], x)
    with pytest.raises(ValueError, match="over the frames only"):
        frame_lengths(torch.ones(2, 3, 1, 6, dtype=torch.bool), x)


def test_a_step_draws_in_the_subspace_and_scores_with_torch_distributions():
    torch.manual_seed(0)
    sched = SubspaceNoise(_scheduler(), 4)
    x, out, noise = torch.randn(2, 3, 1, 12), torch.randn(2, 3, 1, 12), torch.randn(2, 3, 1, 12)
    mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    mask[1, ..., 9:] = False
    step = sched.transition(0, out, x, noise=noise, mask=mask)
    inner = _scheduler().transition(0, out, x, next_state=x, mask=mask)
    torch.testing.assert_close(step.mean, inner.mean)
    std = float(inner.std.flatten()[0])
    for i, length in enumerate((12, 9)):
        # the basis again, from the DCT-II formula element by element
        rows = torch.tensor([[math.sqrt((1 if k == 0 else 2) / length) * math.cos(math.pi * (n + 0.5) * k / length)
                              for n in range(length)] for k in range(4)])
        residual = (step.prev_sample[i] - step.mean[i]).reshape(3, 12)
        assert bool((residual[:, length:] == 0).all())  # no noise in padding
        # the residual is the noise's projection, scaled by std
        proj = noise[i].reshape(3, 12)[:, :length] @ rows.T
        torch.testing.assert_close(residual[:, :length], std * proj @ rows, atol=1e-5, rtol=1e-5)
        coords = step.prev_sample[i].reshape(3, 12)[:, :length] @ rows.T
        centre = step.mean[i].reshape(3, 12)[:, :length] @ rows.T
        expected = torch.distributions.Normal(centre, std).log_prob(coords).mean()
        torch.testing.assert_close(step.log_prob[i], expected, atol=1e-5, rtol=1e-5)
    # re-scoring the stored draw reproduces its log-prob bit for bit (an on-policy ratio of exactly 1)
    again = sched.transition(0, out, x, next_state=step.prev_sample, mask=mask)
    assert torch.equal(again.log_prob, step.log_prob)


def test_all_components_are_the_neutral_case_noise_in_every_element():
    torch.manual_seed(1)
    x, out, noise = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8)
    plain = _scheduler().transition(1, out, x, noise=noise)
    full = SubspaceNoise(_scheduler(), 8).transition(1, out, x, noise=noise)
    torch.testing.assert_close(full.prev_sample, plain.prev_sample, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.log_prob, plain.log_prob, atol=1e-5, rtol=1e-5)
    wrapped = SubspaceNoise(_scheduler(), 2)
    assert wrapped.with_train_steps(1).num_train_steps == 1 and wrapped.with_train_steps(1).num_components == 2
    assert wrapped.with_steps(5).num_steps == 5 and wrapped.step_std(0) == _scheduler().step_std(0)


def test_channel_directions_confine_the_noise_and_score_with_torch_distributions():
    torch.manual_seed(2)
    channels, _ = torch.linalg.qr(torch.randn(3, 2))  # (C 3, c 2) orthonormal columns
    sched = SubspaceNoise(_scheduler(), 3, channels)
    x, out, noise = torch.randn(2, 3, 1, 10), torch.randn(2, 3, 1, 10), torch.randn(2, 3, 1, 10)
    step = sched.transition(0, out, x, noise=noise)
    std = float(step.std.flatten()[0])
    rows = cosine_basis(torch.tensor([10]), 10, 3)[0]  # (m, F)
    for i in range(2):
        residual = (step.prev_sample[i] - step.mean[i]).reshape(3, 10)
        # the projection P P^T noise B B^T, scaled by std
        expected = std * channels @ channels.T @ noise[i].reshape(3, 10) @ rows.T @ rows
        torch.testing.assert_close(residual, expected, atol=1e-5, rtol=1e-5)
        coords = channels.T @ step.prev_sample[i].reshape(3, 10) @ rows.T
        centre = channels.T @ step.mean[i].reshape(3, 10) @ rows.T
        torch.testing.assert_close(step.log_prob[i], torch.distributions.Normal(centre, std).log_prob(coords).mean(),
                                   atol=1e-5, rtol=1e-5)
    # every channel direction and every frame: the neutral case again
    x4, o4, n4 = torch.randn(2, 4, 1, 6), torch.randn(2, 4, 1, 6), torch.randn(2, 4, 1, 6)
    rotation, _ = torch.linalg.qr(torch.randn(4, 4))
    full = SubspaceNoise(_scheduler(), 6, rotation).transition(1, o4, x4, noise=n4)
    plain = _scheduler().transition(1, o4, x4, noise=n4)
    torch.testing.assert_close(full.prev_sample, plain.prev_sample, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full.log_prob, plain.log_prob, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="orthonormal columns"):
        SubspaceNoise(_scheduler(), 3, torch.ones(3, 2))


def test_validation_names_the_field_for_objectives_and_variants_it_does_not_fit():
    c = grpo.get_config("toy")
    c.sample.noise_frequencies = 1
    validate(c, 1)
    c.train.objective = "nft"
    with pytest.raises(ValueError, match="sample.noise_frequencies=1 .* train.objective='nft'"):
        validate(c, 1)
    c = grpo.get_config("toy")
    c.sample.noise_frequencies, c.train.use_gradient_adaptive_weighting = 1, True
    c.train.policy_loss = "grpo_variants"  # the loss that has the switch, else validation refuses the switch itself
    with pytest.raises(ValueError, match="sample.noise_frequencies=1 .*use_gradient_adaptive_weighting"):
        validate(c, 1)
    c = grpo.get_config("toy")
    c.sample.noise_channels = 2
    with pytest.raises(ValueError, match="sample.noise_channels=2 .*sample.noise_frequencies > 0"):
        validate(c, 1)
    c = grpo.get_config("toy")
    c.sample.noise_frequencies = -1
    with pytest.raises(ValueError, match="sample.noise_frequencies"):
        validate(c, 1)
    for kl_type in ("k1", "k2", "k3"):  # sampled KL estimates assume noise in every element
        c = grpo.get_config("toy")
        c.sample.noise_frequencies, c.train.kl_type, c.train.beta = 1, kl_type, 0.01
        with pytest.raises(ValueError, match=f"train.kl_type='{kl_type}' .*use train.kl_type='gaussian_mean'"):
            validate(c, 1)
        c.train.beta = 0.0
        validate(c, 1)


def test_transition_kl_is_the_kl_of_the_subspace_gaussians():
    """Against torch.distributions on the coordinates z = B^T x / std (P^T too), with a frame mask, for both
    reductions; the gap outside the subspace adds nothing."""
    from torch.distributions import Normal, kl_divergence

    g = torch.Generator().manual_seed(5)
    channels = torch.linalg.qr(torch.randn(4, 2, generator=g))[0]
    a, b = torch.randn(3, 4, 1, 9, generator=g), torch.randn(3, 4, 1, 9, generator=g)
    std = torch.tensor([0.2, 0.5, 1.0]).reshape(3, 1, 1, 1)
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., 6:] = False
    lengths = torch.tensor([9, 6, 9])
    basis = cosine_basis(lengths, 9, 3)
    for reduction in ("mean", "sum"):
        inner = _scheduler()
        inner.reduction = reduction
        sched = SubspaceNoise(inner, 3, channels)
        za = torch.einsum("ncf,nmf,cp->npm", a.reshape(3, 4, 9), basis, channels) / std.reshape(3, 1, 1)
        zb = torch.einsum("ncf,nmf,cp->npm", b.reshape(3, 4, 9), basis, channels) / std.reshape(3, 1, 1)
        kl = kl_divergence(Normal(za, 1.0), Normal(zb, 1.0))
        expected = kl.mean((1, 2)) if reduction == "mean" else kl.sum((1, 2))
        torch.testing.assert_close(sched.transition_kl(a, b, std, mask), expected, atol=1e-5, rtol=1e-5)
    outside = a + (torch.arange(9) >= 6).float() * 5.0  # sample 1's padding frames only
    sched = SubspaceNoise(_scheduler(), 3, channels)
    torch.testing.assert_close(sched.transition_kl(outside, b, std, mask)[1], sched.transition_kl(a, b, std, mask)[1])


def test_a_toy_run_trains_with_one_component(tmp_path):
    """The trainer wraps its scheduler, and a run's first step is on-policy (ratio 1) with a finite loss."""
    from accelerate import Accelerator

    from recam.domains.toy.domain import ToyDomain
    from recam.engine.trainer import GRPOTrainer
    from tests.toy_trainer import toy_trainer

    trainer = toy_trainer(tmp_path, "toy", {"toy.pretrain_steps": 50, "num_epochs": 1, "eval.freq": 100,
                                            "sample.noise_frequencies": 1})
    c, log = trainer.config, trainer.log
    assert isinstance(trainer.scheduler, SubspaceNoise)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    first = trainer.history[0]
    assert first["mean_ratio"] == pytest.approx(1.0, abs=1e-6) and math.isfinite(first["loss"])
    c.sample.noise_channels = 1  # the toy domain gives no principal directions
    with pytest.raises(ValueError, match="sample.noise_channels=1 needs the principal directions"):
        GRPOTrainer(c, ToyDomain(c, "cpu", log), Accelerator(cpu=True), log, validate(c, 1))
