"""Parity with the public reference code: each method at its default config (`tiny_cpu+<method>`) against the
reference's loss written out here from its code, not from recam's functions, on one fixed small batch. The reference
side takes nothing from recam: its advantages are computed here as its stat tracker computes them, its grid is built
here as its sampler builds it, and its constants (clip range, KL weight, noise level, ...) are the literals of its
presets, named where they are used.

The references, read at the commits named (line numbers are those files'):
- Flow-GRPO: yifan123/flow_grpo ac4c86e, flow_grpo/diffusers_patch/sd3_sde_with_logprob.py L47-68 (the SDE step and
  its element-mean log-prob), scripts/train_sd3.py L881-899 (clipped loss, KL to the reference),
  flow_grpo/stat_tracking.py L11-31 (per-prompt mean, global std + 1e-4), config/grpo.py L52-54 (beta 0.04,
  global_std), config/base.py L84-86 (adv_clip_max 5, clip_range 1e-4).
- MixGRPO-Flash: Tencent-Hunyuan/MixGRPO e5cdd6a, fastvideo/utils/sampling_utils.py L29-52 (post-window grid), L105-
  134 (DPM state updated through the window), L256-271 (DPMState), L305-349 (order choice), L398-425 (first order),
  L449-512 (2M, midpoint); fastvideo/train_grpo_flux.py L187-189 (the grid: linspace(1, 0, S + 1), time-shifted),
  L458-477 (group mean, torch's Bessel-corrected std + 1e-8), L567-584 (clipped loss, 0.5 mean((delta log p)^2) "KL"
  times kl_coeff); scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh (sampling_steps 25, eta 0.7, shift 3,
  kl_coeff 0.0, clip_range 1e-4, adv_clip_max 5, dpm_post_compress_ratio 0.4, window group_size 4).
- DiffusionNFT: NVlabs/DiffusionNFT 24af555, scripts/train_nft_sd3.py L662 and L810-816 (each sample's grid levels
  permuted), L569 (int(num_steps x timestep_fraction) of them), L862-983 (the loss); flow_grpo/stat_tracking.py L23-31
  (global std); config/base.py L57, L84, L87, L89 and config/nft.py L60-67 (defaults).
- AWM: scxue/advantage_weighted_matching be51372, advantage_weighted_matching/scripts/train_sd3_awm.py L210-250
  (matching loss and ghuber weighting), L1197-1205 (discrete_wo_init levels), L1256-1352 (ratio, clip, both KLs),
  L1409-1419 (EMA decay); config/dgx_awm.py L31-86 (geneval_sd3_no_cfg_1node).
"""

import copy
import math

import numpy as np
import pytest
import torch

from config.grpo import tiny_cpu
from config.methods import apply_method
from recam.engine.extensions.fast_objectives import AWMObjective, NFTObjective
from recam.engine.objective import GRPOObjective, MicroBatch
from recam.engine.rollout import rollout
from recam.engine.scheduler import FlowMatchScheduler
from tests.test_fast_objectives import perturbed

SHAPE = (2, 3, 4)
B = 6


