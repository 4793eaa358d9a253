"""The stochastic window (Flow-GRPO-Fast, MixGRPO), the second-order ODE solver (MixGRPO-Flash), and the schedulers'
forward process (for objectives that re-noise final samples): each against a loop or a formula written by hand."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from torch.distributions import Normal

from config import grpo
from config.validate import ConfigError, validate
from recam.engine.plan import window_start
from recam.engine.rollout import deterministic_sample, per_sample_noise, rescore, rollout
from recam.engine.scheduler import DDIMScheduler, FlowMatchScheduler
from recam.engine.sde import flow_dpm2_step

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (3, 4)


def _denoiser(seed=0):
    """A fixed nonlinear map of state and time standing in for a model."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(*SHAPE[1:], *SHAPE[1:], generator=g) * 0.3, torch.randn(SHAPE[1:], generator=g)

    def denoise(x, t):
        return torch.tanh(x @ a.T) + t.float()[:, None] / 100.0 * b
    return denoise


def _flow(T=0):
    return FlowMatchScheduler(num_steps=8, shift=3.0, noise_level=0.7, sde_type="sde", num_train_steps=T)


def _ddim(T=0, prediction_type="epsilon"):
    alphas = DDPMScheduler(num_train_timesteps=100, beta_schedule="squaredcos_cap_v2").alphas_cumprod
    return DDIMScheduler(alphas, num_steps=8, eta=1.0, prediction_type=prediction_type, num_train_steps=T)


SCHEDULERS = {"flow": _flow, "ddim": _ddim}


def _noise(n=5, steps=8, seed=0):
    return per_sample_noise([(seed, 0, i) for i in range(n)], steps + 1, SHAPE[1:])


def _rollout_before_windows(denoise, noise, scheduler):
    """The rollout as it was before windows existed: the first T steps stochastic, the rest deterministic."""
    x = noise[:, 0]
    states, log_probs = [x], []
    for j in range(scheduler.num_steps):
        out = denoise(x, scheduler.model_time(j, x.shape[0]))
        if j < scheduler.num_train_steps:
            step = scheduler.transition(j, out, x, noise=noise[:, j + 1])
            x = step.prev_sample
            states.append(x)
            log_probs.append(step.log_prob)
        else:
            x = scheduler.deterministic(j, out, x)
    return x, torch.stack(states, 1), torch.stack(log_probs, 1)


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_window_zero_reproduces_the_classic_rollout_bit_for_bit(kind):
    scheduler, denoise, noise = SCHEDULERS[kind](3), _denoiser(), _noise()
    final, states, log_probs = _rollout_before_windows(denoise, noise, scheduler)
    out = rollout(denoise, noise, scheduler)  # start 0: the classic setting
    assert out.start == 0 and out.means is None
    assert torch.equal(out.final, final) and torch.equal(out.states, states) and torch.equal(out.log_probs, log_probs)


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_window_is_stochastic_inside_and_deterministic_outside(kind):
    T, start = 2, 3
    scheduler, denoise, noise = SCHEDULERS[kind](T), _denoiser(), _noise()
    out = rollout(denoise, noise, scheduler, start=start, store_means=True)
    assert out.states.shape == (5, T + 1, *SHAPE[1:]) and out.log_probs.shape == (5, T) and out.start == start
    assert out.means.shape == (5, T, *SHAPE[1:])
    # loop by hand: deterministic steps, then the window's transitions drawn with the stored noise, then ODE/DDIM
    x, states, log_probs, means = noise[:, 0], [], [], []
    for j in range(scheduler.num_steps):
        o = denoise(x, scheduler.model_time(j, 5))
        if start <= j < start + T:
            states.append(x)
            step = scheduler.transition(j, o, x, noise=noise[:, j + 1])
            x = step.prev_sample
            log_probs.append(step.log_prob)
            means.append(step.mean)
            # the log-prob is the Gaussian density of the draw, per element, averaged
            expected = Normal(step.mean.double(), step.std.double().expand_as(step.mean)).log_prob(x.double())
            torch.testing.assert_close(step.log_prob.double(), expected.mean(1), rtol=1e-5, atol=1e-5)
        else:
            x = scheduler.deterministic(j, o, x)
        if j == start + T - 1:
            states.append(x)
    assert torch.equal(out.final, x)
    assert torch.equal(out.states, torch.stack(states, 1)) and torch.equal(out.log_probs, torch.stack(log_probs, 1))
    assert torch.equal(out.means, torch.stack(means, 1))
    # the same policy rescores its stored transitions exactly: ratio 1; another policy does not
    for j in range(T):
        again = rescore(denoise, out.states, scheduler, j, start=start)
        assert torch.equal(again.log_prob, out.log_probs[:, j])
        assert torch.equal(torch.exp(again.log_prob - out.log_probs[:, j]), torch.ones(5))
    assert not torch.equal(rescore(denoise, out.states, scheduler, 0).log_prob, out.log_probs[:, 0])  # wrong step
    assert not torch.equal(rescore(_denoiser(1), out.states, scheduler, 0, start=start).log_prob, out.log_probs[:, 0])
    # noise outside the window is never read; noise inside it is
    outside = noise.clone()
    for j in [*range(start), *range(start + T, scheduler.num_steps)]:
        outside[:, j + 1] = torch.randn(outside[:, j + 1].shape, generator=torch.Generator().manual_seed(j))
    again = rollout(denoise, outside, scheduler, start=start)
    assert torch.equal(again.final, out.final) and torch.equal(again.states, out.states)
    inside = noise.clone()
    inside[:, start + 1] += 1.0
    assert not torch.equal(rollout(denoise, inside, scheduler, start=start).final, out.final)


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_no_trained_step_samples_the_whole_trajectory_deterministically(kind):
    scheduler, denoise, noise = SCHEDULERS[kind](0), _denoiser(), _noise()
    out = rollout(denoise, noise, scheduler, start=3, store_means=True)
    assert out.states.shape == (5, 0, *SHAPE[1:]) and out.log_probs.shape == (5, 0)
    assert out.means.shape == (5, 0, *SHAPE[1:])
    torch.testing.assert_close(out.final, deterministic_sample(denoise, noise[:, 0], scheduler), rtol=0, atol=0)


