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


def flow_grpo(c: ml_collections.ConfigDict) -> None:
    """Flow-GRPO's recipe, the baseline: stochastic on every step, every step but the last (deterministic) trained."""
    c.train.objective = "grpo"
    c.sample.window_size = c.sample.num_steps - 1
    c.sample.window_mode, c.sample.window_start = "fixed", 0


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


def mixgrpo(c: ml_collections.ConfigDict) -> None:
    """MixGRPO: a window of up to 4 stochastic steps sliding one step later every 2 epochs and back to the start
    after the last (progressive with roll-back, the public scripts' prog_overlap_step 1), ODE elsewhere. The
    scripts shift every 25 (Flash: 20) iterations of a run of hundreds; 2 epochs is that pace for runs of tens."""
    c.train.objective = "grpo"
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
NFT_REFERENCE_KL_BETA, NFT_POLICY_SCALE = 1e-4, 5.0


def nft(c: ml_collections.ConfigDict) -> None:
    """DiffusionNFT as its public script runs it: deterministic sampling by the old policy (DPM-Solver++(2M) on
    flow domains); advantages centred per group over the std of all rewards (sample.global_std); every final sample
    re-noised at int(0.99 S) distinct levels of the sampling grid (its timestep_fraction 0.99: 9 of 10); implicit
    positive / negative policies; the KL weight 1e-4 / 5 (above); the old policy an average of the policy whose
    weight ramps by 0.001 per optimizer step up to 0.5 (decay_type 1)."""
    c.train.objective = "nft"
    c.train.beta = NFT_REFERENCE_KL_BETA / NFT_POLICY_SCALE
    c.advantage.std_mode = "global"
    c.train.fp_timestep_sampling, c.train.fp_num_timesteps, c.train.fp_grid_fraction = "grid", 0, 0.99
    if _flow(c):
        c.sample.ode_solver = "dpm2"


def awm(c: ml_collections.ConfigDict) -> None:
    """Advantage weighted matching as its public presets run it (scxue/advantage_weighted_matching
    config/dgx_awm.py, geneval_sd3_no_cfg_1node): the clipped ratio (clip 1) of generalised-Huber matching losses
    (power 0.25, weighted by the noise level) against the weights that sampled, at 6 grid levels stratified over
    [1, int(0.9 S)); KL 1e-3 to the reference and weight 1 to the old policy (an average ramping by 0.001 per step
    up to 0.3, kl_ema_decay), both as velocity MSE; advantages over the global std; sampling with SA-Solver's
    stochasticity 0.4 on the steps that end at sigma in [0.3, 0.9] (flow domains; first order here, see
    docs/methods.md)."""
    c.train.objective = "awm"
    c.train.old_policy_decay = 0.3
    c.train.awm_old_kl_weight = 1.0
    c.train.awm_clip_range = 1.0
    c.train.beta = 1e-3
    c.advantage.std_mode = "global"
    c.train.fp_timestep_sampling, c.train.fp_num_timesteps, c.train.fp_grid_fraction = "grid_stratified", 6, 0.9
    c.train.awm_weighting, c.train.awm_ghuber_power = "ghuber", 0.25
    if _flow(c):
        c.sample.ode_solver, c.sample.sa_eta, c.sample.sa_min_sigma, c.sample.sa_max_sigma = "sa_solver", 0.4, 0.3, 0.9


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