class Velocity(torch.nn.Module):
    """A small velocity field with one parameter per element and a non-linearity: distinct per-element gradients."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(-0.8 + 0.2 * torch.randn(SHAPE, generator=g))
        self.b = torch.nn.Parameter(0.3 * torch.randn(SHAPE, generator=g))
        self.c = torch.nn.Parameter(0.2 * torch.randn(SHAPE, generator=g))

    def forward(self, x, t):
        tt = t.float().reshape(-1, *([1] * len(SHAPE)))
        return self.a * x + self.b * torch.tanh(x) * tt + self.c


def method_config(name):
    return apply_method(tiny_cpu(), name)


def scheduler_of(c, num_train_steps=0):
    s = c.sample
    return FlowMatchScheduler(s.num_steps, s.shift, s.noise_level, s.sde_type, num_train_steps)


def grads_of(model):
    out = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return out


def run_objective(objective, mb, model):
    pieces = []

    def backward(loss, last):
        pieces.append(loss.detach())
        loss.backward()

    objective.accumulate(mb, backward)
    return torch.stack(pieces).sum(), grads_of(model)


def reference_grads(loss, model):
    loss.backward()
    return grads_of(model)


def rewards_and_groups():
    g = torch.Generator().manual_seed(7)
    groups = torch.arange(B) // 3  # two conditions, k = 3
    return torch.rand(B, generator=g, dtype=torch.float64), groups


def reference_global_std_advantages(rewards, groups):
    """flow_grpo/stat_tracking.py PerPromptStatTracker(global_std=True).update (Flow-GRPO's, DiffusionNFT's and
    AWM's copy): per-prompt mean, np.std of all the rewards (population) + 1e-4."""
    prompts, r = groups.numpy(), rewards.numpy().astype(np.float64)
    advantages = np.empty_like(r) * 0.0
    for prompt in np.unique(prompts):
        prompt_rewards = r[prompts == prompt]
        mean = np.mean(prompt_rewards, axis=0, keepdims=True)
        std = np.std(r, axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return torch.from_numpy(advantages).float()


def reference_mixgrpo_advantages(rewards, num_generations):
    """train_grpo_flux.py L458-477 (use_group, reward_aggr, trimmed_ratio 0): contiguous groups of num_generations,
    (r - mean) / (r.std() + 1e-8), torch's std with Bessel's correction."""
    samples_rewards = rewards.float()
    n = len(samples_rewards) // num_generations
    advantages = torch.zeros_like(samples_rewards)
    for i in range(n):
        start_idx, end_idx = i * num_generations, (i + 1) * num_generations
        group_rewards = samples_rewards[start_idx:end_idx]
        group_mean = group_rewards.mean()
        group_std = group_rewards.std() + 1e-8
        advantages[start_idx:end_idx] = (group_rewards - group_mean) / group_std
    return advantages


def recam_advantages(c, rewards, groups):
    """What the trainer computes from the epoch's rewards under config c (recam's side)."""
    from recam.engine.reward_runner import masked_group_advantages

    a = c.advantage
    return masked_group_advantages(rewards.float(), groups, torch.ones_like(groups, dtype=torch.bool), a.std_mode,
                                   a.eps, a.unbiased_std)[0]


def forward_mb(c, policy, old, reference, sampler, advantages):
    g = torch.Generator().manual_seed(3)
    final = torch.randn(B, *SHAPE, generator=g)
    traj = torch.stack([torch.arange(B), torch.arange(B) % 3], 1)
    return MicroBatch(states=final.new_empty(B, 0, *SHAPE), old_log_probs=torch.empty(B, 0),
                      advantages=advantages[:, None], sample_weight=torch.full((B,), 1.0 / B), traj_ids=traj,
                      policy=policy, reference=reference, inner_epoch=0, final=final, old_policy=old,
                      sampling_policy=sampler, epoch=2)


# ---------------------------------------------------------------- Flow-GRPO


def reference_flow_grpo_step(sigmas, j, x, v, noise_level):
    """sd3_sde_with_logprob.py L41-50: (mean, std_dev_t, dt) of the SDE step from sigmas[j]."""
    sigma, sigma_prev, sigma_max = sigmas[j], sigmas[j + 1], sigmas[1]
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t, dt


def reference_flow_grpo_log_prob(prev, mean, std_dev_t, dt):
    """sd3_sde_with_logprob.py L61-68: Gaussian log-density with std std_dev_t sqrt(-dt), mean over elements."""
    s = std_dev_t * torch.sqrt(-1 * dt)
    lp = -((prev.detach() - mean) ** 2) / (2 * s**2) - torch.log(s) \
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    return lp.mean(dim=tuple(range(1, lp.ndim)))


# The reference side's constants, the literals of the public presets (nothing read from recam's config):
# Flow-GRPO config/base.py L84-86 (adv_clip_max 5, clip_range 1e-4), L54 (noise_level 0.7), config/grpo.py L52-54
# (geneval_sd3 / general_ocr_sd3: beta 0.04, global_std True).
FLOW_GRPO = {"beta": 0.04, "clip_range": 1e-4, "adv_clip_max": 5.0, "noise_level": 0.7}
# MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh (and _MixGRPO.sh): kl_coeff 0.0, clip_range 1e-4,
# adv_clip_max 5.0, eta 0.7, sampling_steps 25, shift 3, group_size (the window) 4, dpm_post_compress_ratio 0.4.
MIXGRPO = {"kl_coeff": 0.0, "clip_range": 1e-4, "adv_clip_max": 5.0, "eta": 0.7, "sampling_steps": 25, "shift": 3.0,
           "window": 4, "compress": 0.4}


def stored_rollout(c, start, old):
    """recam's rollout of `c`'s window from `start` by `old`, with its scheduler (recam's side)."""
    sched = scheduler_of(c, c.sample.window_size)
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(B, c.sample.num_steps + 1, *SHAPE, generator=g)
    with torch.no_grad():
        out = rollout(old, noise, sched, start=start, ode_solver=c.sample.ode_solver,
                      solver_scope=c.sample.ode_solver_scope, post_window_compress=c.sample.post_window_compress)
    return sched, out


def recam_grpo_loss(c, sched, out, start, policy, reference, adv):
    """recam's GRPO objective on the stored rollout; the reference model is kept only with a KL weight, as
    recam.engine.policy.build_policy keeps it."""
    T = c.sample.window_size
    mb = MicroBatch(states=out.states, old_log_probs=out.log_probs, advantages=adv[:, None].expand(B, T),
                    sample_weight=torch.full((B,), 1.0 / B),
                    traj_ids=torch.stack([torch.arange(B) // 3, torch.arange(B) % 3], 1), policy=policy,
                    reference=reference if c.train.beta > 0 else None, inner_epoch=0, step_offset=start)
    return run_objective(GRPOObjective(c.train, sched), mb, policy)


def assert_same_loss_and_grads(loss, grads, total, policy):
    ref_grads = reference_grads(total, policy)
    torch.testing.assert_close(loss, total.detach(), rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)


def clipped_policy_loss(advantages, log_prob, old_log_prob, clip_range):
    """train_sd3.py L881-890 / train_grpo_flux.py L573-580: the PPO surrogate, element-wise before its mean."""
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped_loss, clipped_loss), ratio


def test_flow_grpo_parity_with_train_sd3_loss_and_gradient():
    """recam's GRPO objective at tiny_cpu+flow_grpo against train_sd3.py's loss with the presets' constants. Flow-GRPO's
    KL divides by std_dev_t^2 without |dt| (its issues #22, #78); recam's is the exact Gaussian KL, the reference's /
    |dt_j|, and +flow_grpo's beta is 0.04 / S: on tiny_cpu's uniform grid (|dt_j| = 1 / S, checked) the two terms are
    equal, so the reference side below is the reference's loss with no conversion."""
    c = method_config("flow_grpo")
    S, T, start = c.sample.num_steps, c.sample.window_size, 0
    assert T == S - 1  # every step but the last (timestep_fraction 0.99 of S, train_sd3.py)
    policy = Velocity(0)
    # an old policy close enough that some ratios fall inside the clip range of 1e-4 and some outside it
    old, reference = perturbed(policy, 2e-4, 1), perturbed(policy, 0.05, 2)
    sched, out = stored_rollout(c, start, old)
    rewards, groups = rewards_and_groups()
    loss, grads = recam_grpo_loss(c, sched, out, start, policy, reference, recam_advantages(c, rewards, groups))

    adv = reference_global_std_advantages(rewards, groups)
    # the grid the stored transitions were drawn on, tiny_cpu's shift 1: linspace(1, 0, S + 1) (the pipeline's own
    # grid is SD3's scheduler's, a departure in docs/methods.md); uniform, so the beta conversion is exact
    sigmas = torch.linspace(1, 0, S + 1)
    torch.testing.assert_close(sched.sigmas.float(), sigmas, rtol=0, atol=1e-6)
    k, total, inside = FLOW_GRPO, 0.0, []
    for j in range(T):
        x, prev = out.states[:, j], out.states[:, j + 1]
        mean, std_dev_t, dt = reference_flow_grpo_step(sigmas, start + j, x, policy(x, sigmas[start + j].expand(B)),
                                                       k["noise_level"])
        with torch.no_grad():
            mean_ref, _, _ = reference_flow_grpo_step(sigmas, start + j, x, reference(x, sigmas[start + j].expand(B)),
                                                      k["noise_level"])
        log_prob = reference_flow_grpo_log_prob(prev, mean, std_dev_t, dt)
        advantages = torch.clamp(adv, -k["adv_clip_max"], k["adv_clip_max"])
        per_sample, ratio = clipped_policy_loss(advantages, log_prob, out.log_probs[:, j], k["clip_range"])
        inside.append((ratio.detach() - 1).abs() <= k["clip_range"])
        policy_loss = torch.mean(per_sample)
        kl_loss = torch.mean(((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2))
        total = total + (policy_loss + k["beta"] * kl_loss) / T  # accelerate averages over the T steps
    inside = torch.stack(inside)
    assert 0 < int(inside.sum()) < inside.numel()  # the clip range is exercised both ways
    assert_same_loss_and_grads(loss, grads, total, policy)
    assert out.states.shape[1] == S  # S - 1 trained steps, + the last state


def test_flow_grpo_parity_defaults_in_recam_units():
    """The presets' global std, clip range and KL weight as +flow_grpo sets them on a flow domain (beta / S: recam's KL
    is the exact one, the reference's times 1 / |dt|); the DDIM domains keep the preset's clip and KL weight."""
    for method in ("flow_grpo", "flow_grpo_balanced"):
        c = method_config(method)
        assert (c.advantage.std_mode, c.advantage.unbiased_std, c.advantage.eps) == ("global", False, 1e-4)
        assert c.train.clip_range == FLOW_GRPO["clip_range"] and c.train.adv_clip_max == FLOW_GRPO["adv_clip_max"]
        assert c.train.beta == pytest.approx(FLOW_GRPO["beta"] / c.sample.num_steps)
        assert c.train.kl_type == "gaussian_mean" and c.sample.noise_level == FLOW_GRPO["noise_level"]


@pytest.mark.parametrize("method,start", [("mixgrpo", 2), ("mixgrpo_flash", 1)])
@pytest.mark.parametrize("kl_coeff", [MIXGRPO["kl_coeff"], 0.5])
def test_mixgrpo_parity_with_train_grpo_flux_loss_and_gradient(method, start, kl_coeff):
    """recam's GRPO objective at tiny_cpu+mixgrpo(_flash) against train_grpo_flux.py's loss: its advantages (group
    std with Bessel's correction + 1e-8), clip 1e-4 and "KL" 0.5 mean((log p - log p_old)^2) x kl_coeff, no
    reference model. The scripts' kl_coeff is 0; 0.5 checks the form (recam's train.sampling_kl_coeff)."""
    c = method_config(method)
    c.train.sampling_kl_coeff = kl_coeff
    T = c.sample.window_size
    assert T == MIXGRPO["window"]
    policy = Velocity(0)
    old, reference = perturbed(policy, 2e-4, 1), perturbed(policy, 0.05, 2)
    sched, out = stored_rollout(c, start, old)
    rewards, groups = rewards_and_groups()
    loss, grads = recam_grpo_loss(c, sched, out, start, policy, reference, recam_advantages(c, rewards, groups))

    k, S = MIXGRPO, c.sample.num_steps
    sigma_schedule = sd3_time_shift(c.sample.shift, torch.linspace(1, 0, S + 1))  # train_grpo_flux.py L187-189
    adv = reference_mixgrpo_advantages(rewards, num_generations=3)
    gradient_accumulation_steps, total, inside = 1, 0.0, []
    for j in range(T):
        x, prev = out.states[:, j], out.states[:, j + 1]
        mean, std_dev_t, dt = reference_flow_grpo_step(sigma_schedule, start + j, x,
                                                       policy(x, sigma_schedule[start + j].expand(B)), k["eta"])
        new_log_probs = reference_flow_grpo_log_prob(prev, mean, std_dev_t, dt)
        advantages = torch.clamp(adv, -k["adv_clip_max"], k["adv_clip_max"])
        per_sample, ratio = clipped_policy_loss(advantages, new_log_probs, out.log_probs[:, j], k["clip_range"])
        inside.append((ratio.detach() - 1).abs() <= k["clip_range"])
        policy_loss = torch.mean(per_sample) / (gradient_accumulation_steps * T)
        kl_loss = 0.5 * torch.mean((new_log_probs - out.log_probs[:, j]) ** 2) / (gradient_accumulation_steps * T)
        total = total + policy_loss + kl_coeff * kl_loss
    inside = torch.stack(inside)
    assert 0 < int(inside.sum()) < inside.numel()
    assert_same_loss_and_grads(loss, grads, total, policy)


def test_mixgrpo_parity_defaults_are_the_scripts():
    """The scripts' settings as +mixgrpo / +mixgrpo_flash set them on tiny_cpu (its noise level 0.7 is their eta)."""
    for method in ("mixgrpo", "mixgrpo_flash"):
        c = method_config(method)
        assert c.train.beta == 0 and c.train.sampling_kl_coeff == MIXGRPO["kl_coeff"]
        assert c.train.clip_range == MIXGRPO["clip_range"] and c.train.adv_clip_max == MIXGRPO["adv_clip_max"]
        assert c.sample.same_initial_noise  # --init_same_noise
        assert (c.advantage.std_mode, c.advantage.unbiased_std, c.advantage.eps) == ("group", True, 1e-8)
        assert c.sample.noise_level == MIXGRPO["eta"] and c.sample.window_size == MIXGRPO["window"]
    assert method_config("mixgrpo_flash").sample.post_window_compress == MIXGRPO["compress"]


# ---------------------------------------------------------------- MixGRPO-Flash


def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def reference_flash_rollout(model, noise, sampling_steps, start, w, shift, eta, ratio):
    """sampling_utils.py run_sample_step with dpm_apply_strategy 'post', flow_grpo_sampling, dpmsolver++ order 2,
    midpoint, on train_grpo_flux.py's grid (L187-189: linspace(1, 0, S + 1), time-shifted): Flow-GRPO SDE in the
    window, Euler before it, the DPM state updated with every x0 up to the window's end, then 2M on the compressed
    post-window grid (first order on the last step). Returns (final, schedule, second-order steps taken)."""
    sigmas = sd3_time_shift(shift, torch.linspace(1, 0, sampling_steps + 1))
    last_false_index = start + w - 1
    num_post_steps = int(max((sigmas.shape[0] - 1 - last_false_index) * ratio, 1))
    post_time_step = torch.linspace(1, 0, sigmas.shape[0])[last_false_index + 1].item()
    post = sd3_time_shift(shift, torch.linspace(post_time_step, 0, num_post_steps))
    schedule = torch.cat([sigmas[: last_false_index + 1], post], dim=0)
    model_outputs, lower_order_nums, second_order = [None, None], 0, 0
    z = noise[:, 0].float()
    for i in range(schedule.shape[0] - 1):
        sigma = schedule[i]
        pred = model(z, sigma.expand(z.shape[0]))
        x0 = z - sigma * pred  # convert_model_output
        model_outputs = [model_outputs[1], x0]
        if i <= last_false_index:
            sigma_prev = schedule[i + 1]
            dt = sigma_prev - sigma
            if start <= i:  # flow_grpo_step, stochastic
                std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, schedule[1], sigma))) * eta
                mean = z * (1 + std_dev_t**2 / (2 * sigma) * dt) \
                    + pred * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
                z = mean + std_dev_t * torch.sqrt(-1 * dt) * noise[:, i + 1]
            else:  # determistic: Euler
                z = z + dt * pred
        else:
            sigma_t, sigma_s0 = schedule[i + 1], schedule[i]
            alpha_t = 1 - sigma_t
            lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
            lambda_s0 = torch.log(1 - sigma_s0) - torch.log(sigma_s0)
            h = lambda_t - lambda_s0
            lower_order_final = i == schedule.shape[0] - 2
            if lower_order_nums < 1 or lower_order_final:
                z = (sigma_t / sigma_s0) * z - (alpha_t * (torch.exp(-h) - 1.0)) * x0
            else:
                sigma_s1 = schedule[i - 1]
                lambda_s1 = torch.log(1 - sigma_s1) - torch.log(sigma_s1)
                r0 = (lambda_s0 - lambda_s1) / h
                m0, m1 = model_outputs[-1], model_outputs[-2]
                D0, D1 = m0, (1.0 / r0) * (m0 - m1)
                z = (sigma_t / sigma_s0) * z - (alpha_t * (torch.exp(-h) - 1.0)) * D0 \
                    - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1
                second_order += 1
        lower_order_nums = min(lower_order_nums + 1, 2)  # update_lower_order
    return z, schedule, second_order


# tiny_cpu's 10 steps (shift 1 and 3), and the scripts' 25 steps at shift 3, where every window leaves a post-window
# segment of several steps: its first step is second order on the window's last x0, so the history carried through
# the window acts (on tiny_cpu's 10 steps every post-window segment is one step, first order: it never does)
@pytest.mark.parametrize("steps,shift", [(10, 1.0), (10, 3.0), (MIXGRPO["sampling_steps"], MIXGRPO["shift"])])
def test_mixgrpo_flash_parity_with_sampling_utils_rollout(steps, shift):
    c = method_config("mixgrpo_flash")
    c.sample.num_steps, c.sample.shift = steps, shift
    w, S = c.sample.window_size, c.sample.num_steps
    sched = scheduler_of(c, w)
    model = Velocity(5)
    noise = torch.randn(B, S + 1, *SHAPE, generator=torch.Generator().manual_seed(6))
    compared = history_acted = 0
    for start in range(S - w):
        with torch.no_grad():
            ours = rollout(model, noise, sched, start=start, ode_solver=c.sample.ode_solver,
                           solver_scope=c.sample.ode_solver_scope, post_window_compress=c.sample.post_window_compress)
            theirs, schedule, second_order = reference_flash_rollout(
                model, noise, S, start, MIXGRPO["window"], shift, MIXGRPO["eta"], MIXGRPO["compress"])
        if float(schedule[-1]) > 0:
            # the reference's max(., 1) leaves one post-window point when (S - window end + 1) x 0.4 < 2: its grid
            # then ends at the window's end, above sigma 0 (a noisy sample); recam keeps two points (departure)
            assert int((S - (start + MIXGRPO["window"]) + 1) * MIXGRPO["compress"]) < 2
            assert float(ours.final.abs().max()) < 1e3 and sched.compressed_after(start + w, 0.4).sigmas[-1] == 0
            continue
        torch.testing.assert_close(ours.final, theirs, rtol=1e-4, atol=1e-5)
        compared += 1
        history_acted += second_order > 0
    assert compared > 0
    if steps == MIXGRPO["sampling_steps"]:
        # every start whose post-window grid keeps two points or more (18 of 21) is compared; on the 15 whose grid
        # keeps three or more the first step after the window is second order, on the window's last x0
        assert compared == 18 and history_acted == 15
    elif steps == 10:
        assert history_acted == 0


# ---------------------------------------------------------------- DiffusionNFT


def test_nft_parity_defaults_in_recam_units():
    c = method_config("nft")
    # kl_beta 1e-4 beside a policy loss scaled by adv_clip_max = 5 (train_nft_sd3.py L960, L970)
    assert c.train.beta == pytest.approx(1e-4 / 5) and c.train.adv_clip_max == 5
    assert c.advantage.std_mode == "global" and c.train.nft_beta == 1.0
    assert (c.train.fp_timestep_sampling, c.train.fp_num_timesteps, c.train.fp_grid_fraction) == ("grid", 0, 0.99)
    assert (c.train.old_policy_decay, c.train.old_policy_decay_ramp, c.train.old_policy_decay_flat) == (0.5, 0.001, 0)
    assert c.sample.ode_solver == "dpm2"
    # max_grad_norm 1.0 (config/base.py L79) on the gradient of the x5 loss: 1.0 / 5 on recam's, 5 times smaller
    assert c.train.max_grad_norm == pytest.approx(1.0 / 5)
    # the evaluation EMA (train_nft_sd3.py L565-567): decay 0.9, every optimizer step
    assert c.train.ema and c.train.ema_decay == 0.9


def test_nft_parity_with_train_nft_sd3_loss_and_gradient():
    c = method_config("nft")
    S = c.sample.num_steps
    sched = scheduler_of(c)
    policy = Velocity(0)
    old, reference = perturbed(policy, 0.03, 1), perturbed(policy, 0.08, 2)
    rewards, groups = rewards_and_groups()
    mb = forward_mb(c, policy, old, reference, None, recam_advantages(c, rewards, groups))
    objective = NFTObjective(c.train, sched)
    levels, noise = objective.draws(mb)
    num_train_timesteps = int(S * 0.99)  # L569 with timestep_fraction 0.99
    assert levels.shape == (B, num_train_timesteps)
    loss, grads = run_objective(objective, mb, policy)
    adv = reference_global_std_advantages(rewards, groups)

    # train_nft_sd3.py L862-983 with config.beta = 1.0, train.beta = 1e-4, adv_clip_max 5
    x0, nft_beta, kl_beta, adv_clip_max = mb.final, 1.0, 1e-4, 5
    total = 0.0
    for j_idx in range(num_train_timesteps):
        t = levels[:, j_idx]
        t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
        xt = (1 - t_expanded) * x0 + t_expanded * noise[:, j_idx]
        with torch.no_grad():
            old_prediction = old(xt, t).detach()
            ref_forward_prediction = reference(xt, t)
        forward_prediction = policy(xt, t)
        advantages_clip = torch.clamp(adv, -adv_clip_max, adv_clip_max)
        r = torch.clamp((advantages_clip / adv_clip_max) / 2.0 + 0.5, 0, 1)
        positive_prediction = nft_beta * forward_prediction + (1 - nft_beta) * old_prediction
        implicit_negative_prediction = (1.0 + nft_beta) * old_prediction - nft_beta * forward_prediction
        x0_prediction = xt - t_expanded * positive_prediction
        with torch.no_grad():
            weight_factor = torch.abs(x0_prediction.double() - x0.double()).mean(
                dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001)
        positive_loss = ((x0_prediction - x0) ** 2 / weight_factor).mean(dim=tuple(range(1, x0.ndim)))
        negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
        with torch.no_grad():
            negative_weight_factor = torch.abs(negative_x0_prediction.double() - x0.double()).mean(
                dim=tuple(range(1, x0.ndim)), keepdim=True).clip(min=0.00001)
        negative_loss = ((negative_x0_prediction - x0) ** 2 / negative_weight_factor).mean(
            dim=tuple(range(1, x0.ndim)))
        ori_policy_loss = r * positive_loss / nft_beta + (1.0 - r) * negative_loss / nft_beta
        policy_loss = (ori_policy_loss * adv_clip_max).mean()
        kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=tuple(range(1, x0.ndim)))
        loss_j = policy_loss + kl_beta * torch.mean(kl_div_loss)
        total = total + loss_j / num_train_timesteps  # effective_grad_accum_steps (L801, L983)
    ref_grads = reference_grads(total, policy)
    # recam leaves the constant x5 out of the whole loss (policy and KL alike): the reference is 5 x recam's
    torch.testing.assert_close(adv_clip_max * loss, total.detach().float(), rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(adv_clip_max * ours, theirs.float(), rtol=1e-4, atol=1e-7)
    # and where clipping binds (L996: clip_grad_norm_ at max_grad_norm 1.0, config/base.py L79): at a loss scale
    # where the reference's gradient norm is 3, its clipped gradient is still 5 x recam's clipped at +nft's
    # max_grad_norm, so Adam takes the same step

    def clipped(gradients, max_norm):
        total = float(torch.sqrt(sum((g.double() ** 2).sum() for g in gradients)))
        return [g.double() * min(1.0, max_norm / total) for g in gradients]

    scale = 3.0 / float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads)))
    for ours, theirs in zip(clipped([scale * g for g in grads], c.train.max_grad_norm),
                            clipped([scale * g for g in ref_grads], 1.0), strict=True):
        torch.testing.assert_close(adv_clip_max * ours, theirs, rtol=1e-4, atol=1e-7)