def test_a_window_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        rollout(_denoiser(), _noise(), _flow(3), start=6)


def test_window_start_modes():
    assert [window_start("fixed", e, 0, 2, 5, 1) for e in range(4)] == [2, 2, 2, 2]
    # progressive: one step later every 3 epochs from 1 to 4, then back to 1 (MixGRPO's roll_back)
    assert [window_start("progressive", e, 0, 1, 4, 3) for e in range(14)] == \
        [1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 4, 1, 1]
    # the reference's loop (MixGRPO grpo_states.py): advance by 1 each group of iterations; past the last, back
    cur, expected = 0, []
    for e in range(40):
        expected.append(cur)
        if (e + 1) % 2 == 0:
            cur = cur + 1 if cur + 1 <= 5 else 0
    assert [window_start("progressive", e, 0, 0, 5, 2) for e in range(40)] == expected
    # random: a function of (seed, epoch) alone, within [0, max_start], and it moves
    draws = [window_start("random", e, 7, 0, 5, 1) for e in range(200)]
    assert draws == [window_start("random", e, 7, 3, 5, 9) for e in range(200)]
    assert set(draws) == set(range(6))
    assert draws != [window_start("random", e, 8, 0, 5, 1) for e in range(200)]
    assert [window_start("random", e, 7, 0, 0, 1) for e in range(5)] == [0] * 5
    with pytest.raises(ValueError, match="window mode"):
        window_start("sliding", 0, 0, 0, 1, 1)


# ---------------------------------------------------------------- DPM-Solver++(2M) on the flow ODE

def _dpm2_by_hand(velocity_fn, x, sigmas):
    """DPM-Solver++(2M) (Lu et al. 2022, data prediction) with alpha = 1 - sigma, written from the paper in float64:
    first order on the first step and on the final step to sigma = 0."""
    lam = [(-math.inf if s == 1 else (math.inf if s == 0 else math.log((1 - s) / s))) for s in sigmas]
    x0_prev = None
    x = x.double()
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i], sigmas[i + 1]
        x0 = x - s * velocity_fn(x.float(), torch.full((x.shape[0],), s)).double()
        if s_next == 0:
            x = x0
            break
        h = lam[i + 1] - lam[i]
        d = x0
        if x0_prev is not None and math.isfinite(lam[i - 1]):
            r = (lam[i] - lam[i - 1]) / h
            d = (1 + 1 / (2 * r)) * x0 - 1 / (2 * r) * x0_prev
        x = (s_next / s) * x - (1 - s_next) * (math.exp(-h) - 1) * d
        x0_prev = x0
    return x


