"""Policy-optimisation methods as changes to a preset: `--config config/grpo.py:<preset>+<method>`.

One list (METHODS) that scripts/bench/bench_time_to_reward.py compares and any preset can take. Each method only sets
the fields that define it; everything else (model, rewards, group size, conditions per epoch, evaluation) stays the
preset's, so methods differ in the algorithm alone. Formulas: recam/engine/extensions/fast_objectives.py (objectives)
and recam/engine/rollout.py (windows, solvers); defaults and their sources in docs/time_to_reward.md.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_collections

# domains whose scheduler is flow matching (GRPO-Guard's normalisation and DPM-Solver++ on x0 are written for it)
FLOW_DOMAINS = ("camera",)


def _flow(c: ml_collections.ConfigDict) -> bool:
    return c.domain in FLOW_DOMAINS


def preset(c: ml_collections.ConfigDict) -> None:
    """The preset as it is (its own window / timestep_fraction: tiny_cpu trains the 5 noisiest of 10 steps)."""


# Flow-GRPO's public presets (yifan123/flow_grpo config/grpo.py at ac4c86e: geneval_sd3, general_ocr_sd3; beta 0.01
# for pickscore_sd3) and config/base.py (clip_range 1e-4). Its KL term, mean_e (mu - mu_ref)^2 / (2 std_dev_t^2),
# leaves out the step's |dt| that recam's exact Gaussian KL divides by, so its beta on a grid of uniform steps
# (|dt| = 1 / S) is beta / S here.
FLOW_GRPO_KL_BETA, FLOW_GRPO_CLIP_RANGE = 0.04, 1e-4


def flow_grpo(c: ml_collections.ConfigDict) -> None:
    """Flow-GRPO's recipe, the baseline: stochastic on every step, every step but the last (deterministic) trained;
    advantages centred per prompt over the std of all the epoch's rewards (its presets' sample.global_std); on flow
    domains its clip range 1e-4 and KL weight 0.04 in recam's units (above; the DDIM domains keep the preset's,
    since those numbers are in the flow SDE's log-prob units)."""
    c.train.objective = "grpo"
    c.sample.window_size = c.sample.num_steps - 1
    c.sample.window_mode, c.sample.window_start = "fixed", 0
    c.advantage.std_mode = "global"
    if _flow(c):
        c.train.clip_range = FLOW_GRPO_CLIP_RANGE
        c.train.beta = FLOW_GRPO_KL_BETA / c.sample.num_steps


def flow_grpo_balanced(c: ml_collections.ConfigDict) -> None:
    """Flow-GRPO's recipe with its steps' losses weighted by std_j / |d mean_j / d output| (train.step_weighting
    "score_balanced"), so the low-noise steps' larger log-prob gradients do not make up most of the update."""
    flow_grpo(c)
    c.train.step_weighting = "score_balanced"