def test_nft_parity_levels_are_a_random_permutation_of_the_grid():
    """train_nft_sd3.py L810-816: each sample's grid timesteps are put in the order of its own torch.randperm, and the
    first int(S x 0.99) of them are trained (L569, L854-864). So a sample's levels are distinct grid levels, the
    level it trains first is uniform over the grid, the one it leaves out too, and the order is no fixed one."""
    c = method_config("nft")
    S, n = c.sample.num_steps, 400
    sched = scheduler_of(c)
    objective = NFTObjective(c.train, sched)
    final = torch.zeros(n, *SHAPE)
    mb = MicroBatch(states=final.new_empty(n, 0, *SHAPE), old_log_probs=torch.empty(n, 0),
                    advantages=torch.zeros(n, 1), sample_weight=torch.full((n,), 1.0 / n),
                    traj_ids=torch.stack([torch.arange(n) // 4, torch.arange(n) % 4], 1), policy=None,
                    reference=None, inner_epoch=0, final=final, epoch=3)
    levels, _ = objective.draws(mb)
    # the reference's grid: the pipeline's timesteps, here the sampling grid's levels before sigma 0
    grid = sched.sigmas[:S].float()
    idx = torch.tensor([[int(torch.isclose(grid, v).nonzero()) for v in row] for row in levels])
    K = int(S * 0.99)
    assert idx.shape == (n, K) and all(len(set(row.tolist())) == K for row in idx)
    first = torch.bincount(idx[:, 0], minlength=S).float() / n
    left_out = torch.bincount(torch.tensor([sum(range(S)) - int(row.sum()) for row in idx]), minlength=S).float() / n
    # uniform over the S = 10 levels: 1/10 each; 400 draws put each share within 0.1 +- 0.06 (about 4 sd)
    assert bool(((first - 1 / S).abs() < 0.06).all()), first
    assert bool(((left_out - 1 / S).abs() < 0.06).all()), left_out
    # no fixed order: sorted rows (ascending or descending) are as rare as a random permutation makes them
    ordered = sum(bool((row.diff() > 0).all() or (row.diff() < 0).all()) for row in idx)
    assert ordered <= 2
    # and a sample's levels follow its own stream: another epoch draws other permutations
    mb.epoch = 4
    assert not torch.equal(objective.draws(mb)[0], levels)


# ---------------------------------------------------------------- AWM


def test_awm_parity_defaults_are_the_preset_s():
    c = method_config("awm")
    assert (c.train.awm_old_kl_weight, c.train.awm_clip_range, c.train.beta) == (1.0, 1.0, 1e-3)
    assert (c.train.awm_weighting, c.train.awm_ghuber_power, c.train.awm_adv_scale) == ("ghuber", 0.25, 5.0)
    assert (c.train.fp_timestep_sampling, c.train.fp_num_timesteps, c.train.fp_grid_fraction) == \
        ("grid_stratified", 6, 0.9)
    assert (c.train.old_policy_decay, c.advantage.std_mode) == (0.3, "global")
    assert (c.sample.ode_solver, c.sample.sa_eta, c.sample.sa_min_sigma, c.sample.sa_max_sigma) == \
        ("sa_solver_pc", 0.4, 0.3, 0.9)  # use_sa_solver, noise_level 0.4, L296's window
    # the evaluation EMA (config/dgx_awm.py L91-92): decay 0.99
    assert c.train.ema and c.train.ema_decay == 0.99


def reference_awm_log_prob(model_output, noise, clean, timestep, power):
    """train_sd3_awm.py compute_log_prob_awm L236-249, weighting 'ghuber'."""
    log_prob = -(model_output.double() - (noise.double() - clean.double())) ** 2
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return -(torch.pow(-log_prob + 1e-10, power) - torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), power)) \
        * timestep.view(-1) / power