def _gaussian_flow(mu, s0):
    """The exact marginal velocity of flow matching from x0 ~ N(mu, s0^2 I): v(x, t) = E[noise - x0 | x_t = x]."""
    def velocity(x, t):
        t = t.double()[:, None]
        var = (1 - t) ** 2 * s0**2 + t**2
        centred = x.double() - (1 - t) * mu
        return (t / var * centred - (mu + (1 - t) * s0**2 / var * centred)).float()
    return velocity


def test_dpm2_matches_the_paper_by_hand_and_beats_euler_on_an_analytic_flow():
    mu, s0 = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64), 1.0
    velocity = _gaussian_flow(mu, s0)
    noise = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    exact = mu + s0 * noise.double()  # the probability-flow ODE maps noise z to mu + s0 z
    errors = {}
    for steps in (4, 6, 10):
        scheduler = FlowMatchScheduler(steps, 1.0, 0.7)
        dpm2 = deterministic_sample(velocity, noise, scheduler, ode_solver="dpm2")
        by_hand = _dpm2_by_hand(velocity, noise, scheduler.sigmas.tolist())
        torch.testing.assert_close(dpm2.double(), by_hand, rtol=1e-5, atol=1e-5)
        euler = deterministic_sample(velocity, noise, scheduler)
        errors[steps] = (float((euler.double() - exact).abs().mean()), float((dpm2.double() - exact).abs().mean()))
        assert errors[steps][1] < 0.7 * errors[steps][0], errors
    # and it converges faster: the error shrinks more from 4 to 10 steps (measured: Euler 0.21 -> 0.09, 2M 0.14 ->
    # 0.0005; the final step to sigma 0 is first order in both, which bounds 2M's order on finer grids)
    assert errors[10][1] / errors[4][1] < 0.1 * errors[10][0] / errors[4][0], errors


def test_dpm2_keeps_its_history_through_the_window():
    """MixGRPO's sampling_utils.py updates the DPM state with each stochastic step's x0 prediction, so the first
    step after the window is second order from the last stochastic step's x0 (at that step's sigma)."""
    scheduler, denoise, noise = _flow(2), _denoiser(), _noise()
    out = rollout(denoise, noise, scheduler, start=2, ode_solver="dpm2")
    x, previous = noise[:, 0], None
    for j in range(scheduler.num_steps):
        o = denoise(x, scheduler.model_time(j, 5))
        s, s_next = float(scheduler.sigmas[j]), float(scheduler.sigmas[j + 1])
        if 2 <= j < 4:
            x, previous = scheduler.transition(j, o, x, noise=noise[:, j + 1]).prev_sample, (x.float() - s * o, s)
        else:
            x, x0 = flow_dpm2_step(o, s, s_next, x, previous)
            previous = (x0, s)
    assert torch.equal(out.final, x)
    with pytest.raises(ValueError, match="flow"):
        rollout(denoise, noise, _ddim(2), ode_solver="dpm2")


def test_compressed_grid_is_mixgrpo_flash_s_post_grid_written_out():
    """sampling_utils.py of MixGRPO: num_post_steps = int(max((len(sigmas) - 1 - last_window_index) * ratio, 1))
    points from the unshifted time after the window to 0, time-shifted; the grid before them kept."""
    shift, S, ratio = 3.0, 25, 0.4
    scheduler = FlowMatchScheduler(S, shift, 0.7)
    for window_end in (4, 10, 20):
        last_window_index = window_end - 1
        points = int(max((S + 1 - 1 - last_window_index) * ratio, 1))
        t = np.linspace(1.0 - window_end / S, 0.0, max(points, 2))
        post = shift * t / (1 + (shift - 1) * t)
        got = scheduler.compressed_after(window_end, ratio)
        assert got.num_steps == window_end + max(points, 2) - 1
        torch.testing.assert_close(got.sigmas[:window_end], scheduler.sigmas[:window_end])
        np.testing.assert_allclose(got.sigmas[window_end:].numpy(), post, rtol=1e-6, atol=1e-7)
        assert float(got.sigmas[window_end]) == float(scheduler.sigmas[window_end])  # continuous at the seam
    assert scheduler.compressed_after(4, 0.4).num_steps == 4 + 8 - 1  # 8 points after a window ending at 4
    with pytest.raises(ValueError, match="ratio"):
        scheduler.compressed_after(4, 0.0)