def flow_grpo_fast(c: ml_collections.ConfigDict) -> None:
    """Flow-GRPO-Fast: an ODE trajectory with a window of 2 stochastic, trained steps, placed at a random start
    each epoch so that the whole window lies in the noisier half: start <= num_steps // 2 - 2 (the reference draws
    randint(0, num_steps // 2 - window))."""
    c.train.objective = "grpo"
    c.sample.window_size = 2
    c.sample.window_mode, c.sample.window_start = "random", 0
    c.sample.window_max_start = max(0, c.sample.num_steps // 2 - c.sample.window_size)


# MixGRPO's public scripts (Tencent-Hunyuan/MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO.sh and _Flash.sh
# at e5cdd6a): --kl_coeff 0.0, --clip_range 1e-4, --init_same_noise; fastvideo/train_grpo_flux.py L445-449: group
# std with Bessel's correction (torch's .std()) + 1e-8.
MIXGRPO_CLIP_RANGE, MIXGRPO_STD_EPS = 1e-4, 1e-8


def mixgrpo(c: ml_collections.ConfigDict) -> None:
    """MixGRPO: a window of up to 4 stochastic steps sliding one step later every 2 epochs and back to the start
    after the last (progressive with roll-back, the public scripts' prog_overlap_step 1), ODE elsewhere. The
    scripts shift every 25 (Flash: 20) iterations of a run of hundreds; 2 epochs is that pace for runs of tens.
    As the scripts train: no KL term and no reference model (kl_coeff 0; its form, 0.5 mean (log p - log p_old)^2,
    is train.sampling_kl_coeff), advantages over the group's Bessel-corrected std + 1e-8, a group's k copies from
    one initial noise (init_same_noise), and on flow domains clip range 1e-4 (its log-probs are Flow-GRPO's)."""
    c.train.objective = "grpo"
    c.train.beta, c.train.sampling_kl_coeff = 0.0, 0.0
    c.advantage.std_mode, c.advantage.unbiased_std, c.advantage.eps = "group", True, MIXGRPO_STD_EPS
    c.sample.same_initial_noise = True
    if _flow(c):
        c.train.clip_range = MIXGRPO_CLIP_RANGE
    w = min(4, c.sample.num_steps - 1)
    c.sample.window_size = w
    c.sample.window_mode, c.sample.window_start = "progressive", 0
    c.sample.window_max_start = -1  # the latest start that fits, whatever num_steps a preset sets later
    c.sample.window_shift_every = 2


def mixgrpo_flash(c: ml_collections.ConfigDict) -> None:
    """MixGRPO-Flash: MixGRPO with DPM-Solver++(2M) after the window only, on the rest of the grid compressed to
    0.4 of its points (the public script's dpm_apply_strategy "post", dpm_post_compress_ratio 0.4); Euler before
    the window. Flow domains; elsewhere MixGRPO."""
    mixgrpo(c)
    if _flow(c):
        c.sample.ode_solver, c.sample.ode_solver_scope, c.sample.post_window_compress = "dpm2", "after_window", 0.4


def grpo_guard(c: ml_collections.ConfigDict) -> None:
    """GRPO-Guard on Flow-GRPO's recipe: ratio normalisation and 1/|dt| step weights. The normalised log-ratio is
    the raw one times the step's std (about 0.2 on these schedules), so the clip range shrinks with it."""
    flow_grpo(c)
    c.train.objective = "grpo_guard"
    c.train.clip_range = c.train.clip_range * 0.25


# DiffusionNFT's public script (NVlabs/DiffusionNFT scripts/train_nft_sd3.py, config/nft.py) in recam's units.
# Its policy loss carries a x adv_clip_max (5) factor that recam's nft_loss leaves out (a constant step-size factor
# under Adam), so its kl_beta 1e-4 on the velocity MSE is 1e-4 / 5 here.
# The same holds for gradient clipping: its max_grad_norm 1.0 (config/base.py L79) bounds the gradient of the x5 loss,
# 5 times recam's, so the same clipped update takes 1.0 / 5 here. Its evaluation EMA: decay 0.9, updated every
# optimizer step (train_nft_sd3.py L565-567, L1023-1029).
NFT_REFERENCE_KL_BETA, NFT_POLICY_SCALE = 1e-4, 5.0
NFT_REFERENCE_MAX_GRAD_NORM, NFT_EMA_DECAY = 1.0, 0.9


def nft(c: ml_collections.ConfigDict) -> None:
    """DiffusionNFT as its public script runs it: deterministic sampling by the old policy (DPM-Solver++(2M) on
    flow domains); advantages centred per group over the std of all rewards (sample.global_std); every final sample
    re-noised at int(0.99 S) distinct levels of the sampling grid (its timestep_fraction 0.99: 9 of 10); implicit
    positive / negative policies; the KL weight 1e-4 / 5 (above); the old policy an average of the policy whose
    weight ramps by 0.001 per optimizer step up to 0.5 (decay_type 1; its ocr preset's decay_type 2 is
    train.old_policy_decay_flat 75, old_policy_decay_ramp 0.0075, old_policy_decay 0.999); gradient clipping at
    1.0 / 5 (above); evaluation with an EMA of the weights (decay 0.9)."""
    c.train.objective = "nft"
    c.train.beta = NFT_REFERENCE_KL_BETA / NFT_POLICY_SCALE
    c.train.max_grad_norm = NFT_REFERENCE_MAX_GRAD_NORM / NFT_POLICY_SCALE
    c.train.ema, c.train.ema_decay = True, NFT_EMA_DECAY
    c.advantage.std_mode = "global"
    c.train.fp_timestep_sampling, c.train.fp_num_timesteps, c.train.fp_grid_fraction = "grid", 0, 0.99
    if _flow(c):
        c.sample.ode_solver = "dpm2"


# AWM's presets evaluate an EMA of the weights: config/dgx_awm.py L91-92 (ema_decay 0.99, ema_update_step_interval
# 1), stepped once per epoch (scripts/train_sd3_awm.py L1391-1392)
AWM_EMA_DECAY = 0.99


def awm(c: ml_collections.ConfigDict) -> None:
    """Advantage weighted matching as its public presets run it (scxue/advantage_weighted_matching
    config/dgx_awm.py, geneval_sd3_no_cfg_1node): the clipped ratio (clip 1) of generalised-Huber matching losses
    (power 0.25, weighted by the noise level) against the weights that sampled, at 6 grid levels stratified over
    [1, int(0.9 S)); KL 1e-3 to the reference and weight 1 to the old policy (an average ramping by 0.001 per step
    up to 0.3, kl_ema_decay), both as velocity MSE; advantages over the global std; sampling with SA-Solver's
    stochasticity 0.4 on the steps that end at sigma in [0.3, 0.9], its order-2 predictor-corrector on the pipeline's
    grid (flow domains); evaluation with an EMA of the weights (decay 0.99, the presets' train.ema_decay)."""
    c.train.objective = "awm"
    c.train.ema, c.train.ema_decay = True, AWM_EMA_DECAY
    c.train.old_policy_decay = 0.3
    c.train.awm_old_kl_weight = 1.0
    c.train.awm_clip_range = 1.0
    c.train.beta = 1e-3
    c.advantage.std_mode = "global"
    c.train.fp_timestep_sampling, c.train.fp_num_timesteps, c.train.fp_grid_fraction = "grid_stratified", 6, 0.9
    c.train.awm_weighting, c.train.awm_ghuber_power = "ghuber", 0.25
    if _flow(c):
        c.sample.ode_solver = "sa_solver_pc"
        c.sample.sa_eta, c.sample.sa_min_sigma, c.sample.sa_max_sigma = 0.4, 0.3, 0.9


METHODS: dict[str, Callable[[ml_collections.ConfigDict], None]] = {
    "preset": preset, "flow_grpo": flow_grpo, "flow_grpo_balanced": flow_grpo_balanced,
    "flow_grpo_fast": flow_grpo_fast, "mixgrpo": mixgrpo,
    "mixgrpo_flash": mixgrpo_flash, "grpo_guard": grpo_guard, "nft": nft, "awm": awm,
}


def apply_method(c: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} after '+' in the preset name; known methods: {sorted(METHODS)}")
    METHODS[name](c)
    c.run_name = f"{c.run_name}+{name}"
    return c