@pytest.mark.parametrize("off_policy", [False, True])
def test_awm_parity_with_train_sd3_awm_loss_and_gradient(off_policy):
    c = method_config("awm")
    S = c.sample.num_steps
    sched = scheduler_of(c)
    policy = Velocity(0)
    ema, reference = perturbed(policy, 0.03, 1), perturbed(policy, 0.08, 2)
    # on-policy the reference's ratio is exactly 1 (its old log-probs are the policy's own, L1283-1284); a sampler
    # that differs exercises the ratio and its clip range of 1
    sampler = perturbed(policy, 0.5, 3) if off_policy else copy.deepcopy(policy)
    rewards, groups = rewards_and_groups()
    mb = forward_mb(c, policy, ema, reference, sampler, recam_advantages(c, rewards, groups))
    objective = AWMObjective(c.train, sched)
    levels, noise = objective.draws(mb)
    adv = reference_global_std_advantages(rewards, groups)  # AWM's flow_grpo/stat_tracking.py, global_std True
    # discrete_wo_init (L1197-1204): boundaries linspace(1, int(S x 0.9), 7).long(), one index per bin
    boundaries = torch.linspace(1, int(S * 0.9), steps=6 + 1).long()
    grid = sched.sigmas[:S]
    for row in levels:
        idx = torch.tensor([int(torch.isclose(grid, v).nonzero()) for v in row])
        assert bool(((idx >= boundaries[:-1]) & ((idx < boundaries[1:]) | (idx == boundaries[:-1]))).all())
    loss, grads = run_objective(objective, mb, policy)

    # L1256-1352 with the preset's beta 1e-3, ema_beta 1, clip_range 1, advantage_max 1, kl weights 'Uniform'
    T, power, beta, ema_beta, clip_range, adv_clip_max = 6, 0.25, 1e-3, 1.0, 1.0, 5
    timesteps = levels.T.reshape(-1)  # [T x B], timestep-major as L1212-1220 stack them
    clean = mb.final.repeat(T, 1, 1, 1)
    rnd = noise.transpose(0, 1).reshape(T * B, *SHAPE)
    tv = timesteps.view(-1, 1, 1, 1)
    noised = (1 - tv) * clean + tv * rnd
    model_output = policy(noised, timesteps)
    with torch.no_grad():
        old_log_probs = reference_awm_log_prob(sampler(noised, timesteps), rnd, clean, timesteps, power).reshape(T, B)
        model_output_ref, model_output_ema = reference(noised, timesteps), ema(noised, timesteps)
    log_probs = reference_awm_log_prob(model_output, rnd, clean, timesteps, power).reshape(T, B)
    advantages = torch.clamp(adv, -adv_clip_max, adv_clip_max) / adv_clip_max * 1
    ratio = torch.exp(log_probs.view(-1) - old_log_probs.view(-1))
    advantages = advantages.unsqueeze(0).repeat(T, 1).view(-1)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    mo = model_output.reshape(T, B, *SHAPE)
    kl_loss = ((mo - model_output_ref.reshape(T, B, *SHAPE)) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(dim=0).mean()
    ema_kl_loss = ((mo - model_output_ema.reshape(T, B, *SHAPE)) ** 2).mean(dim=(2, 3, 4), keepdim=True).mean(
        dim=0).mean()
    total = policy_loss + beta * kl_loss + ema_beta * ema_kl_loss
    ref_grads = reference_grads(total, policy)
    if off_policy:
        assert float((ratio.detach() - 1).abs().max()) > 1e-3  # the ratio is exercised
    else:
        assert float((ratio.detach() - 1).abs().max()) < 1e-6
    torch.testing.assert_close(loss.double(), total.detach(), rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-4, atol=1e-7)


def reference_sa_solver_first_order(x, x0, sigma_s, sigma_t, tau, noise):
    """sa_solver.py adams_bashforth_update, order 1, predict_x0 (L253-289) with NoiseScheduleFlowMatching (alpha =
    1 - t, sigma = t): the coefficient of order 1 is the integral of exp((1 + tau^2) lambda) over [lambda_s,
    lambda_t] (get_coefficients_exponential_positive, L136-151)."""
    alpha_t = 1.0 - sigma_t
    lambda_t = math.log(alpha_t) - math.log(sigma_t)
    lambda_s = math.log(1.0 - sigma_s) - math.log(sigma_s)
    h = lambda_t - lambda_s
    k = 1 + tau**2
    coefficient = math.exp(k * lambda_t) * (1 - math.exp(-(k * lambda_t - k * lambda_s))) / k
    gradient_part = k * sigma_t * math.exp(-(tau**2) * lambda_t) * coefficient * x0
    noise_part = sigma_t * math.sqrt(1 - math.exp(-2 * tau**2 * h)) * noise
    return math.exp(-(tau**2) * h) * (sigma_t / sigma_s) * x + gradient_part + noise_part


def test_sa_solver_first_order_step_with_the_awm_stochasticity_window():
    """`sample.ode_solver = "sa_solver"`: SA-Solver's first-order step (no longer +awm's default, which is the
    predictor-corrector below)."""
    c = method_config("awm")
    sched = scheduler_of(c)
    model = Velocity(9)
    noise = torch.randn(B, c.sample.num_steps + 1, *SHAPE, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ours = rollout(model, noise, sched, ode_solver="sa_solver", sa_eta=c.sample.sa_eta,
                       sa_sigma_range=(c.sample.sa_min_sigma, c.sample.sa_max_sigma)).final
        x, noisy = noise[:, 0].double(), 0
        for j in range(c.sample.num_steps):
            s, s_next = float(sched.sigmas[j]), float(sched.sigmas[j + 1])
            v = model(x.float(), sched.sigmas[j].expand(B)).double()
            x0 = x - s * v
            tau = 0.4 if 0.3 <= s_next <= 0.9 else 0.0  # stochasticity_control_function, pipeline L296
            if s_next == 0:
                x = x0
            elif s == 1.0:  # lambda_s = -inf: the limit of the same step (exp(-tau^2 h) -> 0 for tau > 0)
                x = (1 - s_next) * x0 + (s_next * noise[:, j + 1].double() if tau > 0 else s_next * x)
            else:
                x = reference_sa_solver_first_order(x, x0, s, s_next, tau, noise[:, j + 1].double())
            noisy += tau > 0
    assert noisy == 7  # the steps ending at sigma 0.9, 0.8, ..., 0.3 of the 10-step linear grid draw noise
    torch.testing.assert_close(ours.double(), x, rtol=1e-4, atol=1e-5)
    # tau 0 is Euler: without the stochasticity the sampler is the deterministic rollout
    with torch.no_grad():
        euler = rollout(model, noise, sched).final
        quiet = rollout(model, noise, sched, ode_solver="sa_solver", sa_eta=0.0).final
    torch.testing.assert_close(quiet, euler, rtol=1e-5, atol=1e-6)


class ReferenceSASolver:
    """sa_solver.py SASolver (be51372) with NoiseScheduleFlowMatching (alpha = 1 - t, sigma = t), algorithm_type
    "data_prediction", as sd3_pipeline_with_logprob.py L271-297 calls it: predictor_order 2, corrector_order 2,
    pc_mode "PEC", the "few steps" updates; written out here step by step in float64 from its code."""

    def __init__(self, model):
        self.model = model

    @staticmethod
    def lam(t):
        return math.log(1.0 - t) - math.log(t)  # marginal_lambda

    def data_prediction(self, x, t):
        return x - t * self.model(x.float(), torch.full((x.shape[0],), t)).double()

    @staticmethod
    def exponential_positive(order, start, end, tau):
        """get_coefficients_exponential_positive L136-163: the integral of exp((1 + tau^2) x) x^order over
        [start, end], after the change of variable."""
        k = 1 + tau**2
        e, s_ = k * end, k * start
        if order == 0:
            return math.exp(e) * (1 - math.exp(-(e - s_))) / k
        if order == 1:
            return math.exp(e) * ((e - 1) - (s_ - 1) * math.exp(-(e - s_))) / k**2
        raise AssertionError("orders 0 and 1 suffice for order 2")

    @staticmethod
    def lagrange(order, lambda_list):
        """lagrange_polynomial_coefficient L165-226 (orders 0 and 1)."""
        if order == 0:
            return [[1]]
        l0, l1 = lambda_list
        return [[1 / (l0 - l1), -l1 / (l0 - l1)], [1 / (l1 - l0), -l0 / (l1 - l0)]]

    def coefficients(self, order, start, end, lambda_list, tau):
        """get_coefficients_fn L228-251 (predict_x0)."""
        lagrange = self.lagrange(order - 1, lambda_list)
        return [sum(lagrange[i][j] * self.exponential_positive(order - 1 - j, start, end, tau) for j in range(order))
                for i in range(order)]

    def update(self, corrector, order, x, tau, model_prev_list, t_prev_list, noise, t):
        """adams_bashforth_update_few_steps L331-383 (corrector False) / adams_moulton_update_few_steps L385-436."""
        sigma_t, lambda_t = t, self.lam(t)
        sigma_prev = t_prev_list[-1]
        h = lambda_t - self.lam(t_prev_list[-1])
        t_list = t_prev_list + [t] if corrector else t_prev_list
        lambda_list = [self.lam(t_list[-(i + 1)]) for i in range(order)]
        c = self.coefficients(order, self.lam(t_prev_list[-1]), lambda_t, lambda_list, tau)
        k = 1 + tau**2
        if order == 2:
            if corrector:
                extra = math.exp(k * lambda_t) * (h / 2 - (h * k - 1 + math.exp(k * (-h))) / (k**2 * h))
            else:
                extra = math.exp(k * lambda_t) * (h**2 / 2 - (h * k - 1 + math.exp(k * (-h))) / k**2) / (
                    self.lam(t_prev_list[-1]) - self.lam(t_prev_list[-2]))
            c[0] += extra
            c[1] -= extra
        gradient_part = sum(k * sigma_t * math.exp(-(tau**2) * lambda_t) * c[i] * model_prev_list[-(i + 1)]
                            for i in range(order))
        noise_part = sigma_t * math.sqrt(1 - math.exp(-2 * tau**2 * h)) * noise
        return math.exp(-(tau**2) * h) * (sigma_t / sigma_prev) * x + gradient_part + noise_part

    def sample(self, x, tau, timesteps, noise_of, predictor_order=2, corrector_order=2):
        """SASolver.sample L442-559, PEC, disable_first_corrector, skip_final_step, lower_order_final; noise_of(step)
        is the draw its torch.randn_like makes at that step."""
        steps = len(timesteps) - 1
        t_prev_list = [timesteps[0]]
        model_prev_list = [self.data_prediction(x, timesteps[0])]
        for step in range(1, max(predictor_order, corrector_order - 1)):
            t = timesteps[step]
            predictor_order_used = min(predictor_order, step)
            noise = noise_of(step)
            x_p = self.update(False, predictor_order_used, x, tau(t), model_prev_list, t_prev_list, noise, t)
            model_prev_list.append(self.data_prediction(x_p, t))
            x = x_p  # the first corrector is disabled
            t_prev_list.append(t)
        for step in range(max(predictor_order, corrector_order - 1), steps + 1):
            predictor_order_used = min(predictor_order, steps - step + 1)
            corrector_order_used = min(corrector_order, steps - step + 2)
            t = timesteps[step]
            noise = noise_of(step) if step < steps else None
            if step == steps:
                x_p = model_prev_list[-1]  # denoise_to_zero
            else:
                x_p = self.update(False, predictor_order_used, x, tau(t), model_prev_list, t_prev_list, noise, t)
            if step < steps:
                model_prev_list.append(self.data_prediction(x_p, t))
                x = self.update(True, corrector_order_used, x, tau(t), model_prev_list, t_prev_list, noise, t)
            else:
                x = x_p
            t_prev_list.append(t)
            del model_prev_list[0]
        return x


@pytest.mark.parametrize("steps,shift", [(10, 1.0), (14, 3.0)])
def test_awm_sampler_parity_with_sa_solver_predictor_corrector(steps, shift):
    """+awm's sampler against sa_solver.py's order-2 PEC sampler on the pipeline's grid: tiny_cpu's 10 steps and the
    geneval preset's 14 at its time shift 3 (dgx_awm.py L37, L89)."""
    c = method_config("awm")
    c.sample.num_steps, c.sample.shift = steps, shift
    assert c.sample.ode_solver == "sa_solver_pc"
    sched = scheduler_of(c)
    model = Velocity(9)
    noise = torch.randn(B, steps + 1, *SHAPE, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ours = rollout(model, noise, sched, ode_solver=c.sample.ode_solver, sa_eta=c.sample.sa_eta,
                       sa_sigma_range=(c.sample.sa_min_sigma, c.sample.sa_max_sigma)).final
        # the pipeline's grid (L272-274): its scheduler's sigmas, here linspace(1, 0, S + 1) time-shifted (recam's
        # grid, a departure for Flow-GRPO's SD3 scheduler), then t[-2] = t[-3] / 2 and t[0] = 1 - 1e-3
        t = [float(v) for v in sd3_time_shift(shift, torch.linspace(1, 0, steps + 1).double())]
        t[-2] = t[-3] / 2
        t[0] = 1 - 1e-3
        noise_level = 0.4  # config.sample.noise_level of geneval_sd3_no_cfg_1node (dgx_awm.py L48)
        tau = lambda time: noise_level if 0.3 <= time <= 0.9 else 0  # noqa: E731 (the pipeline's L296)
        theirs = ReferenceSASolver(model).sample(noise[:, 0].double(), tau, t, lambda i: noise[:, i].double())
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-4, atol=1e-5)
    # the stochasticity acts (a change of the noise after step 0 moves the sample) and so does the corrector
    with torch.no_grad():
        quiet = rollout(model, noise, sched, ode_solver="sa_solver_pc", sa_eta=0.0).final
        first_order = rollout(model, noise, sched, ode_solver="sa_solver", sa_eta=c.sample.sa_eta,
                              sa_sigma_range=(c.sample.sa_min_sigma, c.sample.sa_max_sigma)).final
    assert float((quiet - ours).abs().max()) > 1e-3 and float((first_order - ours).abs().max()) > 1e-3


def test_sa_solver_pc_without_noise_is_second_order_on_an_exact_velocity():
    """tau = 0: a deterministic order-2 multistep solver. On the Gaussian flow x0 ~ N(0, s^2), whose exact velocity is
    v(x, t) = x (t - s^2 (1 - t)) / (t^2 + s^2 (1 - t)^2), halving the step size cuts its error about 4 times."""
    from recam.engine.sde import flow_sa_solver_pc, sa_solver_grid

    s2 = 0.25

    def velocity(x, t):
        tt = t.double().reshape(-1, 1)
        return (x.double() * (tt - s2 * (1 - tt)) / (tt**2 + s2 * (1 - tt) ** 2)).float()

    x1 = torch.randn(64, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    errors = []
    for n in (20, 40, 80):
        grid = sa_solver_grid(torch.linspace(1, 0, n + 1))
        t0 = float(grid[0])
        start = x1 * math.sqrt(t0**2 + s2 * (1 - t0) ** 2)  # the exact marginal's scale at t0
        out = flow_sa_solver_pc(velocity, start, grid, lambda t: 0.0, None)
        errors.append(float((out - x1 * math.sqrt(s2)).abs().max()))
    assert errors[0] / errors[1] > 3.0 and errors[1] / errors[2] > 3.0, errors


def test_kl_sums_over_elements_when_the_log_probs_do():
    """motion.log_prob_reduction='sum': the log-ratio is a sum over elements, so the KL term is too (it used to be
    an element mean beside a summed policy term, D times weaker than intended)."""
    from recam.engine.losses import get_kl_estimator

    g = torch.Generator().manual_seed(0)
    cur, ref = torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 6, generator=g)
    x = cur + 0.3 * torch.randn(4, 5, 6, generator=g)
    mask = (torch.rand(4, 1, 6, generator=g) > 0.3).float()
    for name in ("gaussian_mean", "k1", "k2", "k3"):
        kl = get_kl_estimator(name)
        mean = kl(cur, ref, 0.3, x, mask)
        summed = kl(cur, ref, 0.3, x, mask, "sum")
        count = torch.broadcast_to(mask, cur.shape).sum(dim=(1, 2))
        torch.testing.assert_close(summed, mean * count)
    # and the GRPO objective passes its scheduler's reduction on: its KL penalty is D times the element mean's
    c = method_config("flow_grpo")
    policy, reference = Velocity(0), perturbed(Velocity(0), 0.05, 2)
    penalties = {}
    for reduction in ("mean", "sum"):
        s = c.sample
        sched = FlowMatchScheduler(s.num_steps, s.shift, s.noise_level, s.sde_type, 2, reduction=reduction)
        noise = torch.randn(B, s.num_steps + 1, *SHAPE, generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            out = rollout(policy, noise, sched)
        mb = MicroBatch(states=out.states, old_log_probs=out.log_probs, advantages=torch.zeros(B, 2),
                        sample_weight=torch.full((B,), 1.0 / B), traj_ids=torch.zeros(B, 2, dtype=torch.long),
                        policy=policy, reference=reference, inner_epoch=0)
        metrics = GRPOObjective(c.train, sched).accumulate(mb, lambda loss, last: None)
        penalties[reduction] = torch.stack([m["kl_penalty"] for m in metrics])
    assert bool((penalties["mean"] > 0).all())
    torch.testing.assert_close(penalties["sum"], penalties["mean"] * math.prod(SHAPE), rtol=1e-5, atol=0)


# ---------------------------------------------------------------- evaluation EMA (DiffusionNFT, AWM)


@pytest.mark.parametrize("method,decay", [("nft", 0.9), ("awm", 0.99)])
def test_evaluation_ema_parity_with_ema_module_wrapper(method, decay):
    """flow_grpo/ema.py EMAModuleWrapper (DiffusionNFT's and AWM's copy), update_step_interval 1: at its s-th update
    (s = global_step, 1 after the first optimizer step) ema += (1 - min((1 + s) / (10 + s), decay)) (p - ema). The
    policy's EMA that +nft / +awm build (recam.engine.policy.build_policy) against that loop, written out."""
    from recam.engine.policy import build_policy

    class Domain:
        def build_policy(self):
            return Velocity(0)

    c = method_config(method)
    policy, _, _, ema = build_policy(Domain(), c.model, c.train, "cpu")
    ema_parameters = [p.detach().clone() for p in policy.parameters()]
    g = torch.Generator().manual_seed(12)
    for global_step in range(1, 40):
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        ema.step(policy.parameters())
        one_minus_decay = 1 - min((1 + global_step) / (10 + global_step), decay)
        for ema_parameter, parameter in zip(ema_parameters, policy.parameters(), strict=True):
            ema_parameter.add_(one_minus_decay * (parameter.detach() - ema_parameter))
    for ours, theirs in zip(ema.shadow_params, ema_parameters, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