def test_post_window_compress_samples_fewer_steps_and_stays_exact_on_a_linear_flow():
    """Steps after the window run 2M on the compressed grid, Euler before it; on a flow whose velocity is exact
    for a single data point (v = noise - x0 along the straight path) any grid lands on x0."""
    scheduler = _flow(2)
    calls = []
    x0 = torch.tensor([1.0, -2.0, 0.5, 0.25])

    def straight(x, t):  # x = (1 - t) x0 + t z  =>  z = (x - (1 - t) x0) / t, v = z - x0
        calls.append(float(t[0]))
        tt = t.float()[:, None]
        return (x - (1 - tt) * x0) / tt - x0
    noise = _noise()
    plain = rollout(straight, noise, scheduler, start=1)
    n_plain, calls[:] = len(calls), []
    out = rollout(straight, noise, scheduler, start=1, ode_solver="dpm2", solver_scope="after_window",
                  post_window_compress=0.4)
    assert n_plain == 8 and len(calls) == 1 + 2 + 1  # Euler, the window, then int(6 * 0.4) = 2 points: one step
    torch.testing.assert_close(out.final, x0.expand(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.log_probs, plain.log_probs)  # the window itself is unchanged
    with pytest.raises(ValueError, match="solver_scope"):
        rollout(straight, noise, scheduler, start=1, solver_scope="before")


def test_first_order_dpm2_is_the_euler_step():
    x, v = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)), torch.randn(4, 3)
    for s, s_next in ((1.0, 0.7), (0.7, 0.2), (0.2, 0.0)):
        got, x0 = flow_dpm2_step(v, s, s_next, x)
        torch.testing.assert_close(got, x + (s_next - s) * v)
        torch.testing.assert_close(x0, x - s * v)


# ---------------------------------------------------------------- forward process (re-noising final samples)

def test_flow_forward_process_by_hand_and_round_trip():
    scheduler = _flow()
    g = torch.Generator().manual_seed(2)
    x0, noise, u = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.tensor([0.1, 0.5, 0.9])
    x_t, t = scheduler.noise_to(x0, noise, u)
    torch.testing.assert_close(x_t, (1 - u[:, None]) * x0 + u[:, None] * noise)
    torch.testing.assert_close(t, u)  # the flow model is called with sigma itself (model_time's scale)
    target = scheduler.output_target(x0, noise, u)
    torch.testing.assert_close(target, noise - x0)
    torch.testing.assert_close(scheduler.x0_from_output(target, x_t, u), x0)
    torch.testing.assert_close(scheduler.x0_from_output(target, x_t, u), x_t - u[:, None] * target)
    assert scheduler.step_dt(0) == pytest.approx(float(scheduler.sigmas[0] - scheduler.sigmas[1]))
    assert all(scheduler.step_dt(j) > 0 for j in range(scheduler.num_steps))
    assert sum(scheduler.step_dt(j) for j in range(scheduler.num_steps)) == pytest.approx(1.0)
    assert FlowMatchScheduler.is_flow and not DDIMScheduler.is_flow


@pytest.mark.parametrize("prediction_type", ["epsilon", "sample"])
def test_ddim_forward_process_by_hand_and_round_trip(prediction_type):
    scheduler = _ddim(prediction_type=prediction_type)
    g = torch.Generator().manual_seed(3)
    x0, noise, u = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.tensor([0.1, 0.5, 0.9])
    x_t, t = scheduler.noise_to(x0, noise, u)
    index = [round(float(v) * 99) for v in u]  # 100 training timesteps
    assert t.tolist() == index
    abar = scheduler.alphas_cumprod[index].float()[:, None]
    torch.testing.assert_close(x_t, abar.sqrt() * x0 + (1 - abar).sqrt() * noise)
    target = scheduler.output_target(x0, noise, u)
    torch.testing.assert_close(target, x0 if prediction_type == "sample" else noise)
    torch.testing.assert_close(scheduler.x0_from_output(target, x_t, u), x0, rtol=1e-4, atol=1e-4)


def test_with_train_steps_shares_the_grid_and_checks_its_range():
    flow = _flow(3)
    four = flow.with_train_steps(4)
    assert four.num_train_steps == 4 and flow.num_train_steps == 3 and four.sigmas is flow.sigmas
    with pytest.raises(ValueError, match="num_train_steps"):
        flow.with_train_steps(9)


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("mutate,field", [
    (lambda c: setattr(c.sample, "window_size", -1), "sample.window_size"),
    (lambda c: (setattr(c.sample, "window_size", 3), setattr(c.sample, "window_start", 7)), "sample.window_start"),
    (lambda c: (setattr(c.sample, "window_size", 2), setattr(c.sample, "window_mode", "random"),
                setattr(c.sample, "window_max_start", 8)), "sample.window_max_start"),
    (lambda c: (setattr(c.sample, "window_size", 2), setattr(c.sample, "window_mode", "progressive"),
                setattr(c.sample, "window_start", 4), setattr(c.sample, "window_max_start", 3)), "sample.window_start"),
    (lambda c: (setattr(c.sample, "window_size", 10), setattr(c.sample, "window_mode", "progressive"),
                setattr(c.sample, "window_max_start", -1)), "sample.window_size"),  # -1: no start fits
    (lambda c: (setattr(c.sample, "window_size", 2), setattr(c.sample, "window_mode", "random"),
                setattr(c.sample, "window_max_start", -2)), "sample.window_max_start"),
    (lambda c: setattr(c.sample, "window_mode", "sliding"), "sample.window_mode"),
    (lambda c: setattr(c.sample, "window_shift_every", 0), "sample.window_shift_every"),
    (lambda c: setattr(c.sample, "ode_solver", "dpm2"), "sample.ode_solver"),  # the toy domain is DDIM
    (lambda c: setattr(c.sample, "ode_solver", "heun"), "sample.ode_solver"),
    (lambda c: setattr(c.train, "objective", "ppo"), "train.objective"),
    (lambda c: setattr(c.train, "objective", "grpo_guard"), "train.objective"),  # flow SDE only; the toy is DDIM
    (lambda c: setattr(c.train, "old_policy_decay", 1.0), "train.old_policy_decay"),
    (lambda c: setattr(c.train, "fp_num_timesteps", 0), "train.fp_num_timesteps"),
    (lambda c: setattr(c.train, "fp_timestep_sampling", "sobol"), "train.fp_timestep_sampling"),
    (lambda c: setattr(c.train, "fp_min_noise", 0.0), "train.fp_min_noise"),
    (lambda c: (setattr(c.train, "fp_min_noise", 0.6), setattr(c.train, "fp_max_noise", 0.5)), "train.fp_min_noise"),
    (lambda c: setattr(c.train, "nft_beta", 0.0), "train.nft_beta"),
    (lambda c: setattr(c.train, "awm_adv_scale", -1.0), "train.awm_adv_scale"),
    (lambda c: setattr(c.train, "awm_clip_range", 0.0), "train.awm_clip_range"),
    (lambda c: setattr(c.train, "awm_old_kl_weight", -0.1), "train.awm_old_kl_weight"),
    (lambda c: setattr(c.eval, "every_seconds", -1.0), "eval.every_seconds"),
    (lambda c: setattr(c, "max_train_seconds", -5.0), "max_train_seconds"),
])
def test_broken_window_and_objective_fields_are_named(mutate, field):
    c = grpo.get_config("toy")
    mutate(c)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        validate(c, 1)
    assert "\n" not in str(e.value)


def test_window_sizes_the_advantages_and_a_flow_domain_accepts_dpm2():
    c = grpo.get_config("toy")
    c.sample.window_size, c.sample.window_mode, c.sample.window_max_start = 2, "random", 7  # 7 + 2 = 10 - 1
    assert validate(c, 1).num_train_timesteps == 2
    camera = grpo.get_config("smoke")
    camera.sample.ode_solver = "dpm2"
    validate(camera, 1)


# ---------------------------------------------------------------- a toy run with a random window

def test_toy_run_with_a_random_window_trains_on_policy(tmp_path):
    epochs, per_epoch = 3, 4
    cmd = [sys.executable, str(ROOT / "scripts" / "train_recam.py"), "--config", "config/grpo.py:toy",
           f"--config.run_dir={tmp_path}", f"--config.num_epochs={epochs}", "--config.eval.freq=100",
           "--config.sample.window_size=2", "--config.sample.window_mode=random", "--config.sample.window_max_start=6",
           "--config.logging.wandb_mode=disabled"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    c = grpo.get_config("toy")
    epochs_logged = [r for r in records if r["type"] == "epoch"]
    assert [e["epoch"] for e in epochs_logged] == list(range(epochs))
    for e in epochs_logged:
        assert e["window_start"] == window_start("random", e["epoch"], c.seed, 0, 6, 1)
        assert np.array(e["advantages"]).shape == (c.sample.batch_size * per_epoch, 2) and e["num_train_timesteps"] == 2
        assert e["first_step_ratio_deviation"] == 0.0  # on-policy first step: ratio exactly 1
        steps = e["optimizer_steps"]
        assert steps and all(math.isfinite(s["loss"]) for s in steps)
    # the weights moved: the held-out evaluation changed
    evals = {r["tag"]: r for r in records if r["type"] == "eval"}
    assert evals["final"]["eval/target"] != evals["start"]["eval/target"]
